"""Numerics.fp8_activations ("none" | "dynamic"): the checkpoint's activation_scheme "dynamic" as a numerics choice.

Oracles: (a) one fp8 linear by hand in numpy (each row cut into 128-column groups, s = amax / 448, e4m3 through
ml_dtypes, dequantised to bf16, then the f32 matmul with the dequantised weight); the whole model under "dynamic"
against "none" (a few % apart on fp8 weights, bitwise equal on bf16 weights). (b) The Mosaic GPU interpreter's e4m3
fused projections and w8a8 MoE, reached through KernelCalls with fp8_activations=True, against the jnp model's
layers under the same numerics (the kernel tests' tolerances: 1e-2 on bf16 outputs). (c) Calls the e4m3 / w8a8
kernels do not take (K = 192 tiles at block_k 64; an expert width of 96) return the jnp WITH the quantisation.
(d) A KernelCalls field that would choose the activation numerics is an error; so is an unknown value.
"""
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ling_jax import quant
from ling_jax.config import get_preset, load_config
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.linear import Normed, Projection, linear, norm_projections
from ling_jax.layers.moe import moe_experts
from ling_jax.model import Numerics, RuntimeOptions, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import load_params
from pallas_kernels.moe_mosaic import MosaicMoeConfig
from tests.conftest import rel_err

BF, F32 = jnp.bfloat16, jnp.float32
EPS = 1e-6


def fp8_weight(key, n, k):
    """A block-fp8 weight whose 128 x 128 blocks differ in magnitude by up to 10x."""
    kw, kb = jax.random.split(key)
    mag = jnp.exp(jax.random.uniform(kb, (-(-n // 128), -(-k // 128)), F32, -1.15, 1.15))
    mag = jnp.repeat(jnp.repeat(mag, 128, 0), 128, 1)[:n, :k]
    return quant.quantize(jax.random.normal(kw, (n, k), F32) * k ** -0.5 * mag)


def numpy_w8a8(x, w: quant.Fp8Weight) -> np.ndarray:
    """The independent oracle: x [T, K] bf16 quantised per row and 128-column group by hand, dequantised to bf16,
    times the dequantised weight, in f32 numpy."""
    xf = np.asarray(x, np.float32)
    xq = np.empty_like(xf)
    for g in range(0, xf.shape[1], 128):
        blk = xf[:, g:g + 128]
        s = np.abs(blk).max(axis=1, keepdims=True) / 448.0
        safe = np.where(s > 0, s, 1.0)
        x8 = (blk / safe).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        xq[:, g:g + 128] = (x8 * s).astype(ml_dtypes.bfloat16).astype(np.float32)
    wd = np.asarray(quant.dequantize(w, F32))
    return xq @ wd.T


def test_one_fp8_linear_equals_hand_quantisation():
    """(a) K = 300 (two whole groups and a ragged one of 44), one row all zeros (s = 0): the model's linear under
    dynamic is the numpy oracle's to bf16 rounding; the unquantised linear is not (the e4m3 step is visible)."""
    k = jax.random.split(jax.random.key(1), 2)
    x = (2 * jax.random.normal(k[0], (5, 300), F32)).astype(BF).at[3].set(0)
    w = fp8_weight(k[1], 96, 300)
    want = numpy_w8a8(x, w)
    dyn = linear(x, w, fp8_activations=True)
    none = linear(x, w)
    assert dyn.dtype == BF and rel_err(dyn, want) < 4e-3
    assert not np.asarray(dyn[3], F32).any()
    assert 1e-2 < rel_err(none, want) < 6e-2 and 1e-2 < rel_err(dyn, none) < 6e-2   # e4m3: ~2^-4 per element
    # bf16 weights never quantise their input
    wb = quant.dequantize(w, BF)
    np.testing.assert_array_equal(np.asarray(linear(x, wb, fp8_activations=True), F32),
                                  np.asarray(linear(x, wb), F32))


def test_norm_projections_quantise_only_fp8_weights():
    """A call mixing an fp8 and a bf16 projection of one normed input: the bf16 one reads h as it is, the fp8 one
    the quantised h (the oracle of test (a) on RMSNorm(x))."""
    k = jax.random.split(jax.random.key(2), 4)
    x = (3 * jax.random.normal(k[0], (1, 4, 256), F32)).astype(BF)
    nw = (1 + 0.2 * jax.random.normal(k[1], (256,), F32)).astype(BF)
    w8, wb = fp8_weight(k[2], 64, 256), (jax.random.normal(k[3], (32, 256), F32) / 16).astype(BF)
    h = Normed(x, nw, EPS)
    y8, yb = norm_projections(h, (Projection(w8), Projection(wb)), fp8_activations=True)
    y8_none, yb_none = norm_projections(h, (Projection(w8), Projection(wb)))
    np.testing.assert_array_equal(np.asarray(yb, F32), np.asarray(yb_none, F32))
    assert rel_err(y8[0], numpy_w8a8(h.value()[0], w8)) < 4e-3 and rel_err(y8, y8_none) > 1e-2


DEMO = Path(__file__).resolve().parents[1] / "models" / "ling-demo"  # the shipped (trained) v2 demo model


@pytest.fixture(scope="module")
def demo():
    cfg = load_config(str(DEMO))
    return cfg, load_params(cfg, str(DEMO), dtype=BF, quantization="fp8"), load_params(cfg, str(DEMO), dtype=BF)


def _logits(cfg, params, toks, act):
    opts = RuntimeOptions(numerics=Numerics(fp8_activations=act), kernels="reference")
    out = forward(params, toks, init_state(cfg, 1, 32, BF), cfg, mode="prefill", opts=opts)
    return lm_logits(params, out.hidden, opts)


def test_model_dynamic_moves_fp8_weights_only(demo):
    """The whole jnp model (KDA, MLA, dense MLP, routed + shared experts: fp8 by fp8_policy) on the trained demo:
    dynamic is a few % off none on the fp8 weights (the same tokens on top nearly everywhere), and bitwise none on
    the bf16 weights (nothing there to quantise)."""
    cfg, q8, bf16 = demo
    toks = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (1, 24)), jnp.int32)
    none, dyn = _logits(cfg, q8, toks, "none"), _logits(cfg, q8, toks, "dynamic")
    assert 1e-2 < rel_err(dyn, none) < 0.15
    assert np.mean(np.argmax(dyn, -1) == np.argmax(none, -1)) >= 0.9
    np.testing.assert_array_equal(np.asarray(_logits(cfg, bf16, toks, "dynamic")),
                                  np.asarray(_logits(cfg, bf16, toks, "none")))


# ---- (b) the interpreted kernels under the same numerics, (c) their fallbacks --------------------------------------


def test_e4m3_fused_projections_match_the_dynamic_model():
    """KernelCalls (interpreter) with fp8_activations=True runs fused_linear_fp8's e4m3 form (K = 256: block_k 128)
    and matches the jnp layers under dynamic to 1e-2 (bf16 outputs), while being farther from the unquantised
    layers; the residual projection likewise."""
    calls = KernelCalls(interpret=True)
    k = jax.random.split(jax.random.key(3), 6)
    x = (3 * jax.random.normal(k[0], (1, 6, 256), F32)).astype(BF)
    nw = (1 + 0.2 * jax.random.normal(k[1], (256,), F32)).astype(BF)
    projs = (Projection(fp8_weight(k[2], 192, 256)), Projection((fp8_weight(k[3], 64, 256),
                                                                 fp8_weight(k[4], 64, 256)), "swiglu", 0.5))
    h = Normed(x, nw, EPS)
    got = calls.norm_linear(h, projs, fp8_activations=True)
    assert got is not None    # the kernel took it (e4m3)
    want = norm_projections(h, projs, fp8_activations=True)
    unq = norm_projections(h, projs)
    for g, w, u in zip(got, want, unq):
        assert g.shape == w.shape and rel_err(g, w) <= 1e-2 and rel_err(g, u) > 2 * rel_err(g, w)
    o = jax.random.normal(k[5], (1, 6, 256), F32).astype(BF)
    wo, res = fp8_weight(k[2], 128, 256), jnp.ones((1, 6, 128), BF)
    got = calls.linear_residual(o, wo, res, fp8_activations=True)
    assert got is not None and rel_err(got - res, linear(o, wo, fp8_activations=True)) <= 1e-2


def test_e4m3_fallback_quantises():
    """(c) K = 192 (tiles at block_k 64: the e4m3 kernel steps over 128-wide groups, ValueError): the kernel calls
    give None and the layer's jnp serves the call WITH the quantisation (bitwise the kernel-less model under
    dynamic, not the unquantised one)."""
    calls = KernelCalls(interpret=True)
    k = jax.random.split(jax.random.key(4), 3)
    x = (3 * jax.random.normal(k[0], (1, 3, 192), F32)).astype(BF)
    h, proj = Normed(x, jnp.ones((192,), BF), EPS), (Projection(fp8_weight(k[1], 64, 192)),)
    assert calls.norm_linear(h, proj, fp8_activations=True) is None
    (got,) = norm_projections(h, proj, calls, fp8_activations=True)
    (want,) = norm_projections(h, proj, fp8_activations=True)
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
    assert rel_err(got, norm_projections(h, proj)[0]) > 1e-2
    wo, res = fp8_weight(k[2], 64, 192), jnp.zeros((1, 3, 64), BF)
    assert calls.linear_residual(x, wo, res, fp8_activations=True) is None
    np.testing.assert_array_equal(np.asarray(linear(x, wo, calls, res, fp8_activations=True), F32),
                                  np.asarray(res + linear(x, wo, fp8_activations=True), F32))


def _moe_case(seed, t, i, d=256, e=16, a=2):
    k = jax.random.split(jax.random.key(seed), 8)
    x = jax.random.normal(k[0], (t, d), F32).astype(BF)
    ids = jnp.argsort(jax.random.uniform(k[1], (t, e)), axis=1)[:, :a].astype(jnp.int32)
    w = jax.random.uniform(k[2], (t, a), F32, 0.1, 1.0)
    q = lambda kk, s, fan: quant.quantize((jax.random.normal(kk, s, F32) * fan ** -0.5).astype(BF))
    experts = (q(k[3], (e, i, d), d), q(k[4], (e, i, d), d), q(k[5], (e, d, i), i))
    shared = (q(k[6], (i, d), d), q(k[7], (i, d), d), q(k[3], (d, i), i))
    return x, ids, w, experts, shared


def test_w8a8_moe_matches_the_dynamic_model_and_falls_back_quantised():
    """(b) KernelCalls.moe with fp8_activations=True in the interpreter runs the w8a8 Mosaic kernel (I = 128):
    moe_experts(fp8_activations=True) on f32 activations to 2e-3 (the kernel's own test: the same quantised math,
    summation order and the bf16 output apart), and the bf16 model under dynamic to 2e-2, well inside its distance
    from the unquantised model (5.5e-2). That 1.5e-2 is the kernel's h: it quantises SwiGLU's fp32 output where the
    model rounds h to bf16 first (linear.swiglu), and a bf16-ulp change of h flips ~1/16 of its e4m3 roundings.
    routed_moe leaves such a call to `moe`. (c) I = 96 (no 128-row group of h per CTA): the call is the jnp
    moe_experts under the same quantisation, bitwise."""
    calls = KernelCalls(interpret=True)
    x, ids, w, ex, sh = _moe_case(5, 6, 128)
    assert calls._fp8_mosaic(x, ex, sh, fp8_activations=True) and not calls._fp8_mosaic(x, ex, sh)
    kw = dict(limit=0.3, shared=sh, shared_limit=0.3)
    got = calls.moe(x, ids, w, *ex, **kw, fp8_activations=True)
    assert got.dtype == F32
    exact = moe_experts(x.astype(F32), ids, w, *ex, **kw, fp8_activations=True)
    assert rel_err(got, exact.astype(BF)) <= 2e-3
    want, unq = moe_experts(x, ids, w, *ex, **kw, fp8_activations=True), moe_experts(x, ids, w, *ex, **kw)
    assert rel_err(got, want) <= 2e-2 and rel_err(got, unq) > 3 * rel_err(got, want)
    cfg = get_preset("test-tiny")
    assert calls.routed_moe(x, jnp.zeros((16, 256), BF), jnp.zeros((16,), F32), cfg, ex, sh, limit=0.3,
                            shared_limit=0.3, fp8_activations=True) is None
    x, ids, w, ex, sh = _moe_case(6, 3, 96)
    assert not calls._fp8_mosaic(x, ex, sh, fp8_activations=True)
    got = calls.moe(x, ids, w, *ex, **kw, fp8_activations=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(moe_experts(x, ids, w, *ex, **kw,
                                                                          fp8_activations=True)))


# ---- (d) the choice is the numerics' -------------------------------------------------------------------------------


def test_contradictory_or_unknown_choices_are_errors():
    with pytest.raises(ValueError, match="fp8_activations='static' not in"):
        Numerics(fp8_activations="static")
    with pytest.raises(ValueError, match=r"fp8_linear_scale='e4m3' quantises the activations: a numerics choice"):
        KernelCalls(fp8_linear_scale="e4m3")
    with pytest.raises(ValueError, match=r"moe_fp8_scheme='w8a8' quantises the activations: a numerics choice"):
        KernelCalls(moe_fp8_scheme="w8a8")
    x, ids, w, ex, sh = _moe_case(7, 2, 128)
    with pytest.raises(ValueError, match="block_i=64 must be 128"):   # w8a8 cannot take the user's tiles
        KernelCalls(moe_tiles=MosaicMoeConfig()).moe(x, ids, w, *ex, limit=0.0, shared=sh, shared_limit=0.0,
                                                     fp8_activations=True)


def test_flags_reach_numerics():
    """--fp8-activations in generate / launch_server / bench_step (and --baseline-set fp8_activations=none: an
    argparse field programs() passes into Numerics); a value outside the choices is an argparse error."""
    from bench import bench_step
    from ling_jax import generate
    from serve import launch_server

    assert generate.build_parser().parse_args(["--model", "m", "--prompt-ids", "1"]).fp8_activations == "none"
    a = generate.build_parser().parse_args(["--model", "m", "--prompt-ids", "1", "--fp8-activations", "dynamic"])
    assert a.fp8_activations == "dynamic"
    sp = launch_server.build_parser()
    assert sp.parse_args(["--model-path", "m", "--fp8-activations", "dynamic"]).fp8_activations == "dynamic"
    assert next(x for x in sp._actions if x.dest == "fp8_activations").choices == quant.ACTIVATIONS
    with pytest.raises(SystemExit):
        generate.build_parser().parse_args(["--model", "m", "--prompt-ids", "1", "--fp8-activations", "static"])
    ap = bench_step.build_parser()
    a = ap.parse_args(["--fp8-activations", "dynamic"])
    assert bench_step.numerics_of(a) == Numerics(fp8_activations="dynamic")
    base = bench_step.parse_baseline_set(ap, a, "fp8_activations=none")
    assert base == {"fp8_activations": "none"}
    assert bench_step.numerics_of(type(a)(**{**vars(a), **base})) == Numerics()
    with pytest.raises(SystemExit):
        bench_step.parse_baseline_set(ap, a, "fp8_activations=static")
    with pytest.raises(SystemExit):
        ap.parse_args(["--fp8-linear-scale", "e4m3"])


def test_flash_fp8_layer_pass_lowers_with_the_e4m3_kernels():
    """Ling-3.0-flash's KDA + MoE layer pass at T = 6 (NEXTN5 verify) on fp8 weights, lowered for CUDA with the
    default kernel calls: under dynamic the same Mosaic / Triton kernels as under none (the e4m3 projections and the
    w8a8 MoE replace the weight-only forms one for one; no call falls back to XLA dots) and the MoE's activation
    quantisation in XLA (its x; the projections quantise in their prologue)."""
    from compile.stages import slice_config
    from ling_jax.layers.kda import kda_layer
    from ling_jax.model import ffn
    from ling_jax.weights import abstract_params
    from tests.cuda_lowering import S, lower_cuda

    cfg = slice_config(get_preset("ling3-flash"), 6)   # layer 2: KDA + MoE
    p = abstract_params(cfg, quantization="fp8")["layers"][2]
    H, K, C = cfg.num_attention_heads, cfg.head_dim, cfg.kda_dim
    args = (p, S((1, 6, cfg.hidden_size), BF), S((1, cfg.short_conv_kernel_size - 1, 3, C), BF),
            S((1, H, K, K), F32))

    def census(act):
        opts = RuntimeOptions(numerics=Numerics(fp8_activations=act), kernels=KernelCalls())

        def f(p, x, conv, rec):
            x, conv, rec, pending = kda_layer(p["attn"], Normed(x, p["input_norm"], cfg.rms_norm_eps), conv, rec,
                                              cfg, mode="verify", n_valid=jnp.ones((1,), jnp.int32), chunked=False,
                                              kernels=opts.calls, residual=x,
                                              fp8_activations=opts.numerics.quantises_activations)
            return ffn(p, x, cfg, 2, opts), pending

        text = lower_cuda(f, *args)
        return (text.count("custom_call @mosaic_gpu"), text.count("__gpu$xla.gpu.triton"),
                text.count("stablehlo.dot_general"), text.count("f8E4M3FN"))

    none, dyn = census("none"), census("dynamic")
    assert dyn[:3] == none[:3] and none[2] == 0 and none[0] >= 4
    assert dyn[3] > none[3]    # x8 of the MoE's input (quant.quantize_activations) in the program
