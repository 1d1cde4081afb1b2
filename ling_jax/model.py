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

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.config import ModelConfig
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.kda import KdaPending, kda_commit, kda_layer
from ling_jax.layers.mla import mla_layer
from ling_jax.layers.moe import dense_mlp, moe_layer
from ling_jax.layers.norms import rms_norm
from ling_jax.state import DecodeState

MODES = ("prefill", "decode", "verify")
KERNEL_CHOICES = ("auto", "pallas", "reference", "interpret")


@dataclass(frozen=True)
class RuntimeOptions:
    """How to compute (not what): numerics switches and path choices; the math is the same either way.

    router_fp32: router gate weight upcast to fp32 (as the HF reference) vs bf16 with fp32 accumulation.
    lm_head_fp32: lm_head weight upcast to fp32 vs bf16 with fp32 accumulation.
    kda_chunked_prefill: chunked (UT) KDA for prefill vs the recurrent scan.
    mla_absorbed: absorbed-weight MLA attention for decode/verify (prefill always uses the plain path).
    kernels: "auto" (Pallas on GPU, the model's jnp on CPU), "pallas" or "reference" (force either), or
      "interpret" (the Pallas kernels in the interpreter: CPU tests of the wiring). Pallas serves the MoE
      experts and the router everywhere, KDA in decode/verify/commit (prefill: see kda_pallas_prefill).
    kda_fused_decode: with Pallas, decode (T = 1) runs one fused KDA kernel (conv + delta rule + state update in
      place) instead of verify + commit. Off by default: its output uses S^T(e q) + u (k.q) for S'^T q, equal in
      exact arithmetic but not bitwise equal to the verify kernel's row, and plain greedy should match NEXTN's.
    kda_pallas_prefill: with Pallas, chunked prefill runs the Pallas chunked kernel instead of the model's jnp form.
      Off by default: on H200 it took 5.6 ms at T=2048 against XLA's 3.3 ms (bench/results/kernels-h200-*-run4).
    target_rows: row-invariant decoding. When set, every target pass after prefill (plain decode and NEXTN
      verify) runs exactly this many rows (padding repeats a real token; padded rows are never committed), so a
      token's logits go through kernels of one shape whatever produced it. Matmul kernels are chosen by shape
      (e.g. a GEMV for 1 row, a GEMM for 6), and their accumulation orders differ: without this, bf16 plain
      greedy and NEXTN greedy part ways at near-ties. Costs the padded rows' work (small at batch 1).
    kernel_calls: how the kernels are called when Pallas is on; None = directly. A compiler passes a subclass
      that wraps each call (compile.sharding.ShardedKernelCalls runs them under shard_map over its mesh).
    """

    router_fp32: bool = False
    lm_head_fp32: bool = False
    kda_chunked_prefill: bool = True
    kda_chunk: int = 64
    mla_absorbed: bool = True
    kernels: str = "auto"
    kernel_calls: KernelCalls | None = None
    kda_fused_decode: bool = False
    kda_pallas_prefill: bool = False
    target_rows: int | None = None

    def __post_init__(self):
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels={self.kernels!r} not in {KERNEL_CHOICES}")
        if self.target_rows is not None and self.target_rows < 1:
            raise ValueError(f"target_rows={self.target_rows} must be >= 1")

    @property
    def use_pallas(self) -> bool:
        from pallas_kernels.dispatch import Backend, resolve

        return self.kernels == "interpret" or resolve(self.kernels) is Backend.PALLAS

    @property
    def pallas(self) -> KernelCalls | None:
        """None (the model's jnp) or the KernelCalls the layers call the Pallas kernels through."""
        if not self.use_pallas:
            return None
        return self.kernel_calls or KernelCalls(interpret=self.kernels == "interpret")


class ForwardOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] after the final norm (what lm_head and the MTP head consume)
    state: DecodeState
    pending: KdaPending | None  # verify only: stacked over KDA layers
    expert_load: jax.Array | None = None  # int32[MoE layers, E] tokens routed to each expert (only when asked)


def embed(params, tokens):
    return jnp.take(params["embed"], tokens, axis=0)


def lm_logits(params, hidden, opts: RuntimeOptions = RuntimeOptions()):
    """hidden [..., D] -> logits [..., V] float32."""
    w = params["lm_head"] if "lm_head" in params else params["embed"]  # tied embeddings
    if opts.lm_head_fp32:
        return jnp.einsum("...d,vd->...v", hidden.astype(jnp.float32), w.astype(jnp.float32))
    return jnp.einsum("...d,vd->...v", hidden, w, preferred_element_type=jnp.float32)


def ffn(p, x, cfg: ModelConfig, i: int, opts: RuntimeOptions, return_load: bool = False, live_rows=None):
    """The feed-forward half of layer i (dense or MoE); i indexes the clamp schedule (MTP layers included).
    return_load: return (y, expert load int32[E] or None for a dense layer).
    live_rows: int32[B] or None; rows t >= live_rows[b] are padding and take the routing of the last live row
    (their outputs are discarded; borrowing keeps them from reading any other expert's weights)."""
    if cfg.is_moe(i):
        return moe_layer(p, x, cfg, routed_limit=cfg.routed_limit(i), shared_limit=cfg.shared_limit(i),
                         router_fp32=opts.router_fp32, return_load=return_load, pallas=opts.pallas,
                         live_rows=live_rows)
    y = dense_mlp(p, x)  # the clamp lists limit MoE layers' experts only (SGLang); a dense MLP is never clamped
    return (y, None) if return_load else y


def mla_block(p, x, cache, lengths, cfg: ModelConfig, i: int, *, absorbed: bool, opts: RuntimeOptions,
              return_load: bool = False, live_rows=None):
    """A decoder block with gated-MLA attention (target MLA layers and the MTP layer). Returns (x, cache),
    or (x, cache, expert load) with return_load."""
    a, cache = mla_layer(p["attn"], rms_norm(x, p["input_norm"], cfg.rms_norm_eps), cache, lengths, cfg,
                         absorbed=absorbed)
    x = x + a
    f = ffn(p["mlp"], rms_norm(x, p["post_norm"], cfg.rms_norm_eps), cfg, i, opts, return_load, live_rows)
    return (x + f[0], cache, f[1]) if return_load else (x + f, cache)


def forward(params, tokens, state: DecodeState, cfg: ModelConfig, *, mode: str, n_valid=None,
            opts: RuntimeOptions = RuntimeOptions(), expert_load: bool = False) -> ForwardOutput:
    """tokens [B, T] int32 at positions state.lengths[b] + t. n_valid [B] (prefill/decode): how many of the T
    tokens are real (the rest are padding that leaves the state as it was); defaults to T.
    expert_load: also count the tokens routed to each expert of each MoE layer (padding included)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} not in {MODES}")
    B, T = tokens.shape
    if mode == "decode" and T != 1:
        raise ValueError(f"decode takes one token per sequence, got T={T}")
    padded = n_valid is not None
    if n_valid is None:
        n_valid = jnp.full((B,), T, jnp.int32)
    chunked = mode == "prefill" and opts.kda_chunked_prefill
    live_rows = n_valid if (mode == "verify" and padded) else None
    absorbed = mode != "prefill" and opts.mla_absorbed

    rec, conv, cache = state.kda_recurrent, state.kda_conv, state.mla_cache
    pending, loads = [], []
    x = embed(params, tokens)
    ki = mi = 0
    for i, p in enumerate(params["layers"]):
        if cfg.is_mla(i):
            x, layer_cache, *load = mla_block(p, x, cache[mi], state.lengths, cfg, i, absorbed=absorbed, opts=opts,
                                              return_load=expert_load, live_rows=live_rows)
            loads += [l for l in load if l is not None]
            cache = cache.at[mi].set(layer_cache)
            mi += 1
            continue
        a, new_conv, new_rec, pend = kda_layer(p["attn"], rms_norm(x, p["input_norm"], cfg.rms_norm_eps),
                                               conv[ki], rec[ki], cfg, mode=mode, n_valid=n_valid, chunked=chunked,
                                               pallas=opts.pallas, fused_decode=opts.kda_fused_decode,
                                               pallas_prefill=opts.kda_pallas_prefill)
        if pend is None:
            conv, rec = conv.at[ki].set(new_conv), rec.at[ki].set(new_rec)
        else:
            pending.append(pend)
        ki += 1
        x = x + a
        f = ffn(p["mlp"], rms_norm(x, p["post_norm"], cfg.rms_norm_eps), cfg, i, opts, expert_load, live_rows)
        if expert_load:
            f, load = f
            loads += [load] if load is not None else []
        x = x + f
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)

    lengths = state.lengths if mode == "verify" else state.lengths + n_valid.astype(jnp.int32)
    new_state = DecodeState(kda_recurrent=rec, kda_conv=conv, mla_cache=cache, lengths=lengths)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *pending) if pending else None
    load = (jnp.stack(loads) if loads else None) if expert_load else None
    return ForwardOutput(hidden, new_state, stacked, load)


def commit(state: DecodeState, pending: KdaPending, n_accept, opts: RuntimeOptions = RuntimeOptions()) -> DecodeState:
    """Commit the first n_accept[b] verified positions: KDA states replayed from the pre-verify state (reads
    and writes |S| once per layer), conv windows slid, lengths advanced. MLA rows were written by verify."""
    replay = functools.partial(kda_commit, pallas=opts.pallas)
    conv, rec = jax.vmap(replay, in_axes=(0, 0, 0, None))(state.kda_conv, state.kda_recurrent, pending, n_accept)
    return state.replace(kda_recurrent=rec, kda_conv=conv, lengths=state.lengths + n_accept.astype(jnp.int32))
