"""BailingMoeV3 forward over [B, T] tokens with an explicit DecodeState, in three modes.

Shape legend: B batch, T positions this call, D hidden, V vocab, Lk/Lm KDA/MLA layer counts.

    x = Embed(tokens)
    for each layer:  x += Attn(RMSNorm(x))   (KDA or gated MLA)
                     x += FFN(RMSNorm(x))    (dense SwiGLU or MoE)
    hidden = RMSNorm(x);  logits = hidden @ lm_head^T

Modes (positions start at state.lengths[b]):
  "prefill": any T; consumes tokens[:, :n_valid] into the state (KDA chunked form by default).
  "decode":  T = 1; recurrent KDA step.
  "verify":  K positions; writes MLA cache rows (rows past the accepted count are overwritten later) but leaves
             the committed KDA state and lengths untouched; returns a KdaPending for `commit`.
Model code is pure: jit, donation and sharding are applied by the caller.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.config import ModelConfig
from ling_jax.kernel_calls import CHOICES as KERNEL_CHOICES
from ling_jax.kernel_calls import KernelCalls, kernel_calls
from ling_jax.layers.kda import KdaPending, kda_commit_layers, kda_in_place, kda_layer, kda_verify_block
from ling_jax.layers.linear import Normed
from ling_jax.layers.mla import mla_layer
from ling_jax.layers.moe import dense_mlp, moe_layer
from ling_jax.layers.norms import rms_norm
from ling_jax.quant import ACTIVATIONS as FP8_ACTIVATIONS
from ling_jax.quant import dense
from ling_jax.state import DecodeState

MODES = ("prefill", "decode", "verify")


@dataclass(frozen=True)
class Numerics:
    """What rounding and which (equal in exact arithmetic) form the math takes; the kernels are chosen elsewhere.

    router_fp32: router gate weight upcast to fp32 (as the HF reference) vs bf16 with fp32 accumulation.
    lm_head_fp32: lm_head weight upcast to fp32 vs bf16 with fp32 accumulation.
    kda_chunked_prefill: chunked (UT) KDA for prefill vs the recurrent scan; kda_chunk its chunk length.
    mla_absorbed: absorbed-weight MLA attention for decode/verify (prefill always uses the plain path).
    target_rows: row-invariant decoding. When set, every target pass after prefill (plain decode and NEXTN
      verify) runs exactly this many rows (padding repeats a real token; padded rows are never committed), so a
      token's logits go through kernels of one shape whatever produced it. Matmul kernels are chosen by shape
      (e.g. a GEMV for 1 row, a GEMM for 6), and their accumulation orders differ: without this, bf16 plain
      greedy and NEXTN greedy part ways at near-ties. Costs the padded rows' work (small at batch 1).
    fp8_activations: what a block-fp8 weight's GEMM does with its input (the checkpoint's activation_scheme
      "dynamic" says how it MAY be quantised; whether it is, is this choice). "none": the input stays in the
      activation dtype and the weight is dequantised (weight-only fp8, the bf16 model's math on the dequantised
      weights). "dynamic": the input is first quantised per token and 128-column group to e4m3 with its own scale
      (quant.fake_quantize_activations: DeepSeek-V3's act_quant, the w8a8 SGLang / vLLM serve this format with):
      every fp8-weight projection (KDA / MLA input projections, q_b_proj, o_proj / dense, the dense MLP, the MTP
      eh_proj when stored fp8) and both GEMMs of every fp8 expert (x before gate | up, h before down; the shared
      expert too). bf16 weights (the checkpoint's modules_to_not_convert) never quantise their input. Not
      quantised under "dynamic" either: the router gate and lm_head (bf16 in the format; an fp8 one is read
      weight-only, as its kernels take bf16 rows), and MLA's kv_b_proj, which decode applies absorbed (W_uk folded
      into the query, W_uv after attention: no [token, Lr] input to quantise) and prefill expanded: it stays
      weight-only in both so the two forms remain one math (SGLang's absorbed decode also reads it dequantised).
      The kernels follow this choice (kernel_calls.KernelCalls: the e4m3 forms under "dynamic", the weight-only
      forms under "none"); a call an e4m3 kernel does not take runs the jnp with the same quantisation.
    """

    router_fp32: bool = False
    lm_head_fp32: bool = False
    kda_chunked_prefill: bool = True
    kda_chunk: int = 64
    mla_absorbed: bool = True
    target_rows: int | None = None
    fp8_activations: str = "none"

    def __post_init__(self):
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ValueError(f"fp8_activations={self.fp8_activations!r} not in {FP8_ACTIVATIONS} (none: fp8 weights "
                             "with bf16 activations; dynamic: activations quantised per token and 128 columns)")
        if self.target_rows is not None and self.target_rows < 1:
            raise ValueError(f"target_rows={self.target_rows} must be >= 1")
        if self.kda_chunk < 1:
            raise ValueError(f"kda_chunk={self.kda_chunk} must be >= 1")

    @property
    def quantises_activations(self) -> bool:
        """Whether fp8-weight GEMMs quantise their inputs (fp8_activations == "dynamic"): the layers' flag."""
        return self.fp8_activations == "dynamic"


@dataclass(frozen=True)
class RuntimeOptions:
    """How to compute (not what): the numerics, and the one object that runs the kernels.

    numerics: a Numerics.
    kernels: a ling_jax.kernel_calls.KernelCalls (or a compiler's subclass of it), None for the model's own jnp
      everywhere, or one of the choices of `kernel_calls()` as a string ("auto": Pallas on GPU, jnp elsewhere;
      "pallas"; "reference"; "interpret"). A string is resolved when the model is traced (`calls`), not here:
      options are built at import time as defaults, before a program may pick its platform.
    """

    numerics: Numerics = Numerics()
    kernels: KernelCalls | str | None = "auto"

    def __post_init__(self):
        if isinstance(self.kernels, str) and self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels={self.kernels!r} not in {KERNEL_CHOICES}")

    @property
    def calls(self) -> KernelCalls | None:
        """The KernelCalls the layers run their kernels through, or None for the jnp model."""
        return kernel_calls(self.kernels) if isinstance(self.kernels, str) else self.kernels

    def replace(self, **kw) -> "RuntimeOptions":
        return dataclasses.replace(self, **kw)


class ForwardOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] after the final norm (what lm_head and the MTP head consume)
    state: DecodeState
    pending: KdaPending | None  # verify only: stacked over KDA layers
    expert_load: jax.Array | None = None  # int32[MoE layers, E] tokens routed to each expert (only when asked)
    layer_hidden: jax.Array | None = None  # [B, T, len(capture) * D]: residual stream after the captured layers
    # hidden not yet computed: Normed(last layer's output [B, T, D], final norm), for a kernel that folds the final
    # norm in (lm_argmax); None where a fused layer boundary computed hidden
    final: Normed | None = None


def embed(params, tokens):
    return jnp.take(params["embed"], tokens, axis=0)


def lm_logits(params, hidden, opts: RuntimeOptions = RuntimeOptions()):
    """hidden [..., D] -> logits [..., V] float32."""
    w = dense(params["lm_head"], hidden.dtype) if "lm_head" in params else params["embed"]  # tied embeddings
    if opts.numerics.lm_head_fp32:
        return jnp.einsum("...d,vd->...v", hidden.astype(jnp.float32), w.astype(jnp.float32))
    return jnp.einsum("...d,vd->...v", hidden, w, preferred_element_type=jnp.float32)


def head_fused(opts: RuntimeOptions) -> bool:
    """Whether the kernel calls run a greedy token's lm_head + argmax as one kernel (KernelCalls.lm_head_argmax):
    a static choice of the step (ling_jax/spec.py: argmax_only), made before any logits are traced."""
    calls = opts.calls
    return calls is not None and calls.lm_head_argmax


def lm_argmax(params, h: Normed, opts: RuntimeOptions = RuntimeOptions()):
    """argmax_v lm_logits(params, RMSNorm h) without the logits: (tokens int32[...], the normed rows [..., D])
    from the fused kernel (KernelCalls.head_argmax), or None where no kernel takes the call (the caller computes
    the logits). h: a Normed of the rows [..., D] with the final norm (ForwardOutput.final). The same token as
    jnp.argmax of lm_logits (first index on ties) up to the kernel's sum order, in either lm_head_fp32 form
    (bf16 products are exact in fp32)."""
    calls = opts.calls
    if calls is None:
        return None
    return calls.head_argmax(h, params["lm_head"] if "lm_head" in params else params["embed"])


def ffn(p, x, cfg: ModelConfig, i: int, opts: RuntimeOptions, return_load: bool = False, live_rows=None,
        next_norm=None):
    """x + FFN(RMSNorm(x)): the feed-forward half of layer i (dense or MoE; p the block's params); i indexes the
    clamp schedule (MTP layers included).
    return_load: return (x', expert load int32[E] or None for a dense layer).
    live_rows: int32[B] or None; rows t >= live_rows[b] are padding and take the routing of the last live row
    (their outputs are discarded; borrowing keeps them from reading any other expert's weights).
    next_norm: (MoE layers, where opts.calls.fuses_layer_boundary) the weight of the RMSNorm that reads x' (the
    next layer's input norm, or the final norm): x' becomes the pair (x', RMSNorm(x')), both from the MoE's
    kernel call (under TP: its all-reduce fused with the add and the norm)."""
    h = Normed(x, p["post_norm"], cfg.rms_norm_eps)
    if cfg.is_moe(i):  # the router and the MoE kernel (shared expert included) both read the normed rows
        boundary = None if next_norm is None else (x, next_norm, cfg.rms_norm_eps)  # (the router's kernel may norm)
        # x' = x + MoE(x) from moe_layer (the add in the MoE's kernel where it folds it), or the boundary (x', normed)
        return moe_layer(p["mlp"], h, cfg, routed_limit=cfg.routed_limit(i), shared_limit=cfg.shared_limit(i),
                         router_fp32=opts.numerics.router_fp32, return_load=return_load, kernels=opts.calls,
                         live_rows=live_rows, boundary=boundary, residual=x if boundary is None else None,
                         fp8_activations=opts.numerics.quantises_activations)
    if next_norm is not None:
        raise ValueError(f"layer {i} is dense: only a MoE layer's boundary is fused (next_norm must be None)")
    # the clamp lists limit MoE layers' experts only (SGLang); a dense MLP is never clamped
    x = dense_mlp(p["mlp"], h, kernels=opts.calls, residual=x, fp8_activations=opts.numerics.quantises_activations)
    return (x, None) if return_load else x


def mla_block(p, x, cache, lengths, cfg: ModelConfig, i: int, *, absorbed: bool, opts: RuntimeOptions,
              return_load: bool = False, live_rows=None, layer: int | None = None, normed=None, next_norm=None):
    """A decoder block with gated-MLA attention (target MLA layers and the MTP layer). Returns (x, cache),
    or (x, cache, expert load) with return_load. layer: cache is the stacked [Lm, B, S, F], this block's is
    layer `layer` (see mla_layer). normed: RMSNorm(x) with the input norm when the previous layer's boundary
    computed it (else it is a Normed of x here); next_norm: see ffn (x is then the pair (x, normed x))."""
    h = Normed(x, p["input_norm"], cfg.rms_norm_eps) if normed is None else normed
    x, cache = mla_layer(p["attn"], h, cache, lengths, cfg, absorbed=absorbed, layer=layer, kernels=opts.calls,
                         residual=x, fp8_activations=opts.numerics.quantises_activations)
    f = ffn(p, x, cfg, i, opts, return_load, live_rows, next_norm)
    return (f[0], cache, f[1]) if return_load else (f, cache)


def _boundary_norm(params, cfg: ModelConfig, i: int, opts: RuntimeOptions):
    """The weight of the RMSNorm after layer i where its boundary is fused (a MoE layer and kernel calls that
    fuse it: the next layer's input norm, the final norm after the last), else None (the layers norm as usual)."""
    calls, layers = opts.calls, params["layers"]
    if calls is None or not calls.fuses_layer_boundary or not cfg.is_moe(i):
        return None
    return layers[i + 1]["input_norm"] if i + 1 < len(layers) else params["final_norm"]


def forward(params, tokens, state: DecodeState, cfg: ModelConfig, *, mode: str, n_valid=None,
            opts: RuntimeOptions = RuntimeOptions(), expert_load: bool = False,
            capture: tuple[int, ...] = ()) -> ForwardOutput:
    """tokens [B, T] int32 at positions state.lengths[b] + t. n_valid [B] (prefill/decode): how many of the T
    tokens are real (the rest are padding that leaves the state as it was); defaults to T.
    expert_load: also count the tokens routed to each expert of each MoE layer (padding included).
    capture: target layer ids whose output (the residual stream after layer i, before the final norm; -1 = the
    embedding) is returned concatenated in `layer_hidden`, in this order (DSpark's context features)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} not in {MODES}")
    B, T = tokens.shape
    if mode == "decode" and T != 1:
        raise ValueError(f"decode takes one token per sequence, got T={T}")
    padded = n_valid is not None
    if n_valid is None:
        n_valid = jnp.full((B,), T, jnp.int32)
    chunked = mode == "prefill" and opts.numerics.kda_chunked_prefill
    live_rows = n_valid if (mode == "verify" and padded) else None
    absorbed = mode != "prefill" and opts.numerics.mla_absorbed
    fp8_act = opts.numerics.quantises_activations

    rec, conv, cache = state.kda_recurrent, state.kda_conv, state.mla_cache
    pending, loads = [], []
    in_place = kda_in_place(opts.calls, mode)
    rows = None  # in place: the KDA layers' rows, stacked [Lk, ...] by the verify kernels
    x = embed(params, tokens)
    captured = {-1: x} if -1 in capture else {}
    ki = mi = 0
    normed = None  # RMSNorm of x with the next input norm, where the previous layer's fused boundary computed it
    for i, p in enumerate(params["layers"]):
        if i - 1 in capture and i > 0:
            captured[i - 1] = x
        next_norm = _boundary_norm(params, cfg, i, opts)
        if cfg.is_mla(i):
            x, cache, *load = mla_block(p, x, cache, state.lengths, cfg, i, absorbed=absorbed, opts=opts,
                                        return_load=expert_load, live_rows=live_rows, layer=mi, normed=normed,
                                        next_norm=next_norm)
            x, normed = x if next_norm is not None else (x, None)
            loads += [l for l in load if l is not None]
            mi += 1
            continue
        h = Normed(x, p["input_norm"], cfg.rms_norm_eps) if normed is None else normed
        if in_place:  # the kernel reads layer ki of the stacks where they lie and stacks its rows in place
            x, rows = kda_verify_block(p["attn"], h, conv, rec, cfg, layer=ki, pending=rows, kernels=opts.calls,
                                       residual=x, fp8_activations=fp8_act)
        else:
            x, new_conv, new_rec, pend = kda_layer(p["attn"], h, conv[ki], rec[ki], cfg, mode=mode,
                                                   n_valid=n_valid, chunked=chunked, kernels=opts.calls, residual=x,
                                                   fp8_activations=fp8_act)
            if pend is None:
                conv, rec = conv.at[ki].set(new_conv), rec.at[ki].set(new_rec)
            else:
                pending.append(pend)
        ki += 1
        x = ffn(p, x, cfg, i, opts, expert_load, live_rows, next_norm)
        if expert_load:
            x, load = x
            loads += [load] if load is not None else []
        x, normed = x if next_norm is not None else (x, None)
    if len(params["layers"]) - 1 in capture:
        captured[len(params["layers"]) - 1] = x
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps) if normed is None else normed
    missing = [i for i in capture if i not in captured]
    if missing:
        raise ValueError(f"capture layer ids {missing} are outside -1..{len(params['layers']) - 1}")
    layer_hidden = jnp.concatenate([captured[i] for i in capture], axis=-1) if capture else None

    if in_place and mode == "decode" and rows is not None:  # decode = every layer's verify, then ONE commit
        conv, rec = kda_commit_layers(conv, rec, rows, n_valid, opts.calls)
    lengths = state.lengths if mode == "verify" else state.lengths + n_valid.astype(jnp.int32)
    new_state = DecodeState(kda_recurrent=rec, kda_conv=conv, mla_cache=cache, lengths=lengths)
    if in_place:
        stacked = rows if mode == "verify" else None
    else:
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *pending) if pending else None
    load = (jnp.stack(loads) if loads else None) if expert_load else None
    final = Normed(x, params["final_norm"], cfg.rms_norm_eps) if normed is None else None
    return ForwardOutput(hidden, new_state, stacked, load, layer_hidden, final)


def commit(state: DecodeState, pending: KdaPending, n_accept, opts: RuntimeOptions = RuntimeOptions()) -> DecodeState:
    """Commit the first n_accept[b] verified positions: KDA states replayed from the pre-verify state (reads
    and writes |S| once per layer), conv windows slid, lengths advanced (with kernels: one kernel call for every
    layer, both states in place). MLA rows were written by verify.
    pending None: the model has no KDA layer (e.g. a slice inside the first layer group: all MLA), only the
    lengths advance."""
    if pending is None:
        return state.replace(lengths=state.lengths + n_accept.astype(jnp.int32))
    conv, rec = kda_commit_layers(state.kda_conv, state.kda_recurrent, pending, n_accept, opts.calls)
    return state.replace(kda_recurrent=rec, kda_conv=conv, lengths=state.lengths + n_accept.astype(jnp.int32))
