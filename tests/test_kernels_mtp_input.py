"""pallas_kernels/mtp_input_triton.py (interpret mode) against the model's own jnp, its batch invariance, its routing
in KernelCalls, and its CUDA lowering.

Reference: the MTP layer's input as ling_jax.nextn.mtp_forward writes it: jnp.take of the embedding, then
ling_jax.layers.linear.norm_projections over the two-input Normed (rms_norm of each half, concatenated, the eh_proj
einsum). Shapes: the v2 demo's (D = 320, V = 4096, eh_proj [320, 640]) and an odd one (D = 200: a partial K step in
each half; N = 97: a partial column tile), T in {1, 6, 17}.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.linear import Normed, Projection, norm_projections
from ling_jax.quant import quantize
from pallas_kernels.mtp_input_triton import NormLinearConfig, mtp_input_small
from tests.conftest import rel_err

CFG = NormLinearConfig(interpret=True)
EPS = 1e-6
SHAPES = {"demo": (320, 4096, 320), "odd": (200, 1000, 97)}  # (D, V, N)


def _inputs(shape, t, dtype, seed=0):
    """tokens [T], embedding [V, D], hidden [T, D] (rows of varied scale), enorm, hnorm [D], eh_proj [N, 2D]."""
    d, v, n = SHAPES[shape]
    k = jax.random.split(jax.random.key(seed), 7)
    embed = jax.random.normal(k[0], (v, d)) * 0.5
    tokens = jax.random.randint(k[1], (t,), 0, v)
    hidden = jax.random.normal(k[2], (t, d)) * jnp.exp(jax.random.normal(k[3], (t, 1)))
    enorm, hnorm = (1.0 + 0.2 * jax.random.normal(kk, (d,)) for kk in k[4:6])
    w = jax.random.normal(k[6], (n, 2 * d)) * (2 * d) ** -0.5
    return (tokens,) + tuple(a.astype(dtype) for a in (embed, hidden, enorm, hnorm, w))


def _model(tokens, embed, hidden, enorm, hnorm, w):
    """mtp_forward's input in the model's jnp."""
    e = jnp.take(embed, tokens, axis=0)
    (y,) = norm_projections(Normed((e, hidden.astype(e.dtype)), (enorm, hnorm), EPS), (Projection(w),))
    return y


@pytest.mark.parametrize("t", [1, 6, 17])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_kernel_matches_model_jnp(shape, t, dtype, tol):
    args = _inputs(shape, t, dtype)
    got = mtp_input_small(*args, eps=EPS, config=CFG)
    want = _model(*args)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert rel_err(got, want) <= tol, rel_err(got, want)
    if dtype == jnp.bfloat16:  # the same rounding points: mostly the model's bits
        assert np.mean(np.asarray(got) == np.asarray(want)) >= 0.9


def test_row_zero_is_batch_invariant():
    """Row 0 alone equals row 0 among 6 and 17 rows, bitwise."""
    tokens, embed, hidden, enorm, hnorm, w = _inputs("odd", 17, jnp.bfloat16, seed=3)
    alone = mtp_input_small(tokens[:1], embed, hidden[:1], enorm, hnorm, w, eps=EPS, config=CFG)
    for t in (6, 17):
        batch = mtp_input_small(tokens[:t], embed, hidden[:t], enorm, hnorm, w, eps=EPS, config=CFG)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(batch[0]))


def test_kernel_calls_route_small_bf16_calls_only():
    """KernelCalls.mtp_input (mtp_input_triton) takes [B, T] tokens of <= 17 rows with everything bf16 and returns
    [B, T, N]; the field off, 18 rows, fp32, an fp8 eh_proj and one past MAX_WEIGHT_BYTES are None (the model's
    jnp)."""
    calls = KernelCalls(interpret=True, mtp_input_triton=True)
    tokens, embed, hidden, enorm, hnorm, w = _inputs("demo", 12, jnp.bfloat16)
    got = calls.mtp_input(tokens.reshape(2, 6), embed, hidden.reshape(2, 6, -1), enorm, hnorm, w, eps=EPS)
    assert got.shape == (2, 6, 320)
    assert rel_err(got.reshape(12, -1), _model(tokens, embed, hidden, enorm, hnorm, w)) <= 1e-2
    assert KernelCalls(interpret=True).mtp_input(tokens, embed, hidden, enorm, hnorm, w, eps=EPS) is None
    t18, e18, h18, *_ = _inputs("demo", 18, jnp.bfloat16)
    assert calls.mtp_input(t18, e18, h18, enorm, hnorm, w, eps=EPS) is None                # 18 rows
    f32 = _inputs("demo", 6, jnp.float32)
    assert calls.mtp_input(*f32, eps=EPS) is None                                          # fp32
    fp8 = quantize(w.astype(jnp.float32))
    assert calls.mtp_input(tokens, embed, hidden, enorm, hnorm, fp8, eps=EPS) is None       # fp8 eh_proj
    big = jnp.zeros((2048, 4096), jnp.bfloat16)                   # 16 MiB > MAX_WEIGHT_BYTES: XLA streams it faster
    e_big, h_big, n_big = (jnp.zeros(s, jnp.bfloat16) for s in ((64, 2048), (6, 2048), (2048,)))
    assert calls.mtp_input(tokens[:6] % 64, e_big, h_big, n_big, n_big, big, eps=EPS) is None


@pytest.mark.parametrize("t", [1, 6, 17])
def test_lowers_for_cuda_as_one_launch(t):
    """Lowered for CUDA (H200, abstract) at Ling-3.0-flash's dims (D = 2560, V = 157184, eh_proj [2560, 5120]): one
    Triton launch, and no gather or concatenate outside it."""
    from tests.cuda_lowering import S, lower_cuda

    bf = jnp.bfloat16
    d, v = 2560, 157184
    text = lower_cuda(lambda *a: mtp_input_small(*a, eps=EPS), S((t,), jnp.int32), S((v, d), bf), S((t, d), bf),
                      S((d,), bf), S((d,), bf), S((d, 2 * d), bf))
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.gather" not in text and "stablehlo.concatenate" not in text


def test_sharded_calls_refuse_it():
    from compile.sharding import ShardedKernelCalls

    with pytest.raises(ValueError, match="mtp_input_triton=True"):
        ShardedKernelCalls(interpret=True, mesh=jax.make_mesh((1,), ("tp",)), mtp_input_triton=True)
