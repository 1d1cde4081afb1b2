"""pallas_kernels/lm_head_argmax_triton.py (interpret mode) against the model's own jnp, its tie-break, NaN rule and
batch invariance, its routing in KernelCalls, and its CUDA lowering.

Reference: jnp.argmax of ling_jax.model.lm_logits over ling_jax.layers.norms.rms_norm (the model's greedy token:
sampling.greedy), in both of lm_logits' forms (bf16 inputs with fp32 accumulation, and Numerics.lm_head_fp32), and
rms_norm itself for the normed rows. Shapes: the v2 demo's head (D = 320, V = 4096: 32 tiles of 128) and an odd one
(D = 200: a partial K step; V = 1000: a partial last tile), T in {1, 6, 17}. Ties are planted as repeated lm_head
rows (exactly equal logits in any summation order): the lowest index must win, within a tile and across tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.linear import Normed
from ling_jax.layers.norms import rms_norm
from ling_jax.model import Numerics, RuntimeOptions, lm_argmax, lm_logits
from ling_jax.quant import quantize
from ling_jax.sampling import greedy
from pallas_kernels.lm_head_argmax_triton import HeadArgmaxConfig, MAX_ROWS, first_max, head_argmax
from tests.conftest import rel_err

CFG = HeadArgmaxConfig(interpret=True)
EPS = 1e-6
SHAPES = {"demo": (320, 4096), "odd": (200, 1000)}  # (D, V)


def _inputs(shape, t, dtype, seed=0):
    """x [T, D] (rows of varied scale, so the norm matters), the norm weight [D], the lm_head [V, D]."""
    d, v = SHAPES[shape]
    kx, ks, kn, kw = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (t, d)) * jnp.exp(jax.random.normal(ks, (t, 1)))
    nw = 1.0 + 0.2 * jax.random.normal(kn, (d,))
    w = jax.random.normal(kw, (v, d)) * d ** -0.5
    return x.astype(dtype), nw.astype(dtype), w.astype(dtype)


def _model_token(x, nw, w, lm_head_fp32=False):
    """The model's greedy token: argmax of lm_logits(rms_norm(x)) (fp32 logits, first index on ties)."""
    opts = RuntimeOptions(numerics=Numerics(lm_head_fp32=lm_head_fp32), kernels=None)
    return greedy(lm_logits({"lm_head": w}, rms_norm(x, nw, EPS), opts))


@pytest.mark.parametrize("t", [1, 6, 17])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tokens_are_the_model_argmax(shape, t, dtype):
    x, nw, w = _inputs(shape, t, dtype)
    tokens, normed = head_argmax(x, nw, w, eps=EPS, config=CFG)
    assert tokens.shape == (t,) and tokens.dtype == jnp.int32
    for fp32 in (False, True):  # lm_logits' two forms: the same products (bf16 x bf16 is exact in fp32)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(_model_token(x, nw, w, fp32)))
    want = rms_norm(x, nw, EPS)
    assert normed.shape == want.shape and normed.dtype == want.dtype
    if dtype == jnp.float32:  # the row sum's order is the kernel's: an ulp of r at most
        assert rel_err(normed, want) <= 1e-6
    else:  # rounded to bf16 after x * r: the model's bits, but where r's last bit rounds x * r the other way
        assert rel_err(normed, want) <= 1e-2
        assert np.mean(np.asarray(normed, np.float32) == np.asarray(want, np.float32)) >= 0.98


def _planted(shape, t, dtype, copies, seed=1):
    """Inputs whose row i's largest logit sits, exactly tied, at the lm_head rows copies[i] (a row repeated there:
    a large multiple of row i's normed direction, so it beats every random row and every other row's plant)."""
    x, nw, w = _inputs(shape, t, dtype, seed)
    xn = rms_norm(x, nw, EPS).astype(jnp.float32)
    for i, rows in enumerate(copies):
        plant = (8.0 * xn[i] / jnp.linalg.norm(xn[i])).astype(dtype)
        w = w.at[jnp.asarray(rows)].set(plant)
    return x, nw, w


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ties_go_to_the_lowest_index(shape, dtype):
    """Ties in one tile (columns 5 and 9 of tile 3), across tiles (the last tile first), and a tie whose lowest
    index is in the partial last tile of the odd shape: the lowest index wins, as jnp.argmax."""
    v = SHAPES[shape][1]
    copies = [(3 * 128 + 9, 3 * 128 + 5), (v - 1, 2 * 128 + 7, 6 * 128), (v - 2, v - 1), (128, 0, 4 * 128 + 127)]
    x, nw, w = _planted(shape, 4, dtype, copies)
    want = np.array([min(c) for c in copies], np.int32)
    np.testing.assert_array_equal(np.asarray(_model_token(x, nw, w)), want)  # the planted ties are real ties
    tokens, _ = head_argmax(x, nw, w, eps=EPS, config=CFG)
    np.testing.assert_array_equal(np.asarray(tokens), want)


def test_nan_logits_win_as_in_jnp_argmax():
    """A NaN lm_head row makes every row's logit there NaN: jnp.argmax returns the first NaN; so does the kernel."""
    x, nw, w = _inputs("odd", 6, jnp.float32)
    w = w.at[700].set(jnp.nan).at[300].set(jnp.nan)
    tokens, _ = head_argmax(x, nw, w, eps=EPS, config=CFG)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(_model_token(x, nw, w)))
    assert (np.asarray(tokens) == 300).all()


def test_first_max_is_jnp_argmax_over_live_lanes():
    """The per-tile rule itself on planted rows: ties, -inf everywhere, -inf beside a live value, NaNs (first NaN
    wins), dead lanes holding larger values (never win)."""
    rng = np.random.default_rng(0)
    vals = rng.integers(-3, 3, (8, 16)).astype(np.float32)  # small integers: many ties
    vals[1] = -np.inf
    vals[2, :] = -np.inf
    vals[2, 11] = -1.0
    vals[3, [4, 9]] = np.nan
    vals[4, 6] = np.nan
    live = np.ones((8, 16), bool)
    live[5:, 12:] = False
    vals[5:, 12:] = 100.0
    cols = np.broadcast_to(np.arange(16, dtype=np.int32), (8, 16))
    top, first = first_max(jnp.asarray(vals), jnp.asarray(cols), jnp.asarray(live))
    ref = np.where(live, vals, -np.inf)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(jnp.argmax(jnp.asarray(ref), axis=1)))
    np.testing.assert_array_equal(np.asarray(top), np.asarray(jnp.max(jnp.asarray(ref), axis=1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_zero_is_batch_invariant(dtype):
    """Row 0 alone equals row 0 among 6 and 17 rows: its token and its normed bits (fixed tiles and orders)."""
    x, nw, w = _inputs("odd", 17, dtype, seed=3)
    tok1, n1 = head_argmax(x[:1], nw, w, eps=EPS, config=CFG)
    for t in (6, 17):
        tok, n = head_argmax(x[:t], nw, w, eps=EPS, config=CFG)
        assert int(tok[0]) == int(tok1[0])
        np.testing.assert_array_equal(np.asarray(n[0], np.float32), np.asarray(n1[0], np.float32))


def test_kernel_calls_route_small_uniform_calls_only():
    """KernelCalls.head_argmax (lm_head_argmax) takes a one-input Normed of <= 17 rows with x, norm weight and
    lm_head all bf16 (or all fp32), shaped as the model's ([B, T] tokens, [B, T, D] normed); the field off, 18 rows,
    mixed dtypes, an fp8 lm_head and a two-input Normed are None (the caller's logits path)."""
    calls = KernelCalls(interpret=True, lm_head_argmax=True)
    x, nw, w = _inputs("demo", 12, jnp.bfloat16)
    h = Normed(x.reshape(2, 6, -1), nw, EPS)
    tokens, normed = calls.head_argmax(h, w)
    assert tokens.shape == (2, 6) and normed.shape == (2, 6, 320)
    np.testing.assert_array_equal(np.asarray(tokens).ravel(), np.asarray(_model_token(x, nw, w)))
    got = lm_argmax({"lm_head": w}, h, RuntimeOptions(kernels=calls))   # the model's entry, lm_head by name
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(tokens))
    tied = lm_argmax({"embed": w}, h, RuntimeOptions(kernels=calls))    # tied embeddings: the embedding's rows
    np.testing.assert_array_equal(np.asarray(tied[0]), np.asarray(tokens))
    assert lm_argmax({"lm_head": w}, h, RuntimeOptions(kernels=None)) is None                 # the jnp model
    assert KernelCalls(interpret=True).head_argmax(h, w) is None                              # the field off
    x18, nw18, _ = _inputs("demo", MAX_ROWS + 1, jnp.bfloat16)
    assert calls.head_argmax(Normed(x18, nw18, EPS), w) is None                               # 18 rows
    assert calls.head_argmax(h, w.astype(jnp.float32)) is None                                # mixed dtypes
    assert calls.head_argmax(h, quantize(w.astype(jnp.float32))) is None                       # fp8 lm_head
    assert calls.head_argmax(Normed((x[:6], x[6:]), (nw, nw), EPS), w) is None                # two inputs
    x32, nw32, w32 = _inputs("demo", 6, jnp.float32)
    assert calls.head_argmax(Normed(x32, nw32, EPS), w32)[0].shape == (6,)                   # all fp32: taken


@pytest.mark.parametrize("t", [1, 6, 17])
def test_lowers_for_cuda_as_two_launches(t):
    """Lowered for CUDA (H200, abstract: nothing runs) at Ling-3.0-flash's head (D = 2560, V = 157184) and the
    demo's: two Triton launches (the tiles, the reduction) and nothing else of the logits' size outside them."""
    from tests.cuda_lowering import S, lower_cuda

    bf = jnp.bfloat16
    for d, v in ((2560, 157184), (320, 4096)):
        text = lower_cuda(lambda x, nw, w: head_argmax(x, nw, w, eps=EPS), S((t, d), bf), S((d,), bf), S((v, d), bf))
        assert text.count("__gpu$xla.gpu.triton") == 2
        assert f"x{v}x" not in text and f"{t}x{v}" not in text  # no [T, V] array anywhere


def test_sharded_calls_refuse_the_fused_head():
    """The lm_head is vocabulary-sharded under TP: ShardedKernelCalls rejects the field, and
    compile.sharding.kernel_calls_for turns it off on more than one device."""
    from compile.sharding import ShardedKernelCalls, kernel_calls_for

    with pytest.raises(ValueError, match="lm_head_argmax=True"):
        ShardedKernelCalls(interpret=True, mesh=jax.make_mesh((1,), ("tp",)), lm_head_argmax=True)
    opts = RuntimeOptions(kernels=KernelCalls(interpret=True, lm_head_argmax=True))
    assert not kernel_calls_for(opts, jax.make_mesh((2,), ("tp",))).calls.lm_head_argmax
