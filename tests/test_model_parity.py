"""JAX model vs the PyTorch reference (same safetensors), and the model's modes against each other."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ling_jax.config import from_hf_config, get_preset
from ling_jax.layers.kda import kda_chunked, kda_recurrent
from ling_jax.model import Numerics, RuntimeOptions
from ling_jax.state import init_state
from ling_jax.weights import load_hf_checkpoint
from tests.conftest import PARITY_CASES, jitted_commit, jitted_forward, rel_err

T_FULL = 24
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _tokens(cfg, seed, B=2, T=T_FULL):
    return np.asarray(jax.random.randint(jax.random.key(100 + seed), (B, T), 0, cfg.vocab_size), np.int32)


def _full(cfg, params, tokens, dtype, opts=RuntimeOptions()):
    B, T = tokens.shape
    state = init_state(cfg, B, 64, dtype)
    logits, out = jitted_forward(cfg, "prefill", opts)(params, jnp.asarray(tokens), state, jnp.full((B,), T, jnp.int32))
    return logits, out


def _fp32_model(torch_checkpoints, name, seed):
    """(cfg, fp32 params, tokens [2, T_FULL]) of the torch-written float32 checkpoint."""
    ckpt, _ = torch_checkpoints[(name, "float32")]
    cfg = from_hf_config(ckpt)
    return cfg, load_hf_checkpoint(cfg, ckpt, jnp.float32), _tokens(cfg, seed)


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,seed", PARITY_CASES)
def test_logits_match_torch_reference(torch_checkpoints, name, seed, dt):
    ckpt, ref = torch_checkpoints[(name, dt)]
    cfg = from_hf_config(ckpt)
    dtype = jnp.float32 if dt == "float32" else jnp.bfloat16
    params = load_hf_checkpoint(cfg, ckpt, dtype)
    tokens = _tokens(cfg, seed)
    want = ref.forward(torch.from_numpy(tokens).long())
    for opts in (RuntimeOptions(), RuntimeOptions(numerics=Numerics(router_fp32=True, lm_head_fp32=True, kda_chunked_prefill=False))):
        logits, out = _full(cfg, params, tokens, dtype, opts)
        err = rel_err(logits, want["logits"].numpy())
        print(f"{name} seed={seed} {dt} {opts.numerics.kda_chunked_prefill=}: logits rel err {err:.2e}")
        assert err <= TOL[dt], err
        assert rel_err(out.hidden.astype(jnp.float32), want["hidden"].float().numpy()) <= TOL[dt]


@pytest.mark.parametrize("name,seed", PARITY_CASES)
def test_prefill_then_decode_equals_full_forward(torch_checkpoints, name, seed):
    cfg, params, tokens = _fp32_model(torch_checkpoints, name, seed)
    full, _ = _full(cfg, params, tokens, jnp.float32)
    P = 13
    state = init_state(cfg, 2, 64, jnp.float32)
    _, out = jitted_forward(cfg, "prefill")(params, tokens[:, :P], state, jnp.full((2,), P, jnp.int32))
    state, step = out.state, []
    for t in range(P, T_FULL):
        logits, out = jitted_forward(cfg, "decode")(params, tokens[:, t : t + 1], state, jnp.ones((2,), jnp.int32))
        state = out.state
        step.append(logits)
    assert rel_err(jnp.concatenate(step, axis=1), full[:, P:]) <= 1e-5
    assert list(np.asarray(state.lengths)) == [T_FULL, T_FULL]


@pytest.mark.parametrize("name,seed", PARITY_CASES)
def test_padded_prefill_leaves_state_as_unpadded(torch_checkpoints, name, seed):
    """Positions past n_valid are no-ops: a padded prefill gives the state of the exact-length prefill. (The
    checkpoint's model and the shapes of the tests above: the full [2, 24] and the exact [2, 13] prefill programs
    are compiled already.)"""
    cfg, params, tokens = _fp32_model(torch_checkpoints, name, seed)
    P = 13
    state0 = init_state(cfg, 2, 64, jnp.float32)
    _, padded = jitted_forward(cfg, "prefill", RuntimeOptions())(params, jnp.asarray(tokens), state0,
                                                                  jnp.array([P, T_FULL], jnp.int32))
    _, exact = jitted_forward(cfg, "prefill")(params, tokens[:, :P], state0, jnp.full((2,), P, jnp.int32))
    assert rel_err(padded.state.kda_recurrent[:, 0], exact.state.kda_recurrent[:, 0]) <= 1e-5
    assert rel_err(padded.state.kda_conv[:, 0], exact.state.kda_conv[:, 0]) <= 1e-5
    assert list(np.asarray(padded.state.lengths)) == [P, T_FULL]


@pytest.mark.parametrize("name,seed", PARITY_CASES)
def test_verify_then_commit_equals_decode_steps(torch_checkpoints, name, seed):
    """verify(K) logits == K decode steps; commit(n) state == the state after decoding the first n tokens;
    verify itself leaves the committed KDA state untouched. (The prefill and decode programs are the ones
    test_prefill_then_decode_equals_full_forward compiled.)"""
    cfg, params, tokens = _fp32_model(torch_checkpoints, name, seed)
    B, P, K = 2, 13, 6
    tokens = tokens[:, : P + K]
    _, out = jitted_forward(cfg, "prefill")(params, tokens[:, :P], init_state(cfg, B, 64, jnp.float32),
                                            jnp.full((B,), P, jnp.int32))
    base = out.state
    v_logits, v = jitted_forward(cfg, "verify")(params, tokens[:, P:], base, jnp.full((B,), K, jnp.int32))
    np.testing.assert_array_equal(v.state.kda_recurrent, base.kda_recurrent)
    np.testing.assert_array_equal(v.state.kda_conv, base.kda_conv)
    np.testing.assert_array_equal(v.state.lengths, base.lengths)

    state, decoded, states = base, [], []
    for t in range(K):
        logits, o = jitted_forward(cfg, "decode")(params, tokens[:, P + t : P + t + 1], state, jnp.ones((B,), jnp.int32))
        state = o.state
        decoded.append(logits)
        states.append(state)
    assert rel_err(v_logits, jnp.concatenate(decoded, axis=1)) <= 1e-5

    for n in ([1, 4], [6, 2], [3, 3]):
        committed = jitted_commit()(v.state, v.pending, jnp.array(n, jnp.int32))
        for b in range(B):
            want = states[n[b] - 1]
            assert rel_err(committed.kda_recurrent[:, b], want.kda_recurrent[:, b]) <= 1e-5
            assert rel_err(committed.kda_conv[:, b], want.kda_conv[:, b]) <= 1e-5
            assert int(committed.lengths[b]) == P + n[b]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_kda_equals_recurrent(seed):
    """The chunked (UT) form against the scan, including T not a chunk multiple and strong decays."""
    B, T, H, K, V = 2, 45, 3, 16, 24
    ks = jax.random.split(jax.random.key(seed), 6)
    l2 = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q = l2(jax.random.normal(ks[0], (B, T, H, K))) * K**-0.5
    k = l2(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -5.0 * jax.nn.sigmoid(3 * jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = jax.random.normal(ks[5], (B, H, K, V))
    o_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    for chunk in (8, 16, 64):
        o_c, s_c = jax.jit(kda_chunked, static_argnames="chunk")(q, k, v, g, beta, s0, chunk=chunk)
        assert rel_err(o_c, o_r) <= 1e-5
        assert rel_err(s_c, s_r) <= 1e-5


def test_chunked_kda_is_differentiable():
    B, T, H, K = 1, 20, 2, 8
    ks = jax.random.split(jax.random.key(3), 5)
    args = [jax.random.normal(ks[i], (B, T, H, K)) * 0.3 for i in range(3)]
    g = -jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = jnp.zeros((B, H, K, K))
    loss = lambda fn, v: jnp.sum(fn(args[0], args[1], v, g, beta, s0)[0] ** 2)
    g_c = jax.grad(lambda v: loss(lambda *a: kda_chunked(*a, chunk=8), v))(args[2])
    g_r = jax.grad(lambda v: loss(kda_recurrent, v))(args[2])
    assert np.all(np.isfinite(g_c)) and rel_err(g_c, g_r) <= 1e-4


def test_commit_without_kda_layers_advances_the_lengths():
    """A slice inside the first layer group is all MLA (Ling-3.0-flash's --layers 4 of bench.check_gpu_wiring):
    verify has no KDA pending, and commit(n) gives the state that decoding the first n tokens gives (the same
    next-token logits from both)."""
    from compile.stages import slice_config
    from ling_jax.weights import init_params

    cfg = slice_config(get_preset("test-tiny").replace(layer_group_size=4), 3)
    assert cfg.kda_layers == () and len(cfg.mla_layers) == 3
    params = init_params(cfg, 0, jnp.float32)
    B, P, K = 1, 5, 4
    tokens = _tokens(cfg, 3, B=B, T=P + K + 1)
    _, out = jitted_forward(cfg, "prefill")(params, tokens[:, :P], init_state(cfg, B, 32, jnp.float32),
                                            jnp.full((B,), P, jnp.int32))
    _, v = jitted_forward(cfg, "verify")(params, tokens[:, P:P + K], out.state, jnp.full((B,), K, jnp.int32))
    assert v.pending is None
    n = 2
    committed = jitted_commit()(v.state, v.pending, jnp.array([n], jnp.int32))
    assert int(committed.lengths[0]) == P + n
    state = out.state
    for t in range(n):
        _, o = jitted_forward(cfg, "decode")(params, tokens[:, P + t:P + t + 1], state, jnp.ones((B,), jnp.int32))
        state = o.state
    nxt = tokens[:, P + n:P + n + 1]
    want, _ = jitted_forward(cfg, "decode")(params, nxt, state, jnp.ones((B,), jnp.int32))
    got, _ = jitted_forward(cfg, "decode")(params, nxt, committed, jnp.ones((B,), jnp.int32))
    assert rel_err(got, want) <= 1e-5
