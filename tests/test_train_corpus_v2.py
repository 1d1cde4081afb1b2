"""The v2 corpus (stdlib + site-packages, deduplicated, held-out stdlib files win every duplicate group), its
compressed token arrays, the frozen-target NEXTN phase, and the trainer's sharded export that the device returns."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import get_preset
from ling_jax.train import bpe, corpus
from ling_jax.train.dedup import Deduper
from ling_jax.train.step import StepConfig, compiled, make_optimizer
from ling_jax.config import from_hf_config
from ling_jax.weights import init_params, load_hf_checkpoint
from tests.test_train import CFG, _stream

CODE = "".join(f"def f{i}(x):\n    y = x * {i} + {i * 7}\n    return y - {i}\n\n" for i in range(60))


def test_dedup_kinds():
    d = Deduper(0.7)
    assert d.offer(CODE.encode(), CODE) is None
    other = "".join(f"class C{i}:\n    name = 'c{i}'\n    size = {i * 3}\n\n" for i in range(60))
    assert d.offer(other.encode(), other) is None  # unrelated: kept
    assert d.offer(CODE.encode(), CODE) == ("exact", 0)
    rewrapped = "# header\n" + CODE.replace("    ", "\t").replace("\n\n", "\n\n\n")
    assert d.offer(rewrapped.encode(), rewrapped) == ("normalised", 0)
    edited = CODE.replace("def f5(", "def g5(").replace("return y - 9", "return -y") + "def extra():\n    pass\n"
    assert d.offer(edited.encode(), edited) == ("near", 0)
    half = CODE[: len(CODE) // 3] + other[: len(other) // 3]  # Jaccard well under 0.7 with both: kept
    assert d.offer(half.encode(), half) is None


def _write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_build_split_dedup_cap_and_compressed_tokens(tmp_path):
    std, site = str(tmp_path / "std"), str(tmp_path / "site")
    assert corpus.heldout("http/client.py", 2) and not corpus.heldout("os.py", 2)
    _write(std, "http/client.py", CODE)  # held out
    _write(std, "os.py", "import sys\n" * 3 + "".join(f"X{i} = {i}\n" for i in range(50)))
    _write(std, "test/test_os.py", "assert True\n")
    _write(site, "pkg/__init__.py", CODE)  # exact copy of a held-out file: dropped (decontamination)
    _write(site, "pkg/tests/test_a.py", "x = 1\n")
    _write(site, "pkg/big.py", "".join(f"v{i} = '{i}'\n" for i in range(400)))
    _write(site, "pkg/more.py", "".join(f"w{i} = '{i}'\n" for i in range(400)))
    _write(site, "pkg/table.py", "T = [" + ", ".join(str(i) for i in range(3000)) + "]\n")  # data-like
    _write(site, "pkg-1.0.dist-info/x.py", "z = 1\n")
    meta = corpus.build(str(tmp_path / "c"), 2, root=std, site_packages=site, package_cap_bytes=6000)
    paths = {f["path"]: f["split"] for f in meta["files"]}
    whys = {d["path"]: d["why"] for d in meta["dropped"]}
    assert paths["http/client.py"] == "heldout" and paths["os.py"] == "train"
    assert whys["site-packages/pkg/__init__.py"] == "exact" and whys["site-packages/pkg/table.py"] == "data-like"
    # big.py and more.py are ~4.9 KB each: the 6000-byte cap keeps one of them
    assert sorted(p for p in ("site-packages/pkg/big.py", "site-packages/pkg/more.py") if p in paths).__len__() == 1
    assert {w for p, w in whys.items() if "pkg/" in p and p.endswith(("big.py", "more.py"))} == {"package cap"}
    assert not any("test" in p or "dist-info" in p for p in list(paths) + list(whys))
    assert meta["file_list_sha256"] == corpus.file_list_hash(sorted(paths))
    c = corpus.load(str(tmp_path / "c"))
    tok = bpe.train_tokenizer(c.split("train") + c.split("heldout"), 300)

    class T:  # the interface tokenize_splits uses (ling_jax.tokenizer wraps the same object)
        pass

    t = T()
    t.tok = tok
    counts = corpus.tokenize_splits(c, t, str(tmp_path / "c"), 0, compress=True)
    assert not os.path.exists(tmp_path / "c" / "tokens-train.npy")
    got = corpus.load_tokens(str(tmp_path / "c"), "heldout")
    assert got.dtype == np.uint16 and got.size == counts["heldout_tokens"] and got[-1] == 0
    assert tok.decode(got[:-1].tolist()) == CODE


def test_bpe_sample_is_deterministic_and_bounded():
    paths, texts = [f"p{i}.py" for i in range(20)], [f"x{i} = 1\n" * (i + 1) for i in range(20)]
    s = bpe.sample(paths, texts, 200)
    assert s == bpe.sample(paths, texts, 200) and sum(len(t) for t in s) <= 200 and 1 < len(s) < 20
    assert bpe.sample(paths, texts, None) == texts


def test_mtp_only_phase_freezes_the_target():
    sc = StepConfig(batch=2, seq=16, compute_dtype="float32", mtp_only=True, bias_update=1e-2)
    params = init_params(CFG, 0, jnp.float32)
    before = jax.tree.map(np.asarray, params)
    tx = make_optimizer(sc)
    opt = tx.init(params)
    step, _ = compiled(CFG, sc, tx)
    tokens = jnp.asarray(_stream(2000))
    for i in range(3):
        params, opt, m = step(params, opt, jax.random.key(i), jnp.float32(1e-2), tokens)
    after = jax.tree.map(np.asarray, params)
    for k in before:
        same = jax.tree.leaves(jax.tree.map(np.array_equal, before[k], after[k]))
        assert all(same) if k != "mtp" else not all(same), k
    assert float(m.loss) == float(m.kl) > 0


def test_trainer_cli_exports_a_sharded_checkpoint_the_device_can_return(tmp_path):
    from ling_jax.train import trainer

    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "tokens-train.npy", (_stream(6000) % 384).astype(np.uint16))
    np.save(data / "tokens-heldout.npy", (_stream(600, seed=1) % 384).astype(np.uint16))
    out = tmp_path / "out"
    argv = ["--preset", "test-qlora", "--shrink", "num_hidden_layers=4", "--data", str(data), "--tokenizer", "",
            "--steps", "4", "--mtp-steps", "3", "--batch", "2", "--seq", "16", "--warmup", "2", "--eval-every", "0",
            "--eval-windows", "2", "--log-every", "2", "--no-ckpt", "--out", str(out), "--export", str(out),
            "--max-shard-bytes", "1500000"]
    rep = trainer.main(argv)
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and "model.safetensors.index.json" in files, files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 2 and all(os.path.getsize(out / f) <= 1500000 + 65536 for f in shards)  # + header
    index = json.load(open(out / "model.safetensors.index.json"))
    assert set(index["weight_map"].values()) == set(shards)
    assert rep["summary"]["mtp_phase_steps"] == 3 and any(r.get("phase") == "mtp" for r in rep["rows"])
    cfg = from_hf_config(str(out))
    assert cfg.num_hidden_layers == 4 and cfg.vocab_size == get_preset("test-qlora").vocab_size
    params = load_hf_checkpoint(cfg, str(out), jnp.float32)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
