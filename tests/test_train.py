"""The trainer (ling_jax.train): a tiny run on CPU learns, balances its router, and the corpus split is stable."""

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import get_preset
from ling_jax.train import corpus
from ling_jax.train.data import fixed_windows, random_windows
from ling_jax.train.step import StepConfig, compiled, make_optimizer, moe_layer_paths
from ling_jax.train.trainer import lr_at
from ling_jax.weights import init_params

# test-tiny cut to 3 layers: KDA+dense, KDA+MoE, MLA+MoE, and the MTP layer (MLA+MoE).
CFG = get_preset("test-tiny").replace(name="train-tiny", num_hidden_layers=3, routed_swiglu_limits=(),
                                      shared_swiglu_limits=())


def _stream(n=20000, seed=0):
    """A learnable token stream: random 'words' (fixed 3-token spellings) in random order."""
    rng = np.random.default_rng(seed)
    words = rng.integers(2, CFG.vocab_size, size=(40, 3))
    return words[rng.integers(0, len(words), n // 3)].reshape(-1).astype(np.int32)


def test_tiny_run_reduces_loss_and_balances_router():
    sc = StepConfig(batch=4, seq=32, compute_dtype="float32", mtp_chain=2, bias_update=1e-2)
    params = init_params(CFG, 0, jnp.float32)
    bias0 = [np.asarray(params[p[0]][p[1]]["mlp"]["expert_bias"]) for p in moe_layer_paths(CFG)]
    tx = make_optimizer(sc)
    opt = tx.init(params)
    step, _ = compiled(CFG, sc, tx)
    tokens = jnp.asarray(_stream())
    key = jax.random.key(0)
    hist = []
    for i in range(30):
        params, opt, m = step(params, opt, jax.random.fold_in(key, i), jnp.float32(lr_at(i, 30, 3e-3, 5, 0.1)), tokens)
        hist.append(m)
    ce = [float(m.ce) for m in hist]
    kl = [float(m.kl) for m in hist]
    assert all(np.isfinite(ce)) and all(np.isfinite(kl))
    assert np.mean(ce[-5:]) < ce[0] - 1.0, ce
    assert np.mean(kl[-5:]) < np.mean(kl[:5]), kl
    # the noaux_tc update moved every MoE layer's bias (target layers and the MTP layer), by at most 30 u each
    for p, b0 in zip(moe_layer_paths(CFG), bias0):
        b = np.asarray(params[p[0]][p[1]]["mlp"]["expert_bias"])
        assert np.abs(b - b0).max() > 0 and np.abs(b - b0).max() <= 30 * sc.bias_update + 1e-6
    assert params["mtp"][0]["mlp"]["expert_bias"].dtype == jnp.float32
    assert jax.tree.structure(params) == jax.tree.structure(init_params(CFG, 0, jnp.float32))


def test_windows_and_schedule():
    toks = jnp.arange(1000, dtype=jnp.int32)
    w = random_windows(toks, jax.random.key(1), 8, 16)
    assert w.shape == (8, 17) and bool(jnp.all(w[:, 1:] - w[:, :-1] == 1))
    assert np.array_equal(w, random_windows(toks, jax.random.key(1), 8, 16))  # seeded
    f = fixed_windows(np.arange(100), 16)
    assert f.shape == (6, 17) and f[1, 0] == 16 and f[0, -1] == 16
    assert lr_at(0, 100, 1.0, 10, 0.1) == 0.1 and abs(lr_at(99, 100, 1.0, 10, 0.1) - 0.1) < 1e-3


def test_corpus_selection_is_deterministic():
    assert corpus.is_test_path("test/test_os.py") and corpus.is_test_path("lib2to3/tests/data/x.py")
    assert corpus.is_test_path("idlelib/idle_test/a.py") and corpus.is_test_path("test_foo.py")
    assert corpus.is_test_path("site-packages/pip/x.py") and not corpus.is_test_path("unittest/case.py")
    assert corpus.heldout("http/client.py", 2) and not corpus.heldout("os.py", 2)
    root, paths = corpus.stdlib_files()
    assert paths == sorted(paths) and "os.py" in paths and not any(corpus.is_test_path(p) for p in paths)
    held = [p for p in paths if corpus.heldout(p, 2)]
    assert 0 < len(held) < 0.05 * len(paths)
