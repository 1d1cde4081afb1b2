"""pallas_kernels/norm_linear_triton.py (interpret mode) against the model's own jnp, and its batch invariance.

Reference: ling_jax.layers.linear.norm_projections over a Normed (rms_norm, then each projection's einsum and
epilogue), and ling_jax.layers.linear.linear with a residual for linear_residual_small: the functions the model
runs where the kernels do not take the call. Shapes: the v2 demo's
(models/ling-demo: D = 320; KDA w_qkvfg [5, 320, 320] | b_proj [5]; MLA q [480] | kv_a [160] | g_proj [5]
sigmoid; the dense gate | up [960] swiglu with the clamp) and a D = 1024 set (widths 97 and 96: partial column
tiles, and 8), T in {1, 6, 17}; each under the tiles tiles_for picks (CFG) and under FORCED configs that take the
paths the rule does not at these shapes (a last K step past D with fully masked split tiles, one split, narrow
steps). tiles_for's picks at the demo's and Ling-3.0-flash's shapes are pinned, and both kernels are lowered for
CUDA at every Ling-flash shape they take (one launch each, the rule's tiles in the launch).
"""

import re


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.linear import Normed, Projection, linear, norm_projections
from pallas_kernels.fused_linear import Proj
from pallas_kernels import norm_linear_triton as nlt
from pallas_kernels.norm_linear_triton import NormLinearConfig, linear_residual_small, norm_linear_small, tiles_for
from tests.conftest import rel_err

CFG = NormLinearConfig(interpret=True)
FORCED = {  # at D = 320 (K = 320 / 960 for the residual sets) unless said
    # the second step holds columns 256..511: one partial split tile (256..319) and three fully masked; BN = 64
    # tiles run past 5, 97, 160, 480
    "tail": NormLinearConfig(block_n=64, block_k=256, splits=4, num_stages=2, interpret=True),
    "one split": NormLinearConfig(block_n=32, block_k=128, splits=1, num_stages=3, interpret=True),
    "narrow": NormLinearConfig(block_n=16, block_k=32, splits=2, num_stages=4, interpret=True),  # 16-wide dots
}
EPS = 1e-6
# name -> (D, ((kind, weight shapes [*N, D] (swiglu: of gate and up), limit), ...))
SETS = {
    "demo kda": (320, (("linear", (5, 320, 320), 0.0), ("linear", (5, 320), 0.0))),
    "demo mla": (320, (("linear", (480, 320), 0.0), ("linear", (160, 320), 0.0), ("sigmoid", (5, 320), 0.0))),
    "demo mlp": (320, (("swiglu", (960, 320), 7.0),)),
    "d1024": (1024, (("linear", (97, 1024), 0.0), ("sigmoid", (8, 1024), 0.0), ("swiglu", (96, 1024), 0.0))),
}


def _inputs(name, t, dtype, seed=0):
    """x [T, D] (rows of varied scale, so the norm matters), the norm weight [D], the model's Projections."""
    d, specs = SETS[name]
    key = jax.random.key(seed)
    kx, ks, kn, *kw = jax.random.split(key, 3 + 2 * len(specs))
    x = jax.random.normal(kx, (t, d), jnp.float32) * jnp.exp(jax.random.normal(ks, (t, 1)))
    nw = 1.0 + 0.2 * jax.random.normal(kn, (d,))
    projs = []
    for j, (kind, shape, limit) in enumerate(specs):
        w = lambda k: (jax.random.normal(k, shape) * shape[-1] ** -0.5).astype(dtype)
        weight = (w(kw[2 * j]), w(kw[2 * j + 1])) if kind == "swiglu" else w(kw[2 * j])
        projs.append(Projection(weight, kind, limit))
    return x.astype(dtype), nw.astype(dtype), tuple(projs)


def _kernel(x, nw, projections, config=CFG):
    """The kernel on the model's Projections (weights flattened to [N, D], Projs in the activation dtype)."""
    name = jnp.dtype(x.dtype).name
    flat = lambda w: w.reshape(-1, w.shape[-1])
    args = tuple(tuple(map(flat, p.weight)) if p.kind == "swiglu" else flat(p.weight) for p in projections)
    projs = tuple(Proj(p.kind, limit=p.limit) if p.kind == "swiglu" else Proj(p.kind, out=name, logit=name)
                  for p in projections)
    return norm_linear_small(x, nw, args, projs=projs, eps=EPS, config=config)


@pytest.mark.parametrize("t", [1, 6, 17])
@pytest.mark.parametrize("name", list(SETS))
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_kernel_matches_model_jnp(name, t, dtype, tol):
    x, nw, projections = _inputs(name, t, dtype)
    got = _kernel(x, nw, projections)
    want = norm_projections(Normed(x, nw, EPS), projections)
    assert len(got) == len(want)
    for g, w, p in zip(got, want, projections):
        w = w.reshape(t, -1)
        assert g.shape == w.shape and g.dtype == w.dtype, (p.kind, g.shape, g.dtype, w.shape, w.dtype)
        assert rel_err(g, w) <= tol, (name, p.kind, t, rel_err(g, w))
    if dtype == jnp.bfloat16:  # the same rounding points: most bf16 outputs are the model's bits
        same = np.mean([np.mean(np.asarray(g) == np.asarray(w.reshape(t, -1))) for g, w in zip(got, want)])
        assert same >= 0.9, same


@pytest.mark.parametrize("name", ["demo kda", "demo mla", "d1024"])
def test_row_zero_is_batch_invariant(name):
    """Row 0 computed alone equals row 0 among 6 and 17 rows, bitwise (fixed BT, BN, BK and K order)."""
    x, nw, projections = _inputs(name, 17, jnp.bfloat16, seed=3)
    alone = _kernel(x[:1], nw, projections)
    for t in (6, 17):
        batch = _kernel(x[:t], nw, projections)
        for a, b in zip(alone, batch):
            np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))


@pytest.mark.parametrize("t", [1, 17])
@pytest.mark.parametrize("config", list(FORCED))
@pytest.mark.parametrize("name", ["demo mla", "demo mlp", "d1024"])
def test_forced_configs_match_model_jnp(name, config, t):
    """fp32 (1e-5): a wrong column, row or split index shows at once; every projection kind and odd width."""
    x, nw, projections = _inputs(name, t, jnp.float32, seed=1)
    got = _kernel(x, nw, projections, FORCED[config])
    want = norm_projections(Normed(x, nw, EPS), projections)
    for g, w, p in zip(got, want, projections):
        assert rel_err(g, w.reshape(t, -1)) <= 1e-5, (name, config, p.kind, t, rel_err(g, w.reshape(t, -1)))


@pytest.mark.parametrize("config", list(FORCED))
def test_forced_configs_row_zero_is_batch_invariant(config):
    x, nw, projections = _inputs("demo mla", 17, jnp.bfloat16, seed=4)
    alone = _kernel(x[:1], nw, projections, FORCED[config])
    for t in (6, 17):
        for a, b in zip(alone, _kernel(x[:t], nw, projections, FORCED[config])):
            np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))


def test_kernel_calls_route_small_bf16_calls_only():
    """KernelCalls.norm_linear_triton takes one bf16 input of <= 17 rows with bf16 weights, shaped as the model's
    outputs ([B, T, *N_s]); more rows, fp32 and a two-input Normed go on to the other paths (here: None, the
    model's jnp, as fused_linear is off)."""
    calls = KernelCalls(interpret=True, norm_linear_triton=True)
    x, nw, projections = _inputs("demo kda", 12, jnp.bfloat16)
    h = Normed(x.reshape(2, 6, -1), nw, EPS)
    got = calls.norm_linear(h, projections)
    want = norm_projections(h, projections)
    assert [g.shape for g in got] == [(2, 6, 5, 320), (2, 6, 5)] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-2
    assert KernelCalls(interpret=True).norm_linear(h, projections) is None              # the field off
    x18, nw18, p18 = _inputs("demo kda", 18, jnp.bfloat16)
    assert calls.norm_linear(Normed(x18, nw18, EPS), p18) is None                        # T = 18 > 17
    x32, nw32, p32 = _inputs("demo kda", 6, jnp.float32)
    assert calls.norm_linear(Normed(x32, nw32, EPS), p32) is None                        # fp32
    two = Normed((x[:6], x[6:]), (nw, nw), EPS)
    eh = (Projection(jnp.zeros((320, 640), jnp.bfloat16)),)
    assert calls.norm_linear(two, eh) is None                                             # [enorm | hnorm]
    big = (Projection(jnp.zeros((2056, 2048), jnp.bfloat16)),)                          # 8.03 MiB > 8 MiB
    assert nlt.MAX_WEIGHT_BYTES < 2056 * 2048 * 2
    assert calls.norm_linear(Normed(jnp.ones((6, 2048), jnp.bfloat16), jnp.ones((2048,), jnp.bfloat16), EPS),
                             big) is None                                                  # XLA streams it faster


# output projections: (K, N): the demo's KDA o_proj / MLA dense (320 -> 320), its dense down_proj (960 -> 320), and
# a K = 1024 one with a partial column tile
RESIDUAL_SETS = {"demo o_proj": (320, 320), "demo down": (960, 320), "k1024": (1024, 97)}


def _residual_inputs(name, t, dtype, seed=0):
    k, n = RESIDUAL_SETS[name]
    ko, kw, kr = jax.random.split(jax.random.key(seed), 3)
    o = jax.random.normal(ko, (t, k))
    w = jax.random.normal(kw, (n, k)) * k ** -0.5
    residual = 2.0 * jax.random.normal(kr, (t, n))
    return o.astype(dtype), w.astype(dtype), residual.astype(dtype)


@pytest.mark.parametrize("t", [1, 6, 17])
@pytest.mark.parametrize("name", list(RESIDUAL_SETS))
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_linear_residual_matches_model_jnp(name, t, dtype, tol):
    o, w, residual = _residual_inputs(name, t, dtype)
    got = linear_residual_small(o, w, residual, config=CFG)
    want = linear(o, w, residual=residual)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert rel_err(got, want) <= tol, (name, t, rel_err(got, want))
    if dtype == jnp.bfloat16:  # the projection rounded, then the add: mostly the model's bits
        assert np.mean(np.asarray(got) == np.asarray(want)) >= 0.9


def test_linear_residual_row_zero_is_batch_invariant():
    o, w, residual = _residual_inputs("demo down", 17, jnp.bfloat16, seed=5)
    alone = linear_residual_small(o[:1], w, residual[:1], config=CFG)
    for t in (6, 17):
        batch = linear_residual_small(o[:t], w, residual[:t], config=CFG)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(batch[0]))


@pytest.mark.parametrize("t", [1, 17])
@pytest.mark.parametrize("config", list(FORCED))
@pytest.mark.parametrize("name", list(RESIDUAL_SETS))
def test_linear_residual_forced_configs_match_model_jnp(name, config, t):
    o, w, residual = _residual_inputs(name, t, jnp.float32, seed=2)
    got = linear_residual_small(o, w, residual, config=FORCED[config])
    assert rel_err(got, linear(o, w, residual=residual)) <= 1e-5


@pytest.mark.parametrize("config", list(FORCED))
def test_linear_residual_forced_configs_row_zero_is_batch_invariant(config):
    o, w, residual = _residual_inputs("demo down", 17, jnp.bfloat16, seed=6)
    alone = linear_residual_small(o[:1], w, residual[:1], config=FORCED[config])
    for t in (6, 17):
        batch = linear_residual_small(o[:t], w, residual[:t], config=FORCED[config])
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(batch[0]))


def test_kernel_calls_route_small_bf16_output_projections_only():
    calls = KernelCalls(interpret=True, linear_residual_triton=True)
    o, w, residual = _residual_inputs("demo o_proj", 12, jnp.bfloat16)
    got = calls.linear_residual(o.reshape(2, 6, -1), w, residual.reshape(2, 6, -1))
    want = linear(o.reshape(2, 6, -1), w, residual=residual.reshape(2, 6, -1))
    assert got.shape == want.shape == (2, 6, 320) and rel_err(got, want) <= 1e-2
    assert KernelCalls(interpret=True).linear_residual(o, w, residual) is None          # the field off
    o18, w18, r18 = _residual_inputs("demo o_proj", 18, jnp.bfloat16)
    assert calls.linear_residual(o18, w18, r18) is None                                  # T = 18 > 17
    o32, w32, r32 = _residual_inputs("demo o_proj", 6, jnp.float32)
    assert calls.linear_residual(o32, w32, r32) is None                                  # fp32
    w_big = jnp.zeros((2056, 2048), jnp.bfloat16)                                         # past MAX_WEIGHT_BYTES
    assert calls.linear_residual(jnp.ones((6, 2048), jnp.bfloat16), w_big, jnp.ones((6, 2056), jnp.bfloat16)) is None


def test_tiles_rule_at_the_demo_and_ling_shapes():
    """tiles_for's picks (its docstring): at the demo's widths BN = 16 and every K step's loads in flight at once
    (num_stages > steps) within one-program-per-SM shared memory; at Ling's, >= ONE_WAVE programs within
    two-programs-per-SM shared memory."""
    want = {  # (N_s per projection, K, weights per program): (BN, BK, splits, num_stages)
        ((1600, 5), 320, 1): (16, 64, 2, 6),              # demo KDA w_qkvfg | b_proj
        ((480, 160, 5), 320, 1): (16, 64, 2, 6),          # demo MLA q | kv_a | g_proj
        ((960,), 320, 2): (16, 64, 2, 6),                 # demo dense gate | up
        ((320,), 320, 1): (16, 64, 2, 6),                 # demo o_proj / dense + residual
        ((320,), 960, 1): (16, 256, 4, 5),                # demo down_proj + residual
        ((20480, 32), 2560, 1): (64, 128, 1, 4),          # Ling KDA w_qkvfg | b_proj
        ((6144, 576, 32), 2560, 1): (32, 256, 2, 3),      # Ling MLA q | kv_a | g_proj
        ((6144,), 2560, 2): (32, 128, 2, 4),              # Ling dense gate | up
        ((2560,), 4096, 1): (16, 256, 4, 4),              # Ling o_proj / MLA dense + residual
        ((2560,), 6144, 1): (16, 256, 4, 4),              # Ling dense down_proj + residual
    }
    for (n_rows, k, n_w), tiles in want.items():
        c = tiles_for(n_rows, k, n_w)
        assert (c.block_n, c.block_k, c.splits, c.num_stages) == tiles, (n_rows, k, c)
        steps, programs = -(-k // c.block_k), sum(-(-n // c.block_n) for n in n_rows)
        smem = c.num_stages * 2 * c.block_k * (c.block_t + n_w * c.block_n + 1)
        if k <= 960:
            assert c.num_stages > steps and smem <= nlt.SMEM_ONE_PER_SM, (n_rows, k, c, smem)
        else:
            assert programs >= nlt.ONE_WAVE and smem <= nlt.SMEM_TWO_PER_SM, (n_rows, k, c, programs, smem)
    forced = tiles_for((320,), 960, 1, FORCED["tail"])                                  # set fields are kept
    assert (forced.block_n, forced.block_k, forced.splits, forced.num_stages) == (64, 256, 4, 2)


@pytest.mark.parametrize("bad", [dict(splits=3), dict(block_k=32, splits=4), dict(block_n=24), dict(num_warps=3)])
def test_config_rejects_bad_tiles(bad):
    with pytest.raises(ValueError):
        NormLinearConfig(**bad)


LING_D = 2560
LING = {  # Ling-3.0-flash's single-input normed projections at D = 2560: ((kind, N_s), ...)
    "kda w_qkvfg | b_proj": (("linear", 5 * 4096), ("linear", 32)),
    "mla q | kv_a | g_proj": (("linear", 32 * 192), ("linear", 512 + 64), ("sigmoid", 32)),
    "dense gate | up": (("swiglu", 6144),),
}
LING_RESIDUAL = {"kda o_proj / mla dense": (4096, 2560), "dense down_proj": (6144, 2560)}  # (K, N)


def _launch(text):
    """The one Triton launch's (grid_x, num_stages, num_warps) in lowered StableHLO text."""
    assert text.count("__gpu$xla.gpu.triton") == 1, text.count("__gpu$xla.gpu.triton")
    keys = ("grid_x", "num_stages", "num_warps")
    return tuple(int(re.search(rf"{key} = (\d+) : i32", text).group(1)) for key in keys)


@pytest.mark.parametrize("t", [1, 6, 17])
def test_kernels_lower_for_cuda_at_ling_flash_shapes(t):
    """Both kernels lower for CUDA (H200, abstract: nothing runs) at every Ling-3.0-flash shape they take, ONE
    Triton launch each (no second launch for any reduction), with tiles_for's grid, stages and warps."""
    from tests.cuda_lowering import S, lower_cuda

    bf = jnp.bfloat16
    for name, specs in LING.items():
        projs = tuple(Proj(kind) for kind, _ in specs)
        ws = tuple((S((n, LING_D), bf),) * 2 if kind == "swiglu" else S((n, LING_D), bf) for kind, n in specs)
        text = lower_cuda(lambda x, nw, *w: norm_linear_small(x, nw, w, projs=projs, eps=EPS),
                          S((t, LING_D), bf), S((LING_D,), bf), *ws)
        c = tiles_for(tuple(n for _, n in specs), LING_D, max(p.n_weights for p in projs))
        assert _launch(text) == (sum(-(-n // c.block_n) for _, n in specs), c.num_stages, c.num_warps), name
    for name, (k, n) in LING_RESIDUAL.items():
        text = lower_cuda(linear_residual_small, S((t, k), bf), S((n, k), bf), S((t, n), bf))
        c = tiles_for((n,), k, 1)
        assert _launch(text) == (-(-n // c.block_n), c.num_stages, c.num_warps), name


def test_sharded_calls_refuse_the_triton_projections():
    """One device only, as fused_linear: ShardedKernelCalls rejects both fields (compile.sharding.kernel_calls_for
    turns them off on more than one device)."""
    from compile.sharding import ShardedKernelCalls

    for field in ("norm_linear_triton", "linear_residual_triton"):
        with pytest.raises(ValueError, match=f"{field}=True"):
            ShardedKernelCalls(interpret=True, mesh=jax.make_mesh((1,), ("tp",)), **{field: True})
