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


def build(out_dir: str, holdout_pct: int = 2, root: str | None = None) -> dict:
    root, paths = stdlib_files(root)
    files, texts = [], []
    for rel in paths:
        raw = open(os.path.join(root, rel), "rb").read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        split = "heldout" if heldout(rel, holdout_pct) else "train"
        files.append({"path": rel, "split": split, "sha1": hashlib.sha1(raw).hexdigest()})
        texts.append(text)
    meta = {"python": sys.version, "stdlib": root, "holdout_pct": holdout_pct, "files": files,
            "file_list_sha256": file_list_hash([f["path"] for f in files])}
    os.makedirs(out_dir, exist_ok=True)
    with lzma.open(os.path.join(out_dir, CORPUS_FILE), "wt", encoding="utf-8") as f:
        json.dump({**meta, "texts": texts}, f)
    return meta


@dataclass
class Corpus:
    meta: dict
    texts: list[str]

    def split(self, name: str) -> list[str]:
        return [t for f, t in zip(self.meta["files"], self.texts) if f["split"] == name]

    def paths(self, name: str) -> list[str]:
        return [f["path"] for f in self.meta["files"] if f["split"] == name]

    def summary(self) -> dict:
        out = {k: v for k, v in self.meta.items() if k != "files"}
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


def tokenize_splits(corpus: Corpus, tokenizer, out_dir: str, eos_id: int) -> dict:
    """Encode each split as one uint16 stream: file, <eos>, file, <eos>, ... Returns token counts."""
    counts = {}
    for s in ("train", "heldout"):
        enc = tokenizer.tok.encode_batch(corpus.split(s), add_special_tokens=False)
        ids = []
        for e in enc:
            ids.extend(e.ids)
            ids.append(eos_id)
        arr = np.asarray(ids, np.uint16)
        np.save(os.path.join(out_dir, f"tokens-{s}.npy"), arr)
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
    p.add_argument("--tokenizer", default=None, help="a dir with tokenizer.json: also write the token arrays")
    a = p.parse_args(argv)
    if not os.path.exists(os.path.join(a.out, CORPUS_FILE)):
        build(a.out, a.holdout_pct)
    corpus = load(a.out)
    info = corpus.summary()
    if a.tokenizer:
        from ling_jax.tokenizer import load_tokenizer

        tok = load_tokenizer(a.tokenizer)
        info.update(tokenize_splits(corpus, tok, a.out, tok.eos_ids[0]))
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
