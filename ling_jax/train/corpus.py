"""The training corpus: the Python standard library sources of the running interpreter, packed once.

Selection (deterministic): every `*.py` file under `sysconfig.get_paths()["stdlib"]`, walked in sorted order,
skipping any path with a directory component `site-packages`, `__pycache__`, `test`, `tests`, `idle_test` or
starting with `test_` / `tests_`, and files named `test_*.py`. Files that are not UTF-8 are skipped. The split is by
file: a file is held out iff int(sha1(relative path)[:8], 16) % 100 < holdout_pct (default 2); the rest trains.

The packed corpus (what the trainer and the device read, so that a machine with another Python patch release
trains on the same text) is one `corpus.json.xz`:
    {"python": sys.version, "stdlib": root, "holdout_pct": 2, "files": [{"path", "split", "sha1"}, ...],
     "file_list_sha256": sha256 of the newline-joined relative paths, "texts": [...] (same order)}
and, once a tokenizer exists, `tokens-{train,heldout}.npy` (uint16, files joined by <|endoftext|>).

    python -m ling_jax.train.corpus --out .data/stdlib              # pack the corpus
    python -m ling_jax.train.corpus --out .data/stdlib --tokenizer models/ling-demo   # + token arrays
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import sys
import sysconfig
from dataclasses import dataclass

import numpy as np

SKIP_DIRS = ("site-packages", "__pycache__", "test", "tests", "idle_test")
CORPUS_FILE = "corpus.json.xz"


def is_test_path(rel: str) -> bool:
    parts = rel.split("/")
    dirs, name = parts[:-1], parts[-1]
    if any(d in SKIP_DIRS or d.startswith(("test_", "tests_")) for d in dirs):
        return True
    return name.startswith("test_")


def heldout(rel: str, pct: int) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 100 < pct


def stdlib_files(root: str | None = None) -> tuple[str, list[str]]:
    """(root, sorted relative paths of the selected *.py files)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                if not is_test_path(rel):
                    out.append(rel)
    return root, sorted(out)


def file_list_hash(paths: list[str]) -> str:
    return hashlib.sha256("\n".join(paths).encode()).hexdigest()


def package_files(site: str) -> list[str]:
    """Sorted relative paths of the selected *.py files of an installed site-packages dir (same test rule)."""
    out = []
    for d, dirs, files in os.walk(site):
        rel_d = os.path.relpath(d, site).replace(os.sep, "/")
        if rel_d == ".":
            dirs[:] = [x for x in dirs if not x.endswith((".dist-info", ".egg-info")) and not x.startswith("__editable__")]
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py") and not (rel_d == "." and f.startswith("__editable__")):
                rel = f if rel_d == "." else f"{rel_d}/{f}"
                if not is_test_path(rel):
                    out.append(rel)
    return sorted(out)


def distributions(site: str) -> dict[str, str]:
    """{distribution name: version} of the packages installed in `site`."""
    from importlib import metadata

    dists = [d for d in metadata.distributions(path=[site]) if d.metadata.get("Name")]  # skip broken dist-info
    return dict(sorted((d.metadata["Name"], d.version) for d in dists))


def data_like(text: str, max_mean_line: int = 120) -> bool:
    """Generated tables, not code: very long lines on average (e.g. unicode data, embedded blobs)."""
    lines = text.count("\n") + 1
    return len(text) / lines > max_mean_line


def _read(path: str) -> tuple[bytes, str] | None:
    raw = open(path, "rb").read()
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def build(out_dir: str, holdout_pct: int = 2, root: str | None = None, site_packages: str | None = None,
          max_file_bytes: int = 1_000_000, near_threshold: float = 0.7, package_cap_bytes: int | None = None) -> dict:
    """Pack the corpus. Without site_packages: the standard library alone, no dedup (the v1 corpus). With it: the
    stdlib plus that dir's *.py files (paths prefixed `site-packages/`, all in train), files over max_file_bytes or
    data_like dropped, deduplicated (ling_jax.train.dedup; held-out first, so train copies of held-out files go),
    then each top-level package capped at package_cap_bytes (files kept in sha1(path) order)."""
    from ling_jax.train.dedup import Deduper

    root, paths = stdlib_files(root)
    cands = [(rel, os.path.join(root, rel), "heldout" if heldout(rel, holdout_pct) else "train") for rel in paths]
    if site_packages:
        cands.sort(key=lambda c: c[2] != "heldout")  # held-out first: they win every duplicate group
        cands += [(f"site-packages/{rel}", os.path.join(site_packages, rel), "train")
                  for rel in package_files(site_packages)]
    files, texts, dropped = [], [], []
    dedup = Deduper(near_threshold) if site_packages else None
    for rel, path, split in cands:
        got = _read(path)
        if got is None:
            dropped.append({"path": rel, "why": "not utf-8"})
            continue
        raw, text = got
        if dedup is not None:
            if len(raw) > max_file_bytes or data_like(text):
                dropped.append({"path": rel, "why": "size" if len(raw) > max_file_bytes else "data-like"})
                continue
            dup = dedup.offer(raw, text)
            if dup is not None:
                dropped.append({"path": rel, "why": dup[0], "of": files[dup[1]]["path"]})
                continue
        files.append({"path": rel, "split": split, "sha1": hashlib.sha1(raw).hexdigest()})
        texts.append(text)
    if package_cap_bytes:
        files, texts, capped = cap_packages(files, texts, package_cap_bytes)
        dropped += capped
    order = sorted(range(len(files)), key=lambda i: files[i]["path"])
    files, texts = [files[i] for i in order], [texts[i] for i in order]
    meta = {"python": sys.version, "stdlib": root, "holdout_pct": holdout_pct, "files": files,
            "file_list_sha256": file_list_hash([f["path"] for f in files])}
    if site_packages:
        meta.update(site_packages=site_packages, distributions=distributions(site_packages), dropped=dropped,
                    max_file_bytes=max_file_bytes, near_threshold=near_threshold, package_cap_bytes=package_cap_bytes)
    os.makedirs(out_dir, exist_ok=True)
    with lzma.open(os.path.join(out_dir, CORPUS_FILE), "wt", encoding="utf-8") as f:
        json.dump({**meta, "texts": texts}, f)
    return meta


def top_package(rel: str) -> str:
    parts = rel.split("/")
    return parts[1].removesuffix(".py") if parts[0] == "site-packages" else "stdlib"


def cap_packages(files: list[dict], texts: list[str], cap: int) -> tuple[list[dict], list[str], list[dict]]:
    """Keep at most `cap` bytes of each top-level site-package (stdlib uncapped), files in sha1(path) order."""
    used: dict[str, int] = {}
    keep, capped = set(), []
    for i in sorted(range(len(files)), key=lambda i: hashlib.sha1(files[i]["path"].encode()).hexdigest()):
        pkg, n = top_package(files[i]["path"]), len(texts[i].encode())
        if pkg != "stdlib" and used.get(pkg, 0) + n > cap:
            capped.append({"path": files[i]["path"], "why": "package cap"})
            continue
        used[pkg] = used.get(pkg, 0) + n
        keep.add(i)
    idx = sorted(keep)
    return [files[i] for i in idx], [texts[i] for i in idx], capped


@dataclass
class Corpus:
    meta: dict
    texts: list[str]

    def split(self, name: str) -> list[str]:
        return [t for f, t in zip(self.meta["files"], self.texts) if f["split"] == name]

    def paths(self, name: str) -> list[str]:
        return [f["path"] for f in self.meta["files"] if f["split"] == name]

    def summary(self) -> dict:
        out = {k: v for k, v in self.meta.items() if k not in ("files", "dropped")}
        if "dropped" in self.meta:
            whys = [d["why"] for d in self.meta["dropped"]]
            out["dropped"] = {w: whys.count(w) for w in sorted(set(whys))}
        for s in ("train", "heldout"):
            texts = self.split(s)
            out[f"{s}_files"] = len(texts)
            out[f"{s}_bytes"] = sum(len(t.encode()) for t in texts)
        return out


def load(out_dir: str) -> Corpus:
    with lzma.open(os.path.join(out_dir, CORPUS_FILE), "rt", encoding="utf-8") as f:
        d = json.load(f)
    texts = d.pop("texts")
    return Corpus(d, texts)


def tokenize_splits(corpus: Corpus, tokenizer, out_dir: str, eos_id: int, compress: bool = False) -> dict:
    """Encode each split as one uint16 stream: file, <eos>, file, <eos>, ... Returns token counts.
    compress: write `tokens-{split}.npy.xz` (the .npy bytes, xz) instead of `.npy`, to carry a big corpus."""
    counts = {}
    for s in ("train", "heldout"):
        enc = tokenizer.tok.encode_batch(corpus.split(s), add_special_tokens=False)
        arr = np.concatenate([np.asarray(e.ids + [eos_id], np.uint16) for e in enc])
        path = os.path.join(out_dir, f"tokens-{s}.npy")
        if compress:
            buf = io.BytesIO()
            np.save(buf, arr)
            with open(path + ".xz", "wb") as f:
                f.write(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
        else:
            np.save(path, arr)
        counts[f"{s}_tokens"] = int(arr.size)
    return counts


def load_tokens(out_dir: str, split: str) -> np.ndarray:
    """`tokens-{split}.npy`, or its xz-compressed `.npy.xz`."""
    path = os.path.join(out_dir, f"tokens-{split}.npy")
    if os.path.exists(path):
        return np.load(path)
    if os.path.exists(path + ".xz"):
        with open(path + ".xz", "rb") as f:
            return np.load(io.BytesIO(lzma.decompress(f.read())))
    raise FileNotFoundError(f"{out_dir}: neither tokens-{split}.npy nor tokens-{split}.npy.xz "
                            "(python -m ling_jax.train.corpus --tokenizer ... writes them)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".data/stdlib")
    p.add_argument("--holdout-pct", type=int, default=2)
    p.add_argument("--site-packages", default=None, help="also take this dir's *.py files (deduplicated)")
    p.add_argument("--package-cap-mb", type=float, default=None, help="cap each top-level site-package at N MB")
    p.add_argument("--near-threshold", type=float, default=0.7, help="MinHash Jaccard of a near-duplicate")
    p.add_argument("--tokenizer", default=None, help="a dir with tokenizer.json: also write the token arrays")
    p.add_argument("--compress", action="store_true", help="write the token arrays as .npy.xz")
    p.add_argument("--tokens-out", default=None, help="write the token arrays here (default: --out), e.g. a folder "
                   "holding only them, to carry to another machine")
    a = p.parse_args(argv)
    if not os.path.exists(os.path.join(a.out, CORPUS_FILE)):
        cap = int(a.package_cap_mb * 1e6) if a.package_cap_mb else None
        build(a.out, a.holdout_pct, site_packages=a.site_packages, near_threshold=a.near_threshold,
              package_cap_bytes=cap)
    corpus = load(a.out)
    info = corpus.summary()
    if a.tokenizer:
        from ling_jax.tokenizer import load_tokenizer

        tok = load_tokenizer(a.tokenizer)
        tokens_out = a.tokens_out or a.out
        os.makedirs(tokens_out, exist_ok=True)
        info.update(tokenize_splits(corpus, tok, tokens_out, tok.eos_ids[0], a.compress))
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
