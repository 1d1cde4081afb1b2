"""The model with its fused norm + projection kernels (KernelCalls.fused_linear: pallas_kernels/fused_linear.py in
the Mosaic GPU interpreter) against the XLA-only model (kernels=None): decode and verify logits in bf16 (the
kernels' path) and fp32 (the jnp fallback, exact), NEXTN greedy equal to plain greedy with the kernels on, and
the kernel count of each flash-sized layer pass lowered for CUDA (so the count per layer pass is pinned on CPU).

The model: test-tiny cut to 3 layers (KDA + dense, KDA + MoE, MLA + MoE, then the MTP layer) with a dense width
of 256, so every projection has K a multiple of 128 and the fused path serves all of them; b_proj / g_proj
(H = 4 rows) and kv_a (80 rows) exercise the chooser's padding of widths the kernel's store cannot tile.
Interpreted kernels are finished (block_until_ready) before the next computation: an eager op dispatched while the
interpreter's callbacks still run can deadlock with them (tests/test_kernels_mla_attention.py).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import get_preset
from ling_jax.kernel_calls import KernelCalls
from ling_jax.model import Numerics, RuntimeOptions, commit, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import init_params
from tests.conftest import rel_err

CFG = get_preset("test-tiny").replace(num_hidden_layers=3, intermediate_size=256, routed_swiglu_limits=(),
                                      shared_swiglu_limits=(), vocab_size=12, eos_token_id=1, pad_token_id=0)
TRACED: list = []  # (call, whether the fused kernel took it), appended when a program is traced


class Census(KernelCalls):
    """KernelCalls that records, at trace time, which projection calls the fused kernels took."""

    def norm_linear(self, h, projections, **kw):
        out = super().norm_linear(h, projections, **kw)
        TRACED.append(("norm_linear", tuple(p.kind for p in projections), out is not None))
        return out

    def linear_residual(self, o, w, residual, **kw):
        out = super().linear_residual(o, w, residual, **kw)
        TRACED.append(("linear_residual", out is not None))
        return out


FUSED = Census(interpret=True, fused_linear=True)
UNFUSED = KernelCalls(interpret=True, fused_linear=False)


def verify_and_decode(toks, opts):
    def f(params, base):
        v = forward(params, toks, base, CFG, mode="verify", opts=opts)
        c = commit(v.state, v.pending, jnp.array([2], jnp.int32), opts)
        d = forward(params, toks[:, :1], base, CFG, mode="decode", opts=opts)
        return (lm_logits(params, v.hidden), lm_logits(params, d.hidden), c.kda_recurrent, d.state.kda_recurrent,
                v.state.mla_cache)
    return f


def run(params, toks, base, opts):
    """verify over toks [1, 4] and its commit of 2 rows, decode of toks[:, :1]: (verify logits, decode logits,
    committed KDA state, decoded KDA state, MLA cache after verify)."""
    return jax.block_until_ready(jax.jit(verify_and_decode(toks, opts))(params, base))


NAMES = ("verify logits", "decode logits", "commit state", "decode state", "mla cache")


def test_bf16_decode_and_verify_with_fused_projections_match_xla():
    """Against XLA's bf16 model to 2e-2: the interpreted KDA / MoE kernels alone are 1.3e-2 off it on this random
    model (fused_linear on or off alike; XLA's own bf16 logits are 27 % off its fp32 ones here); the fused
    projections are pinned against the same kernels without them, to 1e-6 (the interpreter rounds where the
    model rounds)."""
    params = init_params(CFG, 0, jnp.bfloat16)
    toks = jax.random.randint(jax.random.key(1), (1, 12), 0, CFG.vocab_size)
    prefill = jax.jit(lambda p, t, s: forward(p, t, s, CFG, mode="prefill", opts=RuntimeOptions(kernels=None)))
    base = jax.block_until_ready(prefill(params, toks[:, :8], init_state(CFG, 1, 32, jnp.bfloat16)).state)
    want = run(params, toks[:, 8:], base, RuntimeOptions(kernels=None))
    TRACED.clear()
    got = run(params, toks[:, 8:], base, RuntimeOptions(kernels=FUSED))
    for name, g, w in zip(NAMES, got, want):
        assert rel_err(g, w) <= 2e-2, (name, rel_err(g, w))
    # Per target pass: 2 KDA + 1 MLA input projections, the dense gate|up; 3 output projections + dense down; every
    # one of both passes through the fused kernels.
    norm = [t for t in TRACED if t[0] == "norm_linear"]
    assert sorted(t[1] for t in norm[:4]) == [("linear", "linear"), ("linear", "linear"),
                                              ("linear", "linear", "sigmoid"), ("swiglu",)]
    assert len(norm) == 8 and len(TRACED) == 16 and all(t[-1] for t in TRACED), TRACED
    for name, g, u in zip(NAMES, got, run(params, toks[:, 8:], base, RuntimeOptions(kernels=UNFUSED))):
        assert rel_err(g, u) <= 1e-6, (name, rel_err(g, u))


def test_fp32_runs_the_jnp_projections():
    """The kernel takes bf16 only: in fp32 no projection call is fused and the program is the one with
    fused_linear off (same jaxpr), whose agreement with XLA to 1e-5 is tests/test_kernels_wired.py's."""
    params = jax.eval_shape(lambda: init_params(CFG, 0, jnp.float32))
    base = jax.eval_shape(lambda: init_state(CFG, 1, 32, jnp.float32))
    toks = jnp.zeros((1, 4), jnp.int32)
    TRACED.clear()
    fused = str(jax.make_jaxpr(verify_and_decode(toks, RuntimeOptions(kernels=FUSED)))(params, base))
    assert len(TRACED) == 16 and not any(t[-1] for t in TRACED), TRACED
    assert fused == str(jax.make_jaxpr(verify_and_decode(toks, RuntimeOptions(kernels=UNFUSED)))(params, base))


def test_nextn_greedy_equals_plain_greedy_with_fused_projections():
    """bf16, every target pass 3 rows (Numerics.target_rows: plain decode runs the verify shape), so the fused
    kernels see one shape in both relays: NEXTN (steps 2) emits plain greedy's tokens, drafts accepted. The steps
    (draft, verify, commit, extend) run with the kernels; the prompt's prefill in jnp."""
    from ling_jax.runner import Generator, generate_on_device
    from ling_jax.sampling import SamplingOptions
    from ling_jax.spec import SpecConfig

    params = init_params(CFG, 3, jnp.bfloat16)
    opts = RuntimeOptions(numerics=Numerics(target_rows=3), kernels=KernelCalls(interpret=True, fused_linear=True))
    emitted = {}
    for steps, n_steps in ((0, 4), (2, 2)):
        spec = SpecConfig("NEXTN", steps) if steps else SpecConfig("NONE")
        # the prompt through the jnp model (one state for both relays, fewer interpreted programs to compile)
        gen = Generator(CFG, params, spec=spec, max_len=64, chunked_prefill_size=8, dtype=jnp.bfloat16,
                        opts=opts.replace(kernels=None))
        state, first, _ = gen.prefill([3, 7, 1, 9, 4], SamplingOptions().device(CFG.vocab_size), jax.random.key(0),
                                      True)
        state = jax.block_until_ready(state)
        _, buf, count = jax.block_until_ready(generate_on_device(CFG, spec, n_steps, opts=opts)(params, state))
        emitted[steps] = [int(first[0])] + [int(t) for t in np.asarray(buf[0, : int(count[0])])]
    plain, nextn = emitted[0], emitted[2]
    assert len(nextn) > 1 + 2, "no draft was accepted: the test would not exercise acceptance"
    n = min(len(plain), len(nextn))
    assert nextn[:n] == plain[:n]


def _flash_passes(t: int, calls: KernelCalls):
    """Functions of one layer pass of Ling-3.0-flash (x [1, t, D] -> x' and states) with these kernel calls, and
    their abstract arguments."""
    from compile.stages import slice_config
    from ling_jax.layers.kda import kda_layer
    from ling_jax.layers.linear import Normed
    from ling_jax.model import ffn, mla_block
    from ling_jax.nextn import mtp_forward
    from ling_jax.weights import abstract_params
    from tests.cuda_lowering import S

    cfg = slice_config(get_preset("ling3-flash"), 6)  # layers 0, 1 KDA + dense; 2..4 KDA + MoE; 5 MLA + MoE
    params = abstract_params(cfg)
    opts = RuntimeOptions(kernels=calls)
    H, K, C, BF = cfg.num_attention_heads, cfg.head_dim, cfg.kda_dim, jnp.bfloat16
    x = S((1, t, cfg.hidden_size), BF)
    conv, rec = S((1, cfg.short_conv_kernel_size - 1, 3, C), BF), S((1, H, K, K), jnp.float32)
    cache, lengths = S((1, 1024, cfg.mla_cache_dim), BF), S((1,), jnp.int32)
    mode = "decode" if t == 1 else "verify"

    def kda_pass(i):
        def f(p, x, conv, rec):
            x, conv, rec, pending = kda_layer(p["attn"], Normed(x, p["input_norm"], cfg.rms_norm_eps), conv, rec,
                                              cfg, mode=mode, n_valid=jnp.ones((1,), jnp.int32), chunked=False,
                                              kernels=opts.calls, residual=x)
            return ffn(p, x, cfg, i, opts), conv, rec, pending
        return f, (params["layers"][i], x, conv, rec)

    def mla_pass(p, x, cache, lengths):
        return mla_block(p, x, cache, lengths, cfg, 5, absorbed=True, opts=opts)

    def mtp_pass(params, tokens, hidden, cache, lengths):
        return mtp_forward(params, tokens, hidden, cache, lengths, cfg, absorbed=True, opts=opts)

    return {"kda + dense": kda_pass(0), "kda + moe": kda_pass(2),
            "mla + moe": (mla_pass, (params["layers"][5], x, cache, lengths)),
            "mtp": (mtp_pass, (params, S((1, t), jnp.int32), x, cache, lengths))}


# Custom calls per layer pass (Mosaic GPU, Triton) and the XLA dots left, at T = 1 (decode: KDA verify + commit) and
# T = 6 (NEXTN5 verify: the commit runs later). Mosaic: one fused norm + projection kernel per normed input (KDA
# w_qkvfg | b_proj, MLA q | kv_a | g_proj, dense gate | up, MTP eh_proj) and one projection + residual per output
# projection (KDA o_proj, MLA dense, dense down_proj), the MoE up / down; Triton: kda_verify / kda_commit, the
# router's 2 kernels. KDA + dense keeps no dot (every projection is fused); MLA keeps the absorbed attention's 4
# (q_nope W_uk, scores, context, W_uv). The MoE layers' post-attention norm stays in XLA: the router and the MoE
# kernel (shared expert included) both read the normed rows.
PASS_CALLS = {1: {"kda + dense": (4, 2, 0), "kda + moe": (4, 4, 0), "mla + moe": (4, 2, 4), "mtp": (5, 2, 4)},
              6: {"kda + dense": (4, 1, 0), "kda + moe": (4, 3, 0), "mla + moe": (4, 2, 4), "mtp": (5, 2, 4)}}


def _census(text: str) -> tuple:
    return (text.count("custom_call @mosaic_gpu"), text.count("__gpu$xla.gpu.triton"),
            text.count("stablehlo.dot_general"))


@pytest.mark.parametrize("t", [1, 6])
def test_flash_layer_passes_lower_for_cuda_with_fused_projections(t):
    from tests.cuda_lowering import lower_cuda

    got = {name: _census(lower_cuda(f, *args)) for name, (f, args) in _flash_passes(t, KernelCalls(fused_linear=True)).items()}
    assert got == PASS_CALLS[t]
    f, args = _flash_passes(t, KernelCalls(fused_linear=False))["kda + dense"]
    assert _census(lower_cuda(f, *args)) == (0, PASS_CALLS[t]["kda + dense"][1], 6)  # the 6 projections in XLA


def test_chooser_falls_back_where_the_kernel_does_not_take_the_call():
    """KernelCalls.norm_linear / linear_residual return None (the caller's jnp) for fp32, the field off, and shapes past the kernel's limits (its ValueError: x [24, 8192] does not fit SMEM); a bf16 call that
    fits returns the outputs in the model's shapes (KDA's [5, C, D] weight -> [B, T, 5, C], b_proj's 4 rows
    padded for the kernel's store and sliced back). Traced only (eval_shape): nothing runs."""
    from compile.sharding import ShardedKernelCalls
    from ling_jax.layers.linear import Normed, Projection
    from ling_jax.quant import quantize
    from tests.cuda_lowering import S

    BF = jnp.bfloat16
    calls = KernelCalls(interpret=True, fused_linear=True)
    w5, b = S((5, 128, 256), BF), S((4, 256), BF)

    def norm_linear(calls, x, *ws, fp8_activations=False):
        return calls.norm_linear(Normed(x, jnp.ones((x.shape[-1],), x.dtype), 1e-6), tuple(map(Projection, ws)),
                                 fp8_activations=fp8_activations)

    shapes = jax.eval_shape(lambda x, w, b: norm_linear(calls, x, w, b), S((1, 3, 256), BF), w5, b)
    assert [(o.shape, o.dtype) for o in shapes] == [((1, 3, 5, 128), BF), ((1, 3, 4), BF)]
    F32, q8 = jnp.float32, quantize(jnp.ones((128, 256), BF))

    def none(f, *args):
        got = []
        jax.eval_shape(lambda *a: got.append(f(*a) is None), *args)
        return got == [True]

    assert none(lambda x, w: norm_linear(calls, x, w), S((1, 3, 256), F32), S((128, 256), F32))
    assert none(lambda x, w: norm_linear(KernelCalls(fused_linear=False), x, w), S((1, 3, 256), BF), S((128, 256), BF))
    assert none(lambda x, w: norm_linear(calls, x, w), S((1, 24, 8192), BF), S((64, 8192), BF))
    # fp8 weights: the fp8 kernel takes them (pallas_kernels/fused_linear_fp8.py); fp32 activations still fall back
    assert not none(lambda x: norm_linear(calls, x, q8), S((1, 3, 256), BF))
    assert none(lambda x: norm_linear(calls, x, q8), S((1, 3, 256), F32))
    # o_proj at T = 17 (K = 4096): x no longer fits SMEM resident; the kernel streams it in chunks and takes it
    assert not none(lambda o, w, r: calls.linear_residual(o, w, r), S((1, 17, 4096), BF), S((2560, 4096), BF),
                    S((1, 17, 2560), BF))
    assert none(lambda o, w, r: calls.linear_residual(o, w, r), S((1, 6, 4096), F32), S((2560, 4096), F32),
                S((1, 6, 2560), F32))
    assert not none(lambda o, w, r: calls.linear_residual(o, w, r), S((1, 6, 4096), BF), S((2560, 4096), BF),
                    S((1, 6, 2560), BF))
    # fp8_activations (the numerics' "dynamic": the e4m3 form, x quantised in the prologue, so kept resident):
    # o_proj at T = 17 falls back (the layer's jnp then quantises: tests/test_fp8_activations.py)
    q8o = quantize(jnp.ones((64, 4096), BF))
    assert not none(lambda x: norm_linear(calls, x, q8, fp8_activations=True), S((1, 3, 256), BF))
    e4m3 = lambda o, r: calls.linear_residual(o, q8o, r, fp8_activations=True)
    assert not none(e4m3, S((1, 6, 4096), BF), S((1, 6, 64), BF))
    assert not none(lambda o, r: calls.linear_residual(o, q8o, r), S((1, 17, 4096), BF), S((1, 17, 64), BF))
    assert none(e4m3, S((1, 17, 4096), BF), S((1, 17, 64), BF))
    with pytest.raises(ValueError, match="fp8_linear_scale"):
        KernelCalls(fp8_linear_scale="e5m2")
    with pytest.raises(ValueError, match="fp8_linear_scale='e4m3' quantises the activations: a numerics choice"):
        KernelCalls(fp8_linear_scale="e4m3")
    with pytest.raises(ValueError, match="fused_linear=True"):
        ShardedKernelCalls(interpret=True, mesh=jax.make_mesh((1,), ("tp",)), fused_linear=True)
    # the defaults: fp8 weights through the fp8 kernel (fused_linear_fp8), bf16 weights through XLA (fused_linear)
    default = KernelCalls(interpret=True)
    assert not none(lambda x: norm_linear(default, x, q8), S((1, 3, 256), BF))
    assert not none(lambda o, r: default.linear_residual(o, q8, r), S((1, 3, 256), BF), S((1, 3, 128), BF))
    assert none(lambda x, w: norm_linear(default, x, w), S((1, 3, 256), BF), S((128, 256), BF))
    assert none(lambda x, w: norm_linear(default, x, q8, w), S((1, 3, 256), BF), S((128, 256), BF))  # mixed
    no_fp8 = KernelCalls(interpret=True, fused_linear=True, fused_linear_fp8=False)
    assert none(lambda x: norm_linear(no_fp8, x, q8), S((1, 3, 256), BF))
    assert none(lambda o, r: no_fp8.linear_residual(o, q8, r), S((1, 3, 256), BF), S((1, 3, 128), BF))
    assert not none(lambda x, w: norm_linear(no_fp8, x, w), S((1, 3, 256), BF), S((128, 256), BF))
    with pytest.raises(ValueError, match="fused_linear_fp8=True"):
        ShardedKernelCalls(interpret=True, mesh=jax.make_mesh((1,), ("tp",)), fused_linear_fp8=True)


DEMO = Path(__file__).resolve().parents[1] / "models" / "ling-demo"  # the shipped v2 demo model's config.json


def _demo_step_lowered(mode: str, calls: KernelCalls) -> str:
    """The bench_step program (compile.stages.Program: plain step, or the NEXTN step of 5 drafts) of the shipped
    v2 demo model (models/ling-demo/config.json) at the bench's context, lowered for CUDA on abstract params."""
    from compile.stages import Program
    from ling_jax.config import from_hf_config
    from ling_jax.weights import abstract_params
    from tests.cuda_lowering import lower_cuda

    cfg = from_hf_config(DEMO)
    prog = Program(cfg, mode=mode, steps=5, max_len=8192 + 1024, opts=RuntimeOptions(kernels=calls))
    return lower_cuda(prog.fn(), abstract_params(cfg, jnp.bfloat16), prog.abstract_state())


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_v2_demo_step_lowers_for_cuda_with_every_projection_fused(mode):
    """The v2 demo's dims (D = 320 = 5 x 64, H = 5, kv_a 160, q 480, dense 960) are no multiples of the kernel's
    default block_k 128: the chooser's block_k 64 and row padding must let the kernel take every projection of
    the step. Per target pass: 2 calls per layer (input projections, output projection + residual) and 2 for the
    dense MLP of layer 0; per MTP pass (NEXTN: 5 = 4 drafts + extend): eh_proj, MLA input and output. Lowered
    text: one Mosaic GPU custom call per distinct kernel (same kernel, same shapes: one function, called again)."""
    from ling_jax.config import from_hf_config

    cfg = from_hf_config(DEMO)
    TRACED.clear()
    text = _demo_step_lowered(mode, Census(fused_linear=True))
    target = 2 * cfg.num_hidden_layers + 2 * cfg.first_k_dense_replace
    mtp = 3 * 5 * len(cfg.mtp_layers) if mode == "nextn" else 0
    assert [t for t in TRACED if not t[-1]] == []                      # no projection fell back to the jnp
    assert len(TRACED) == target + mtp == {"plain": 18, "nextn": 33}[mode]
    # distinct kernels: KDA in, o_proj / MLA dense (same shapes), MLA in, dense gate|up, down (plain: 5); NEXTN
    # the verify pass at T = 6 and the MTP's T = 1 drafts, 320 -> 320 + residual and MLA in at both, eh_proj at both
    assert text.count("custom_call @mosaic_gpu") == {"plain": 5, "nextn": 9}[mode]
    unfused = _demo_step_lowered(mode, KernelCalls(fused_linear=False))
    assert "custom_call @mosaic_gpu" not in unfused
    assert unfused.count("stablehlo.dot_general") > text.count("stablehlo.dot_general")


def test_v2_demo_mtp_input_runs_fused_at_block_k_64():
    """The MTP's eh_proj over [enorm(e) | hnorm(h)] of the v2 demo: two inputs of 320 columns (each a multiple of
    64, not of 128) through KernelCalls.norm_linear in the Mosaic GPU interpreter, against the model's jnp
    (layers.linear.norm_projections with kernels=None): bitwise, as the kernel keeps the model's rounding points."""
    from ling_jax.layers.linear import Normed, Projection, norm_projections

    k = jax.random.split(jax.random.key(4), 5)
    e, h = ((2 * jax.random.normal(kk, (1, 3, 320), jnp.float32)).astype(jnp.bfloat16) for kk in k[:2])
    ne, nh = ((1 + 0.2 * jax.random.normal(kk, (320,), jnp.float32)).astype(jnp.bfloat16) for kk in k[2:4])
    w = (jax.random.normal(k[4], (320, 640), jnp.float32) * 640 ** -0.5).astype(jnp.bfloat16)
    normed, projs = Normed((e, h), (ne, nh), 1e-6), (Projection(w),)
    calls = KernelCalls(interpret=True, fused_linear=True)
    assert calls._linear_config((320, 320)).block_k == 64
    got = calls.norm_linear(normed, projs)
    assert got is not None, "the chooser fell back: the fused kernel did not take the v2 eh_proj"
    (ref,) = norm_projections(normed, projs, None)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(ref, np.float32))
