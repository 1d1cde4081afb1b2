"""The one object that chooses and calls the Pallas kernels. The layers never import a kernel.

The model's layers take `kernels: KernelCalls | None`: None runs the model's own jnp (the reference of every
kernel), a KernelCalls runs each op through the kernel this object picks for the shapes it sees. Every choice
lives here, as fields of one frozen dataclass: no environment variables, no per-call flags in the layers.
The compiler (compile/sharding.py, `ShardedKernelCalls`) subclasses it to run the same per-device calls under
`jax.shard_map` with the specs of its sharding rules, since a Pallas custom call cannot be auto-partitioned.

Shapes (per call, the layers' view; a subclass sees its per-device slices inside shard_map):
  moe:        x [T, D], ids [T, A] int32, weights [T, A] f32, w_gate/w_up [E, I, D], w_down [E, D, I],
              shared = (gate [Is, D], up [Is, D], down [D, Is])           -> [T, D] f32
              (any weight may be a quant.Fp8Weight: w8 of that shape + its 128-block scales)
  moe_residual_norm: moe's arguments, residual [T, D], the next norm's weight [D] -> (residual [T, D], normed [T, D])
  kda_verify: proj [B, T, 5, C] (the fused q, k, v, f, out-gate streams), b_raw [B, T, H], A_log [H], dt_bias [C],
              conv_w [3, C, 1, W], the model's stacks conv_window [Lk, B, W-1, 3, C] and rec_state [Lk, B, H, K, V]
              f32 read at `layer` (int), pending: the stacked KdaPending [Lk, ...] of the layers before or None
                                                                           -> (o [B, T, H, V] in proj's dtype (the
                                                                               model's first rounding in
                                                                               kda_output_gate), KdaRows [Lk, ...]
                                                                               with layer `layer` written in place)
              with o_norm [V] and eps (kda_verify_epilogue): o is kda_output_gate's [B, T, H*V] in proj's dtype
  kda_commit: rec_state [Lk, B, H, K, V], conv_window [Lk, B, W-1, 3, C], pending (KdaPending [Lk, ...]),
              n_accept [B]                                                 -> (rec_state, conv_window), in place
  kda_decode: q/k/v/f raw [B, 1, C], b_raw [B, 1, H], A_log [H], dt_bias [C], conv weights 3 x [C, 1, W],
              conv_window [B, W-1, 3, C], rec_state [B, H, K, V] f32       -> (o, rec_state, conv_window)
  route:      x [T, D], gate_w [E, D], expert_bias [E], the model config    -> (ids [T, A] int32, weights [T, A] f32),
              or None when the Pallas router does not fit the dims (the caller routes in jnp)
  routed_moe: route's arguments (x: or a layers.linear.Normed of the residual rows [T, D]), the experts (w_gate,
              w_up, w_down), shared, live_rows [B] or None               -> (y [T, D] f32, ids [T, A]) or None
              (residual [..., D]: (residual + y in its dtype, ids); moe_residual_epilogue: the add in the down launch)
              (the router's launch also aligns the experts: moe_router_tables on Triton; moe_router_norm: the
              norm of a Normed in that launch too)
  mla_attention: q_lat [B, T, H, Lr], q_rope [B, T, H, R] (rotated), cache [B, S, Lr + R]
              (or the stacked [L, B, S, Lr + R] read at `layer`), positions [B, T] int32, kv_b [H, P + Vh, Lr],
              q_heads [B, T, H, P + R] unrotated (or None)                -> o [B, T, H, Vh] f32, or None
  mla_context: the same without kv_b                                       -> ctx [B, T, H, Lr], or None
  norm_linear: h a layers.linear.Normed of x [B, T, D] (or of a tuple of inputs), projections of weights
              [*N_s, D] (swiglu: (gate, up) [F, D])                        -> (y_s [B, T, *N_s], ...) or None
  linear_residual: o [B, T, K], w [N, K], residual [B, T, N]             -> [B, T, N], or None
  mtp_input:  tokens int32[B, T], embed [V, D], hidden [B, T, D], enorm / hnorm [D], eh_proj [N, 2D]
                                                                           -> [B, T, N], or None
  head_argmax: h a layers.linear.Normed of x [..., D] (the final norm), w the lm_head [V, D]
                                                                           -> (tokens int32[...], normed [..., D])
                                                                              or None
  allreduce_residual_norm (per device, inside shard_map over `axis`): partial [T, D] f32/bf16, residual [T, D],
              norm weight [D]                                              -> (residual [T, D], normed [T, D])
  (None: the kernel does not take the call; the caller runs the model's jnp form)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ling_jax.layers.linear import Normed
from ling_jax.layers.moe import moe_experts, shared_expert
from ling_jax.layers.norms import add_rms_norm
from ling_jax import quant
from ling_jax.quant import Fp8Weight, dense
from pallas_kernels import allreduce as _allreduce
from pallas_kernels import kda_decode as _kda_decode
from pallas_kernels import fused_linear as _fused_linear
from pallas_kernels import fused_linear_fp8 as _fused_linear_fp8
from pallas_kernels import kda_verify as _kda_verify
from pallas_kernels import lm_head_argmax_triton as _lm_head_argmax
from pallas_kernels import mla_attention as _mla_attention
from pallas_kernels import mla_triton as _mla_triton
from pallas_kernels import mtp_input_triton as _mtp_input
from pallas_kernels import norm_linear_triton as _norm_linear_triton
from pallas_kernels import moe as _moe_triton
from pallas_kernels import moe_mosaic as _moe_mosaic
from pallas_kernels import moe_fp8_tables as _moe_fp8_tables
from pallas_kernels import moe_mosaic_fp8 as _moe_mosaic_fp8
from pallas_kernels import router as _router
from pallas_kernels import router_segments as _router_segments

CHOICES = ("auto", "pallas", "reference", "interpret")
MOE_IMPLS = ("auto", "mosaic", "triton")
MOE_FP8_SCHEMES = ("weight", "partial", "partial-bits")  # the weight-only forms (w8a8: Numerics.fp8_activations)
FP8_LINEAR_SCALES = ("partial", "weight")  # the weight-only forms of fused_linear_fp8 (e4m3: the same)
KDA_EPILOGUE_MAX_HEAD = 64  # the widest V whose whole-head verify program keeps its [K, V] f32 state in registers
# Largest W_uk (H x P x Lr, all heads of a device) the Triton MLA attend programs absorb q_nope with: each reads all
# of it (from L2) and runs H masked [BM, P] x [P, Lr] dots, instead of XLA's q_lat einsum kernel (and at T > 1 the
# q_nope / W_uk slices feeding its gemm). The v2 demo's 5 x 64 x 128 x 2 B = 80 KiB; Ling's 32 x 128 x 512 x 2 B
# = 4 MiB stays in XLA.
MLA_ABSORB_MAX_BYTES = 128 * 1024


@dataclass(frozen=True)
class KernelCalls:
    """Which kernel serves each op, and the calls themselves.

    interpret: run the kernels in the Pallas interpreter with tiles that fit any small test shape (CPU tests of
      the wiring).
    moe_impl: "auto" (Mosaic GPU for bf16/f16 at T <= 64 whenever its tiles divide the dims: 1.0-1.2x faster than
      Triton on H200, bench/results/kernels-h200-2026-11-30-run4.json; Triton otherwise), "mosaic" or "triton".
    Decode / verify KDA runs the kda_verify + kda_commit kernels (the output epilogue in XLA): each layer's verify
      reads the fused projection, conv_w and its layer of the stacked states in place and writes its rows into one
      stack, and ONE kda_commit call then advances every layer's state and conv window in place, in decode as in
      NEXTN's commit: no XLA slice, scatter or copy around them.
    kda_verify_epilogue: the verify kernel also runs the KDA output epilogue (the model's
      kda_output_gate: RMSNorm over V, o_norm, sigmoid of the out-gate stream) and hands o_proj its [B, T, H*V]
      input, instead of R(o) and 2-3 small XLA kernels of norm + gate per KDA layer pass (~1.1-1.8 us each on the
      GPU census). Only where a head fits one program (V <= KDA_EPILOGUE_MAX_HEAD = 64, the v2 demo's 64; see
      `kda_epilogue_in_verify`): the norm needs a head's whole row, so that variant runs one program per head with
      the whole [K, V] f32 state in registers: at the demo's 64 x 64 (2 warps) it costs what the tiled verify does
      at T = 1 and 6 in the SASS model, at Ling's 128 x 128 it spills at T = 6 and models ~3.5 us slower (and the
      one-program-per-head kda_chain kernel measured 4x slower there; pallas_kernels/kda_verify.py's docstring);
      wider heads keep the XLA epilogue.
      Same rounding points as the XLA epilogue (o in the activation dtype, then f32); the row sum's order is the
      kernel's. On by default on the GPU since 2026-12-07 (GPU_DEFAULTS; A/B: bench_step
      --baseline-set kda_verify_epilogue=0; bench/kernels_kda.py --only epilogue).
    kda_fused_decode: decode (T = 1) runs one fused KDA kernel (conv + delta rule + state update in place) instead
      of verify + commit. Off by default: its output uses S^T(e q) + u (k.q) for S'^T q, equal in exact arithmetic
      but not bitwise equal to the verify kernel's row, and plain greedy must match NEXTN's.
    mla_live_prefix: decode/verify MLA attention through pallas_kernels/mla_attention.py (reads the live prefix
      only). Off by default: on H200 it beats XLA's attention over every slot at a live length of 1024 (28 vs
      34 us at T = 1, 25 vs 46 us at T = 6) but loses at 8192 with T >= 6 (53 vs 46 us at T = 6, 114 vs 56 us at
      T = 17; bench/results/kernels-head-mla-h200-2026-12-01.json): its blocks are re-read per 128-column slice.
    mla_triton: decode/verify MLA attention AND its W_uv output product through pallas_kernels/mla_triton.py
      (Triton, split-K over the live prefix: an attend launch over the live key blocks and a combine launch that
      also applies W_uv per head), the layer's `mla_attention`; it serves the call before mla_live_prefix would.
      It takes any heads, widths (powers of 2 or not: masked tiles) and slot counts, the cache in bf16 / f16 /
      f32 and the stacked cache in place: no XLA concatenate, slice or copy around it, so the attention of an MLA
      layer pass is 2 launches instead of XLA's ~10 over every allocated slot (the scores gemm, max / sum
      reductions, converts, the PV gemm and its split-K reduce, W_uv's reduce, the layer's slice of the stack).
      Rounding: p in the cache dtype before P @ latent, normalised at the end (the model rounds the normalised
      probabilities), ctx in the cache dtype before W_uv as in the model. Batch-invariant (fixed tiles and split
      partition, splits summed in order): a row's output does not depend on T or the other rows. On by default on
      the GPU since 2026-12-07 (GPU_DEFAULTS). Measured on one H100 (2026-12-07, demo, on top of GPU_DEFAULTS, 8 steps a dispatch, same run): plain 224.0 -> 210.9 us,
      NEXTN5 575.0 -> 571.3 us (step-ling-demo-kdaverify-mlat-mlat-ab-h10080gbhbm3x1-2026-12-07.json); the layer's
      attention alone 13.2 vs 15.2 us (T = 1, live 4096) and 10.5 / 15.3 vs 22.7 us (T = 6, live 512 / 4096)
      (kernels-mla-triton-demo-nvidia-h100-80gb-hbm3-2026-12-07.json).
    moe_router_tables: where the Triton MoE serves a decode / verify call (T <= router_segments.MAX_TOKENS = 32),
      the router is ONE launch that also emits the MoE's alignment tables (pallas_kernels.router_segments ->
      moe.moe_segments): router, up, down, and the shared expert's XLA fusions where its width is not I (the v2
      demo: 192 vs 64), instead of router scores, router top-k and the XLA alignment (key add, sort, gather,
      scatter-add, stack and copies between them). Same ids, weights, tables and products as that chain
      (tests/test_kernels_router_segments.py: bitwise in the interpreter). On by default on the GPU since 2026-12-02: on the
      H200 the demo model's greedy tokens are identical with and without it (bench/gate_step.py, 4 prompts x 256
      tokens, plain and NEXTN5, accept length 5.005 both), and its steps (8 steps per dispatch, so GPU-bound) take
      264.5 vs 278.1 us (plain) and 713.6 vs 790.2 us (NEXTN5), 18.6 vs 24.5 kernels per plain layer pass
      (bench/results/step-ling-demo-*-2026-12-02.json, gate-h200-2026-12-02-log.txt).
    moe_router_norm: with moe_router_tables serving the call, the MoE layer's input RMSNorm (the post-attention
      norm) in the router's program (router_segments.route_segments with its norm weight: one sum per row, the
      model's rounding points; its xn output is what the up kernel and the shared expert read) where it takes
      it (router_segments.takes_norm: the gate one score tile, E == 16 as the v2 demo; wider gates norm in XLA):
      the norm's XLA reduce and multiply fusions go (2 kernels per MoE pass; 1 if XLA had fused the residual add
      into the reduce). In the interpreter: the kernel's xn equals rms_norm's bitwise (bf16 x), and the demo's
      logits equal those with the XLA norm bitwise where XLA keeps the program's bf16 roundings
      (xla_allow_excess_precision=False; by default XLA may norm the unrounded f32 residual sum where the kernel
      reads the bf16 stream: tests/test_kernels_router_norm.py). On the GPU the row sum's order is Triton's,
      not XLA's (as the router's matvec already is), so tokens may differ from the XLA norm's at near-ties;
      plain and NEXTN run the same kernel. Off: on the H200 (2026-12-02) it compiles, the gate passes (same
      tokens as the XLA norm on 3 prompts x 256, plain and NEXTN5, accept 4.806 both) and the kernels per layer
      pass fall 18.6 -> 17.5 (plain) and 25.1 -> 24.3 (NEXTN5), but the steps do not get faster (8 steps per
      dispatch: plain 265.5 vs 262.1 us, NEXTN5 730.1 vs 730.1 us): router_segments grows from 7.3 to 9.2 us a
      call, as much as the two kernels it removes (bench/results/step-ling-demo-kdaverify-rnorm-ms8-rn-*.json,
      gate-h200-2026-12-02-router-norm.json). The router's own latency (7-9 us for a 16 x 320 matvec, its
      top-k and tables) is what to cut next. On by default on the GPU since 2026-12-07 (GPU_DEFAULTS).
    moe_router_scatter: with moe_router_tables serving the call, router_segments runs its "scatter" program
      (RouterConfig.segments; router_segments._scatter_kernel: every K tile loaded at once, the selection's
      max-then-lowest-index pairs as one argmax each, the tables' prefix counts as cumsums and the tables
      stored where they go, the rows past the product cut to T's power of 2) instead of its per pair column
      one-hot sums: the same outputs bit for bit (tests/test_kernels_router_segments.py, _norm.py: in the
      interpreter; bench/kernels_moe_router_tables.py checks and times the two on the GPU). On by default on the GPU since
      2026-12-03: on the H200 its outputs are bitwise equal to onehot's at T = 1 and 6, token 0 gives the same
      result alone and in a batch, and it takes 3.0-3.5 us against onehot's 7.1-9.3
      (kernels-moe-router-tables-h200-2026-12-03.json); the gate (bench/gate_step.py, 4 prompts x 256 greedy
      tokens, bf16) gives the same plain tokens as onehot on 4/4, NEXTN5 accept 5.029 both, rerun after
      sampling unchanged (gate-scatter-h200-2026-12-03.json).
      The H200 (2026-12-02): 8.5 -> 3.0 us at T = 6, bitwise equal; at T = 1 not (the weights' normalising sum was a
      reduce over a [1, AP] tile there vs onehot's [16, AP], associated by each tile's lane layout). Every router
      program now adds the picks' columns left to right (router.normalised_weights, the model's topk_weight_sum
      order; tests/test_kernels_router_invariance.py): off until the GPU shows T = 1 equal too.
    moe_shared_segments: a shared expert whose width Is is a multiple n > 1 of the routed width I (the v2 demo:
      192 = 3 x 64) runs inside the Triton MoE kernels as n chunks of the shared segment (pallas_kernels/moe.py:
      n - 1 more up / down programs over the shared slot's rows, the columns [c I, (c + 1) I) of its weights,
      the chunks' fp32 products added in the combine) instead of through the model's shared_expert in XLA (its
      gate / up / down dots and SwiGLU: 2-3 XLA kernels per MoE layer pass on the GPU; at T = 6 the two
      gemm_fusion kernels of ~2.9 us each in the 2026-12-02 census). Both the router-tables chain (routed_moe)
      and `moe`. Its numerics are the kernels' (g, u, silu(g) and the shared product kept in fp32 where the model
      rounds them to bf16: a bf16 rounding apart, as the width-I shared segment always was). On by default on the GPU since
      2026-12-07 (GPU_DEFAULTS; A/B: bench_step --baseline-set moe_shared_segments=0).
    moe_residual_epilogue: where the router-tables chain serves a MoE call (routed_moe: Triton, T <= 32) with its
      shared expert inside the kernels (width I, or moe_shared_segments), the layer's residual add in the down
      launch's epilogue (pallas_kernels/moe.py moe_segments(residual=...), `moe_down_residual`: the fused combine,
      one program per column tile of all T rows, so each output element is written, and the residual added, once)
      instead of v1's moe_down + XLA's combine-and-add fusion (the `loop_add_fusion` of every KDA / MLA + MoE pass
      in the 2026-12-07 offline census). The model's rounding points (the MoE sum to the activation dtype, then the
      stream's add); the fp32 sum over the slots in the combine's order (ascending expert, then the shared chunks),
      not v1's: an fp32 rounding apart before the bf16 round, batch invariant. One device only
      (ShardedKernelCalls: the MoE's partial sums are all-reduced before the add). Off until timed on the GPU
      (bench_step --moe-residual-epilogue --baseline-set moe_residual_epilogue=0): the combine walks the slots
      serially in each of D / 16 programs where v1 runs one program per slot and tile. Measured SLOWER on one H100
      (2026-12-07, demo, on top of GPU_DEFAULTS, same run): plain 226.3 -> 247.8 us, NEXTN5 579.3 -> 690.1 us
      (step-ling-demo-kdaverify-mre-mre-ab-h10080gbhbm3x1-2026-12-07.json): the serial walk costs more than the
      add launch it removes. Stays off.
    moe_n_tokens: the Mosaic MoE's token columns N (16, 32 or a multiple of 64; a call with more tokens uses
      64, and Triton above that). Every weight tile is multiplied with an [N, BK] x tile, so N = 64 at T = 1 streams
      as many activation bytes through SMEM as the up kernel's weight rows (and the down kernel's h' tiles
      equal its weight tiles): 16 is the T = 1 / T <= 16 candidate, A/B on the GPU before it is the default.
    moe_tiles: the Mosaic MoE's tiles (a moe_mosaic.MosaicMoeConfig; its n_tokens is replaced by the columns
      above), None for the kernel's defaults: the bench's A/B of grids (bench/kernels_moe_layer.py).
    fused_linear: the projections of a layer pass through pallas_kernels/fused_linear.py (Mosaic GPU): every
      projection of one normed input in ONE kernel (the RMSNorm in its prologue, epilogues linear / sigmoid /
      SwiGLU: KDA's w_qkvfg | b_proj, MLA's q | kv_a | g_proj and q_b, the dense MLP's gate | up, the MTP's
      eh_proj over [enorm | hnorm]), and the output projections (KDA o_proj, MLA dense, dense down_proj) with the
      residual add in the epilogue, for bf16 weights. bf16 activations; block-fp8 weights (quant.Fp8Weight) run
      the fp8 form of the kernel (pallas_kernels/fused_linear_fp8.py: e4m3 tiles + block scales, see
      fp8_linear_scale) under fused_linear_fp8; a call mixing both kinds runs one kernel per group (two reads of
      x) when both fields are on, else the jnp. A call the kernel does
      not take (fp32, widths or rows past its limits, e.g. prefill chunks whose x does not fit its SMEM, fp8
      weights [S, C, D] with C not a multiple of 128) runs the jnp.
      Tiles: block_k 128 where every input width is a multiple of 128 (Ling: D = 2560, o_proj K = 4096), else 64
      (see _linear_config). The v2 demo (models/ling-demo: D = 320 = 5 x 64, H = 5, dense width 960) runs EVERY
      projection fused at block_k 64: KDA w_qkvfg [5, 320, 320] | b_proj [5] (padded to 8 rows), MLA q [480]
      (padded to 512) | kv_a [160] (to 192) | g_proj [5] (to 8), the dense gate | up [960], the MTP eh_proj over
      [enorm | hnorm] (320 + 320), and the output projections KDA o_proj, MLA dense (320 -> 320) and the dense
      down_proj (960 -> 320) with the residual: 18 kernel calls per plain step, 33 per NEXTN5 step (pinned by
      tests/test_fused_linear_wired.py, lowered for CUDA).
      Off by default: the kernel alone beats XLA's norm + einsum for KDA's and MLA's input projections at T <= 6
      on the H200 (29.6 vs 31.5 us, 15.5 vs 19.0 us) but not for the dense MLP, o_proj + residual (10.2 vs 8.2 us)
      or T = 17 (bench/results/kernels-fused-linear-h200-2026-12-01-persistent.json), and the wired step was not
      yet run on the GPU (bench_step --baseline-fused-linear is the A/B, bench.check_gpu_wiring the check).
    norm_linear_triton: the projections of one normed input at T <= norm_linear_triton.MAX_ROWS = 17 rows (decode and
      verify) with bf16 weights, activations and norm weight, weights of at most MAX_WEIGHT_BYTES = 8 MiB a call
      (past it XLA streams the weights faster: 2.4x at Ling's w_qkvfg on the H100, so on Ling this is XLA's), through
      pallas_kernels/norm_linear_triton.py (Triton): the RMSNorm recomputed in every program and every projection in ONE launch, odd widths by masks (no XLA
      pad / slice), before the Mosaic kernel of fused_linear. Where fused_linear's XLA path is a reduce kernel
      plus a matvec fusion per projection (the demo's KDA pass: RMS sum, b_proj, w_qkvfg), this is one kernel.
      One input only (the MTP's [enorm | hnorm] goes on to fused_linear / the jnp), one device only (as
      fused_linear). Same rounding points as the model's jnp; the norm's sum and the K order are the kernel's
      (fixed: batch invariant). On by default on the GPU since 2026-12-07 (GPU_DEFAULTS).
    linear_residual_triton: the output projections with the residual add (KDA o_proj, MLA dense, the dense
      down_proj) at T <= 17 rows, bf16, weights <= 8 MiB (MAX_WEIGHT_BYTES), through the same module's
      linear_residual_small: one launch in place of XLA's matvec + add (or fused_linear's Mosaic kernel, which it goes before). One device only; on by default since
      2026-12-07 (GPU_DEFAULTS).
    mtp_input_triton: the MTP layer's input projection eh_proj([enorm(embed(tok)) | hnorm(h)]) at T <= 17 rows,
      bf16 (every NEXTN draft pass and the extend) through pallas_kernels/mtp_input_triton.py: the embedding rows
      gathered in the kernel, both RMSNorms and eh_proj in one launch, where XLA runs a reduce per norm and the dot
      fusion (3 launches a draft pass, 4 in the extend). eh_proj of at most MAX_WEIGHT_BYTES = 8 MiB (as
      norm_linear_triton, whose tiles rule it runs: Ling's 26 MB eh_proj stays XLA's). Same rounding points as the
      model's jnp (each norm's sum and the K order the kernel's: batch invariant). One device only; off: with
      lm_head_argmax the demo's steps got slower on the H100 (see lm_head_argmax; this one was not timed alone).
    lm_head_argmax: the greedy token of a pass whose program needs no logits (a greedy step without logprobs
      serving requests that do not adjust their logits: the steps' static adjusts_logits=False, see
      ling_jax/spec.py) through pallas_kernels/lm_head_argmax_triton.py: the final RMSNorm, the lm_head over
      vocabulary tiles and each tile's (max, first index) in one Triton launch, the tiles' reduction in a second,
      and no [T, V] logits: plain decode's and verify's target head, each NEXTN draft's and the extend's MTP head
      (the normed rows come back from the kernel too: the MTP chain and the extend read them). T <= 17 rows; x,
      norm weight and lm_head (or a draft vocabulary's rows) all bf16 or all fp32 (an fp8 lm_head keeps the
      logits path); one device only (the lm_head is vocabulary-sharded under TP). Tie-break and NaN as
      jnp.argmax; the norm's sum and the K order are the kernel's (fixed: batch invariant). Off: measured slower
      on one H100 (2026-12-07). The head alone: demo 7.7 / 8.5 / 11.2 us vs XLA's 6.1 / 7.6 / 8.2 us at
      T = 1 / 6 / 17, Ling's 151k vocabulary 309 vs 273 us at T = 1
      (kernels-lm-head-argmax-nvidia-h100-80gb-hbm3-2026-12-07.json). With mtp_input_triton, on top of
      GPU_DEFAULTS: plain 209.4 -> 213.7 us, NEXTN5 576.1 -> 585.6 us
      (step-ling-demo-kdaverify-lha-mit-mlat-head-ab-h10080gbhbm3x1-2026-12-07.json). Fewer launches, slower ones.
    p2p_allreduce: with TP > 1, the all-reduce at a layer boundary (psum of the partial sums, the residual add,
      the next RMSNorm) runs as ONE peer-to-peer Mosaic GPU kernel (pallas_kernels/allreduce.py: remote stores
      + semaphores, fixed device order) instead of XLA's psum (NCCL: 18-19 us per small dependent all-reduce on
      two H200s) and two more kernels. Wired at the MoE boundaries (ShardedKernelCalls.moe_residual_norm: the
      MoE's partial sums + the residual add + the next layer's input norm, or the final norm; the next block reads
      that normed input); the attention's all-reduces after o_proj stay XLA's. Off by default (psum) until bench/kernels_allreduce.py has measured it on
      nvidia-h200-x2; no interpret mode (the CPU interpreter has no GMEM semaphores).
    fused_linear_fp8: block-fp8 weights' projections (quant.Fp8Weight) through pallas_kernels/fused_linear_fp8.py
      whatever fused_linear says (the bf16 weights' kernel): the jnp path dequantises every fp8 weight to bf16 in
      HBM on every step (XLA keeps no dequantised copy: 63 us a KDA layer at Ling size), so the fp8 kernel is the
      default. Full Ling-3.0-flash in fp8 on one H200 (bench/results/step-kdaverify-fp8-fl-h200x1-2026-12-02.json,
      same run): plain 8800 -> 6555 us, NEXTN5 16220 -> 14154 us. One device only, as fused_linear.
    moe_fp8_scheme: what each pipeline step of the fp8-weight Mosaic MoE (moe_mosaic_fp8) does with its e4m3
      tile (moe_mosaic.MosaicMoeConfig's fp8 fields over moe_tiles) where the activations stay bf16
      (Numerics.fp8_activations "none"): "weight" (dequantise bf16(f32(w8) * s), bf16 wgmma: the model's
      dequantised weight), "partial" (convert only, s times each step's fp32 partial: the exact block product) or
      "partial-bits" (the same with the convert in integer ops, no PTX cvt). Under Numerics.fp8_activations
      "dynamic" (the layers pass fp8_activations=True) the kernel runs its w8a8 form whatever this field says: x
      quantised per token and 128 columns by quant.quantize_activations, e4m3 x e4m3 wgmma, h quantised the same
      way in the up kernel (the model's MoE with fp8 activations, moe_experts(fp8_activations=True); block_i 128,
      so moe_tiles must have block_i 128; moe_fp8_n_tokens 16 or 32 suit it: four [128, N] fp32 accumulators per
      thread group). It is the only fp8 form the interpreter runs (SMEM operands). A call it does not take runs
      the model's jnp MoE with the same quantisation (moe_experts), never the bf16 kernels (they would not
      quantise h). "w8a8" as this field's value is an error: that choice is the numerics'.
      "partial-bits" by default, the fastest form the H200 timed (bench/results/kernels-moe-fp8-h200-2026-12-03-
      partial.json, with moe_fp8_n_tokens 16: T = 1 / 6 / 17: 40.2 / 131.6 / 316.0 us; "weight" 197 us at T = 6),
      checked there against its block-product reference and batch-invariant (token 0 alone == token 0 in the batch).
      Its numerics are the exact block product (fp32 s * (w8 . x)), not the jnp path's bf16(w8 * s) weight: within
      bf16 tolerance of it, not bitwise. Full Ling-3.0-flash fp8 on one H200, same run
      (step-kdaverify-fp8-moepartial-bits-fp8n16-h200x1-2026-12-03.json): plain 6546 -> 6054 us, NEXTN5 14157 -> 11468.
    moe_fp8_n_tokens: the fp8 Mosaic MoE's token columns (as moe_n_tokens; None: moe_n_tokens); 16 (default) takes
      T <= 16 and 32 up to T = 32 (bench/kernels_moe_fp8.py's forms), 64 above that.
    moe_fp8_split_k: the fp8 Mosaic MoE's down-GEMM split of I (MosaicMoeConfig.split_k) where block_kd x it divides
      I, else the tiles' own (None: always the tiles'). 6 by default: the down grid is D / 64 x split_k CTAs, 120 at
      split_k 3, one a SM converting and waiting step after step; 240 put two on a SM. H200 2026-12-03
      (kernels-moe-fp8-h200-2026-12-03-ks6-w8a8.json, same run): T = 6 131.9 -> 119.9 us, T = 1 40.3 -> 38.2 us,
      checked and batch-invariant (T = 17 not timed). The partials are summed in a fixed order as before.
    moe_fp8_tables: where the fp8 Mosaic MoE serves a call of T <= moe_fp8_tables.MAX_TOKENS = 32 rows (decode and
      verify), its per-call operands come from ONE Triton launch (pallas_kernels/moe_fp8_tables.py align_tables:
      the dedupe of the P expert ids into slots, meta and the routing weights wc, both scale tables and x padded
      to N rows, every program recomputing the alignment by counting) instead of moe_mosaic_fp8.align's XLA chain
      (_align's compare / reduce fusions, the tables' gathers and concatenates, the pads: 10-12 launches per call
      with the two kernels and the split-K sum in the deviceless H200 compile of tests/test_kernels_moe_fp8_tables.py,
      4 with it). The offline census of the full fp8 model on one H200 (2026-12-08, this field alone flipped):
      plain 877 -> 637 launches a step, NEXTN5 1240 -> 765 (census-offline-ling3-flash-h200-mft[-off]-2026-12-08.json;
      XLA also rematerialises the chain's fusions under the model's memory pressure, so more go than 8 a call). The
      same arrays bit for bit (integer counts, copies, and wc's sums of one (token, expert) pair's weights), so the
      MoE's output is unchanged (tests: bitwise in the interpreter, the w8a8 form, the one it runs). Both weight-only
      and w8a8 forms (x or its e4m3 x8 padded; w8a8's x scales keep their XLA pad). Off until timed on the GPU
      (bench_step --moe-fp8-tables --baseline-set moe_fp8_tables=0; bench/kernels_moe_fp8.py's " tables" variant).
    fp8_linear_scale: where the fp8 kernel applies the block scale while the activations stay bf16
      (Numerics.fp8_activations "none"): "partial" (on each K step's fp32 partial: the exact block product, one
      wgmma wait per step) or "weight" (on the weight before its bf16 rounding: the model's quant.dense weight, one
      wgmma group in flight); H200 2026-12-02: both 0.28-0.33 of the ceiling (KDA 44 us, bf16 kernel 32 us).
      Under Numerics.fp8_activations "dynamic" the kernel runs its "e4m3" form whatever this field says: the
      activations quantised per token and 128 columns in the kernel's prologue (as quant.quantize_activations),
      both wgmma operands e4m3, the scales promoted per step (no per-element work on the weights). A call the e4m3
      kernel does not take (block_k 64 widths, x too large to keep resident, e.g. o_proj K = 4096 at T = 17) runs
      the model's jnp with the same quantisation (layers.linear). "e4m3" as this field's value is an error: that
      choice is the numerics'. bench/kernels_fused_linear_fp8.py is the kernel A/B, bench_step --fp8-activations
      the step's.
    """

    interpret: bool = False
    moe_impl: str = "auto"
    kda_verify_epilogue: bool = False
    kda_fused_decode: bool = False
    mla_live_prefix: bool = False
    mla_triton: bool = False
    moe_router_tables: bool = True
    moe_router_norm: bool = False
    moe_router_scatter: bool = True
    moe_shared_segments: bool = False
    moe_residual_epilogue: bool = False
    moe_n_tokens: int = 64
    moe_tiles: _moe_mosaic.MosaicMoeConfig | None = None
    fused_linear: bool = False
    norm_linear_triton: bool = False
    linear_residual_triton: bool = False
    lm_head_argmax: bool = False
    mtp_input_triton: bool = False
    fused_linear_fp8: bool = True
    p2p_allreduce: bool = False
    fp8_linear_scale: str = "partial"
    moe_fp8_scheme: str = "partial-bits"
    moe_fp8_n_tokens: int | None = 16
    moe_fp8_split_k: int | None = 6
    moe_fp8_tables: bool = False

    def __post_init__(self):
        if self.p2p_allreduce and self.interpret:
            raise ValueError("p2p_allreduce=True with interpret=True: the Mosaic GPU interpreter runs no GMEM "
                             "semaphores or remote refs (the kernel's math is tested through allreduce.combine)")
        numerics = ("quantises the activations: a numerics choice, made by Numerics(fp8_activations='dynamic') "
                    "(bench_step / generate: --fp8-activations dynamic), which runs the kernel's activation-quantised "
                    "form and the model's jnp with the same quantisation where the kernel does not take a call")
        if self.fp8_linear_scale == "e4m3":
            raise ValueError(f"fp8_linear_scale='e4m3' {numerics}; this field picks among {FP8_LINEAR_SCALES}")
        if self.fp8_linear_scale not in FP8_LINEAR_SCALES:
            raise ValueError(f"fp8_linear_scale={self.fp8_linear_scale!r} not in {FP8_LINEAR_SCALES}")
        if self.moe_fp8_scheme == "w8a8":
            raise ValueError(f"moe_fp8_scheme='w8a8' {numerics}; this field picks among {MOE_FP8_SCHEMES}")
        if self.moe_tiles is not None and (self.interpret or self.moe_tiles.interpret):
            raise ValueError("moe_tiles with interpret: the interpreter runs its own test tiles (interpret=True)")
        if self.moe_n_tokens not in (16, 32) and (self.moe_n_tokens <= 0 or self.moe_n_tokens % 64):
            raise ValueError(f"moe_n_tokens={self.moe_n_tokens} must be 16, 32 or a multiple of 64")
        if self.moe_fp8_n_tokens is not None and self.moe_fp8_n_tokens not in (16, 32) and (
                self.moe_fp8_n_tokens <= 0 or self.moe_fp8_n_tokens % 64):
            raise ValueError(f"moe_fp8_n_tokens={self.moe_fp8_n_tokens} must be 16, 32 or a multiple of 64")
        if self.moe_fp8_split_k is not None and self.moe_fp8_split_k < 1:
            raise ValueError(f"moe_fp8_split_k={self.moe_fp8_split_k} must be >= 1 (or None)")
        if self.moe_fp8_scheme not in MOE_FP8_SCHEMES:
            raise ValueError(f"moe_fp8_scheme={self.moe_fp8_scheme!r} not in {MOE_FP8_SCHEMES}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl={self.moe_impl!r} not in {MOE_IMPLS}")

    # ---- choices -------------------------------------------------------------------------------------------

    def moe_kernel(self, x, w_gate) -> str:
        """"mosaic" (Hopper TMA + wgmma; bf16/f16, T <= 64, tiles dividing the dims) or "triton"."""
        _, i, d = w_gate.shape
        if self.interpret:  # the Triton interpreter takes any small tile; Mosaic's need D, I multiples of 64
            if self.moe_impl != "mosaic":
                return "triton"
            if i % 64 or d % 64:
                raise ValueError(f"moe_impl='mosaic' with interpret=True: the Mosaic interpreter's test tiles need "
                                 f"D={d} and I={i} multiples of 64")
            return "mosaic"
        if self.moe_impl != "auto":
            return self.moe_impl
        try:
            self._mosaic_moe_config(x.shape[0], w_gate).check(x.shape[0], d, i)
        except ValueError:
            return "triton"
        return "mosaic" if x.dtype in (jnp.bfloat16, jnp.float16) else "triton"

    def _mosaic_moe_config(self, t: int, w_gate, n_tokens: int | None = None):
        """n_tokens (None: moe_n_tokens) columns where T fits them (16 that T does not fit: 32 if it fits), else the
        64 of before (T > 64 fails its check: Triton); the kernel's default tiles, or (interpret) the largest of
        128 / 64 that divide the dims, 2-deep pipelines."""
        n_tokens = self.moe_n_tokens if n_tokens is None else n_tokens
        n = n_tokens if t <= n_tokens else (32 if n_tokens == 16 and t <= 32 else 64)
        if not self.interpret:
            return dataclasses.replace(self.moe_tiles or _moe_mosaic.MosaicMoeConfig(), n_tokens=n)
        _, i, d = w_gate.shape
        fit = lambda dim: 128 if dim % 128 == 0 else 64
        return _moe_mosaic.MosaicMoeConfig(block_i=fit(i), block_k=fit(d), block_d=fit(d), block_kd=64,
                                           split_k=2 if i % 128 == 0 else 1, up_stages=2, down_stages=2,
                                           n_tokens=n, interpret=True)

    # Tiles are picked from the shapes the kernel actually sees (a subclass's per-device slice): the kernels'
    # defaults where they divide the dims (full-size Ling), else the largest power of two that does (small
    # models, e.g. ling-demo's expert width 96), so any preset runs on the GPU too.
    def _triton_moe_config(self, w_gate):
        _, i, d = w_gate.shape
        base = _moe_triton.MoeConfig()
        fit = lambda n, cap: max(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= cap and n % b == 0)
        tiles = dict(block_i=fit(i, base.block_i), block_k=fit(d, base.block_k), block_d=fit(d, base.block_d),
                     block_kd=fit(i, base.block_kd))
        return _moe_triton.MoeConfig(**tiles, interpret=self.interpret)

    def _router_config(self, x, e: int, cfg):
        """The Pallas router's tiles for x [T, D] and E experts, or None where it does not apply (non power-of-2
        groups, or no tiling whose score kernel fits the SMEM of a block at this T). The defaults (block_k up to
        256, 4 stages) where they fit (every measured Ling-size decode/verify call); past that (prefill chunks:
        the [T', BK] x tile is pipelined num_stages deep, 4 x 66 KB at the v2 demo's T = 512) fewer stages, then
        narrower K tiles, down to 2 stages of 16 columns."""
        t, d = x.shape
        fit = lambda n, cap: max(b for b in (16, 32, 64, 128, 256) if b <= cap and n % b == 0) if n % 16 == 0 else 0
        if not fit(d, 256) or not fit(e, 16):
            return None
        base = _router.RouterConfig(block_e=fit(e, 16), block_k=fit(d, 256), interpret=self.interpret,
                                    segments="scatter" if self.moe_router_scatter else "onehot")
        try:
            base.check(d, e, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        except ValueError:
            return None
        block_ks = [b for b in (256, 128, 64, 32, 16) if b <= base.block_k and d % b == 0]
        for rc in (dataclasses.replace(base, block_k=bk, num_stages=st) for bk in block_ks for st in (4, 3, 2)):
            if rc.scores_smem(t, d, x.dtype.itemsize) <= _router.SMEM_BYTES:
                return rc
        return None

    def kda_epilogue_in_verify(self, v: int) -> bool:
        """Whether the verify kernel takes the output epilogue for heads of value width v (kda_verify_epilogue)."""
        return self.kda_verify_epilogue and v <= KDA_EPILOGUE_MAX_HEAD

    def _kda_config(self):
        return _kda_verify.KdaConfig(block_v=16, interpret=True) if self.interpret else None

    # ---- calls ---------------------------------------------------------------------------------------------

    def route(self, x, gate_w, expert_bias, cfg):
        rc = self._router_config(x, gate_w.shape[0], cfg)
        if rc is None:
            return None
        return _router.route(x, gate_w, expert_bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                             top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
                             norm_topk_prob=cfg.norm_topk_prob, config=rc)

    def routed_moe(self, x, gate_w, expert_bias, cfg, experts, shared, *, limit: float, shared_limit: float,
                   live_rows=None, rows_per_seq: int = 0, fp8_activations: bool = False, residual=None):
        """Router and MoE with the alignment inside the router's launch -> (y [T, D] f32, ids [T, A]), or None
        where no such chain applies (the caller routes and calls `moe`): on the Triton MoE, moe_router_tables
        (T <= its MAX_TOKENS), not where the router tiles do not fit; the Mosaic MoE has none. live_rows int32[B]
        with rows_per_seq = T / B: padding rows borrow routing (as ling_jax.layers.moe.borrow_routing).
        x: the MoE's input rows [T, D], or a layers.linear.Normed of the residual stream [..., D] (one input; T
        its rows): where moe_router_tables serves the call and moe_router_norm (router_segments.takes_norm), the
        router's program computes that RMSNorm and the MoE reads its xn; otherwise the model's norm
        (Normed.value(), then the rows).
        fp8_activations with fp8 weights: None (the chain does not quantise activations: `moe` runs the w8a8
        kernel).
        residual [..., D] or None: return (residual + y rounded to x's dtype, the model's `x + moe(x)`, ids); with
        moe_residual_epilogue the add is the down kernel's epilogue where it takes the call (shared expert in the
        kernels, residual of x's dtype), else the model's add after it."""
        if fp8_activations and _any_fp8(experts, shared):
            return None
        rows = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)  # what the choices read
        rc = self._router_config(rows, gate_w.shape[0], cfg)
        if rc is None:
            return None
        if self._fp8_mosaic(rows, experts, shared) or self.moe_kernel(rows, experts[0]) == "mosaic":
            return None
        if not self.moe_router_tables or rows.shape[0] > _router_segments.MAX_TOKENS:
            return None
        route_kw = dict(n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
                        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
                        rows_per_seq=rows_per_seq if live_rows is not None else 0, config=rc)
        # The Triton chain of `moe`, its alignment in the router's launch: the same kernels on the same tables
        w_gate, w_up, w_down = (dense(w, rows.dtype) for w in experts)
        dense_shared = None if shared is None else tuple(dense(w, rows.dtype) for w in shared)
        in_kernel = dense_shared is not None and self._shared_in_triton(dense_shared, w_gate)
        fold_norm = (self.moe_router_norm and isinstance(x, Normed) and len(x.parts) == 1
                     and _router_segments.takes_norm(*rows.shape, gate_w.shape[0], rc))
        if fold_norm:  # the post-attention RMSNorm in the router's program: its xn is the MoE's input
            r = _router_segments.route_segments(x.x.reshape(rows.shape), gate_w, expert_bias, live_rows, x.weight,
                                                eps=x.eps, has_shared=in_kernel, **route_kw)
            xn = r.xn
        else:
            xn = _normed(x, rows.shape)
            r = _router_segments.route_segments(xn, gate_w, expert_bias, live_rows, has_shared=in_kernel, **route_kw)
        # the residual add in the down kernel's epilogue
        fold = (residual is not None and self.moe_residual_epilogue and (shared is None or in_kernel)
                and residual.dtype == rows.dtype and rows.shape[0] <= _moe_triton.RESIDUAL_MAX_TOKENS)
        y = _moe_triton.moe_segments(xn, r.order, r.seg, r.tok, r.w_rows, w_gate, w_up, w_down, limit=limit,
                                     shared=dense_shared if in_kernel else None, shared_limit=shared_limit,
                                     residual=residual.reshape(rows.shape) if fold else None,
                                     config=self._triton_moe_config(w_gate))
        if fold:
            return y.reshape(residual.shape), r.ids
        y = y.astype(jnp.float32)
        if shared is not None and not in_kernel:  # as `moe`: a shared width other than I through the model
            y = y + shared_expert(xn, shared, shared_limit)
        if residual is not None:  # the model's add (moe_layer's rounding, then `x + y`)
            return residual + y.astype(rows.dtype).reshape(residual.shape), r.ids
        return y, r.ids

    def _shared_in_triton(self, shared, w_gate) -> bool:
        """Whether the Triton MoE kernels run this shared expert: its width is the routed width I, or (with
        moe_shared_segments) a multiple of it, as chunks of the shared segment."""
        width, i = shared[0].shape[0], w_gate.shape[1]
        return width == i or (self.moe_shared_segments and width % i == 0)

    def _fp8_mosaic(self, x, experts, shared, fp8_activations: bool = False) -> bool:
        """Whether the fp8-weight Mosaic kernel serves this call: every weight block fp8, the bf16 Mosaic kernel's
        tiles fit (moe_kernel) and so do the form's (fp8_activations: w8a8, block_i 128; else moe_fp8_scheme's),
        and the shared expert rides as slot P (its width equals I). In the interpreter only the w8a8 form (the
        weight-only forms keep their converted tiles in registers, which it does not run), with its test tiles."""
        weights = list(experts) + list(shared or ())
        if (self.interpret and not fp8_activations) or not all(isinstance(w, Fp8Weight) for w in weights):
            return False
        if shared is not None and shared[0].shape[0] != experts[0].shape[1]:
            return False
        _, i, d = experts[0].shape
        cfg = self._fp8_moe_config(x.shape[0], experts[0], fp8_activations)  # (its own errors are the user's)
        try:
            cfg.check(x.shape[0], d, i)
        except ValueError:
            return False
        if self.interpret:
            return self.moe_impl != "triton"
        return self.moe_kernel(x, experts[0]) == "mosaic"

    def _fp8_moe_config(self, t: int, w_gate, fp8_activations: bool = False):
        """The fp8 Mosaic MoE's config: the Mosaic tiles (moe_tiles, moe_fp8_n_tokens or moe_n_tokens,
        moe_fp8_split_k where it divides I) with the form's fields: w8a8 with fp8_activations, else
        moe_fp8_scheme's."""
        if fp8_activations and self.moe_tiles is not None and self.moe_tiles.block_i != 128:
            raise ValueError(f"fp8 activations (the w8a8 MoE) quantise h per 128 rows of I in one CTA: "
                             f"moe_tiles.block_i={self.moe_tiles.block_i} must be 128")
        cfg = self._mosaic_moe_config(t, w_gate, self.moe_fp8_n_tokens)
        ks = self.moe_fp8_split_k
        if ks is not None and w_gate is not None and w_gate.shape[1] % (cfg.block_kd * ks) == 0:
            cfg = dataclasses.replace(cfg, split_k=ks)
        # partial / partial-bits keep the converted tile in registers (fp8_operand="registers": the form the GPU
        # A/B timed, bench/kernels_moe_fp8.py); the interpreter never runs those (_fp8_mosaic). w8a8 reads both
        # operands from SMEM (the interpreter runs it).
        if fp8_activations:
            return dataclasses.replace(cfg, fp8_activations=True, block_i=128, fp8_operand="smem",
                                       fp8_scale_on="weight", fp8_convert="cvt")
        fields = dict(weight={}, partial=dict(fp8_scale_on="partial", fp8_operand="registers"),
                      **{"partial-bits": dict(fp8_scale_on="partial", fp8_convert="bits", fp8_operand="registers")})
        return dataclasses.replace(cfg, **fields[self.moe_fp8_scheme])

    def moe(self, x, ids, weights, w_gate, w_up, w_down, *, limit: float, shared, shared_limit: float,
            fp8_activations: bool = False):
        """fp8 weights (quant.Fp8Weight): the fp8 Mosaic kernel where it applies, else the bf16 kernels on the
        weights dequantised to x.dtype (interpret mode, widths its tiles cannot take). A shared expert whose
        width is not the routed width I (the kernels run it as one more segment of width I): the routed experts
        in the kernel, the shared expert through the model's shared_expert, one fp32 sum (as moe_experts).
        fp8_activations (Numerics.fp8_activations "dynamic"): fp8 weights run the kernel's w8a8 form, and a call
        it does not take runs the model's moe_experts with the same quantisation (not the bf16 kernels)."""
        # (e.g. under EP: each device's experts are full width, its slice of the shared expert is not)
        chunked = (shared is not None and shared[0].shape[0] != w_gate.shape[1] and not fp8_activations
                   and not _any_fp8((w_gate, w_up, w_down), shared) and self.moe_kernel(x, w_gate) == "triton"
                   and self._shared_in_triton(shared, w_gate))  # moe_shared_segments: its chunks in the kernels
        if shared is not None and shared[0].shape[0] != w_gate.shape[1] and not chunked:
            routed = self._moe_kernels(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=None,
                                       shared_limit=0.0, fp8_activations=fp8_activations)
            return routed + shared_expert(x, shared, shared_limit, fp8_activations=fp8_activations)
        return self._moe_kernels(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared,
                                 shared_limit=shared_limit, fp8_activations=fp8_activations)

    def _moe_kernels(self, x, ids, weights, w_gate, w_up, w_down, *, limit: float, shared, shared_limit: float,
                     fp8_activations: bool = False):
        """The kernel call itself (the shared expert, if any, of width I)."""
        if self._fp8_mosaic(x, (w_gate, w_up, w_down), shared, fp8_activations):
            cfg = self._fp8_moe_config(x.shape[0], w_gate, fp8_activations)
            xq = tuple(quant.quantize_activations(x)) if cfg.fp8_activations else x
            aligned = None
            if self.moe_fp8_tables and x.shape[0] <= _moe_fp8_tables.MAX_TOKENS:  # one launch, not XLA's chain
                scales = lambda ws: tuple(w.scale_inv for w in ws)
                aligned = _moe_fp8_tables.align_tables(xq[0] if cfg.fp8_activations else xq, ids, weights,
                                                       *scales((w_gate, w_up, w_down)),
                                                       None if shared is None else scales(shared),
                                                       cfg=cfg, i=w_gate.shape[1])
            out = _moe_mosaic_fp8.moe_fp8(xq, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared,
                                          shared_limit=shared_limit, config=cfg, aligned=aligned)
            return out.astype(jnp.float32)
        if fp8_activations and _any_fp8((w_gate, w_up, w_down), shared):  # the same numerics, in jnp
            return moe_experts(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared,
                               shared_limit=shared_limit, fp8_activations=True)
        w_gate, w_up, w_down = (dense(w, x.dtype) for w in (w_gate, w_up, w_down))
        shared = None if shared is None else tuple(dense(w, x.dtype) for w in shared)
        if self.moe_kernel(x, w_gate) == "mosaic":
            out = _moe_mosaic.moe(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared,
                                  shared_limit=shared_limit, config=self._mosaic_moe_config(x.shape[0], w_gate))
        else:
            out = _moe_triton.moe(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared,
                                  shared_limit=shared_limit, config=self._triton_moe_config(w_gate))
        return out.astype(jnp.float32)

    def kda_verify(self, proj, b_raw, A_log, dt_bias, conv_w, conv_window, rec_state, layer, pending=None, *,
                   lower_bound: float, o_norm=None, eps: float = 1e-6):
        return _kda_verify.kda_verify(proj, b_raw, A_log, dt_bias, conv_w, conv_window, rec_state, layer, pending,
                                      lower_bound=lower_bound, o_norm=o_norm, eps=eps, config=self._kda_config())

    def kda_commit(self, rec_state, conv_window, pending, n_accept):
        return _kda_verify.kda_commit(rec_state, conv_window, pending, n_accept, config=self._kda_config())

    def kda_decode(self, q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
                   conv_window, rec_state, *, lower_bound: float):
        B, Wm1 = conv_window.shape[:2]
        o, state, window = _kda_decode.kda_decode(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w,
                                                  k_conv_w, v_conv_w, conv_window.reshape(B, Wm1, -1), rec_state,
                                                  lower_bound=lower_bound, config=self._kda_config())
        return o, state, window.reshape(conv_window.shape)

    def mla_context(self, q_lat, q_rope, cache, positions, *, scale: float, layer: int | None = None):
        """Absorbed MLA context over the live prefix (Mosaic GPU), or None where the kernel does not take the
        shapes (fp32, slots not a multiple of its block, small latent widths): the caller runs the jnp form.
        cache [B, S, F] or the stacked [L, B, S, F] read at `layer` in place."""
        cfg = self._mla_config(q_lat, q_rope, cache)
        if cfg is None:
            return None
        return _mla_attention.mla_attention(q_lat, q_rope, cache, positions, scale=scale, config=cfg, layer=layer)

    def mla_attention(self, q_lat, q_rope, cache, positions, kv_b, *, v_head_dim: int, scale: float,
                      layer: int | None = None, q_heads=None, rope_theta: float | None = None, gate=None,
                      out_dtype=None):
        """Absorbed MLA attention with its W_uv product over the live prefix (Triton, mla_triton), or None where
        the field is off or the operands do not fit it: the caller tries mla_context, then the jnp form.
        kv_b: the layer's kv_b_proj as [H, P + Vh, Lr] (W_uk | W_uv rows per head); cache [B, S, F] or the
        stacked [L, B, S, F] read at `layer` in place -> o [B, T, H, Vh] f32 (attend_absorbed's).
        q_heads (with rope_theta): the unrotated heads [B, T, H, P + R]: the kernel rotates their rope columns
        (q_rope is then unused), and absorbs q_nope @ W_uk itself (q_lat unused too) where W_uk is at most
        MLA_ABSORB_MAX_BYTES. gate [B, T, H] f32 (the block's head gate): the output is then
        layers.mla.gated_heads(o, gate, out_dtype), applied in the kernel's combine (no XLA launch for it).
        """
        cfg = self._mla_triton_config(q_lat, q_rope, cache, kv_b)
        if cfg is None:
            return None
        kw = dict(scale=scale, v_head_dim=v_head_dim, config=cfg, layer=layer, out_dtype=out_dtype)
        if q_heads is None:
            return _mla_triton.mla_triton(q_lat, q_rope, cache, positions, kv_b, gate, **kw)
        p = kv_b.shape[1] - v_head_dim
        absorb = kv_b.shape[0] * p * kv_b.shape[2] * kv_b.dtype.itemsize <= MLA_ABSORB_MAX_BYTES
        return _mla_triton.mla_triton(q_heads if absorb else q_lat, q_heads, cache, positions, kv_b, gate,
                                      absorb_q=absorb, rope_theta=rope_theta, rope_offset=p, **kw)

    def _mla_triton_config(self, q_lat, q_rope, cache, kv_b):
        """The Triton MLA kernel's tiles for these operands, or None (field off, a dtype it does not read).
        Splits of 256 slots (64 x 4) at every width; fixed per dims, never by T. The demo's 128-wide latent: 3
        pipeline stages ([64, 128] bf16 = 16 KB a stage). Ling's 512: 2 stages ([64, 576] = 74 KB a stage), the
        best of 9 tilings on an H100 (bench.kernels_mla_triton --only ling-flash, 2026-12-07: T=1 19.6 / 23.4 /
        29.8 us at live 512 / 4096 / 8192, T=6 23.2 / 35.6 / 57.9, against XLA's 25.1-25.5 and 45.1-45.3 at every
        live length, and the earlier 32 x 8 tiles' 21.2 / 24.3 / 29.0 and 25.8 / 37.6 / 63.3). Past ~5000 live
        slots XLA is faster; averaged over the live lengths of a cache the kernel still wins, so no bound: smaller
        splits help short prefixes (T=1, live 512: 15.0 us at 64 slots a split) and cost long ones twice (51 us
        at 8192: the combine reads 128 fp32 partials of 512 columns a row)."""
        floats = (jnp.bfloat16, jnp.float16, jnp.float32)
        if not self.mla_triton or any(a.dtype not in floats for a in (q_lat, q_rope, cache, kv_b)):
            return None
        lr = q_lat.shape[-1]
        return _mla_triton.MlaTritonConfig(num_stages=3 if lr <= 256 else 2, interpret=self.interpret)

    def _mla_config(self, q_lat, q_rope, cache):
        """The MLA kernel's config for these operands, or None where it does not apply (mla_live_prefix off,
        a dtype or shape it does not take)."""
        if not self.mla_live_prefix:
            return None
        cfg = _mla_attention.MlaAttentionConfig(interpret=self.interpret)
        if len({q_lat.dtype, q_rope.dtype, cache.dtype}) != 1 or cache.dtype not in (jnp.bfloat16, jnp.float16):
            return None
        try:
            cfg.check(q_lat.shape[-1], q_rope.shape[-1], cache.shape[-2])
        except ValueError:
            return None
        return cfg

    def _linear_config(self, k_parts: tuple[int, ...]):
        """The fused projections' tiles for inputs of reduction widths k_parts (the kernel tiles each input
        separately, so block_k must divide every part): block_k 128 (the kernel's default; 256 measured a little
        faster for KDA's and MLA's input projections at T <= 6 on the H200, 29.6 vs 32.7 us) where every part is a
        multiple of 128 and the sum holds two such slots, 64 otherwise (small models: the v2 demo's D = 320 =
        5 x 64, and its MTP eh_proj over [enorm | hnorm] of 320 + 320). Widths that are no multiple of 64 get 64
        too: the kernel rejects them (ValueError) and the caller runs the jnp."""
        fits_128 = all(k % 128 == 0 for k in k_parts) and sum(k_parts) >= 256
        return _fused_linear.LinearConfig(block_k=128 if fits_128 else 64, interpret=self.interpret)

    def norm_linear(self, h, projections, *, fp8_activations: bool = False):
        """epilogue_s(RMSNorm(x) @ W_s^T) for every projection in one fused kernel (see layers.linear), or None.
        Weights with several output axes ([S, C, D]) are read as [S*C, D] (a free reshape); output widths the
        kernel's TMA store cannot tile (e.g. b_proj / g_proj of H = 4 heads, kv_a of 160 rows in small models)
        are zero-padded rows of the weight (an XLA pad, only where the width does not fit) and sliced off.
        fp8 weights go to the fp8 kernel, bf16 ones to the bf16 kernel (one launch per kind present).
        fp8_activations: the fp8 kernel in its "e4m3" form (else fp8_linear_scale's); None where it does not take
        the call, and the layer's jnp then quantises those inputs itself.
        norm_linear_triton: bf16 calls of one input at T <= 17 rows go to the Triton kernel first."""
        if self.norm_linear_triton:
            got = self._norm_linear_small(h, projections)
            if got is not None:
                return got
        xs, norm_ws = zip(*h.parts)
        weights = [w for p in projections for w in (p.weight if p.kind == "swiglu" else (p.weight,))]
        # bf16 throughout (a norm weight of another dtype would promote rms_norm's output: not the kernel's math)
        has_fp8 = any(isinstance(w, Fp8Weight) for w in weights)
        has_bf16 = not all(isinstance(w, Fp8Weight) for w in weights)
        if ((has_fp8 and not self.fused_linear_fp8) or (has_bf16 and not self.fused_linear)
                or any(a.dtype != jnp.bfloat16 for a in xs + norm_ws)
                or any(not isinstance(w, Fp8Weight) and w.dtype != jnp.bfloat16 for w in weights)):
            return None
        lead = xs[0].shape[:-1]
        flat = tuple(x.reshape(-1, x.shape[-1]) for x in xs)                     # [B*T, D_i]
        is_fp8 = [isinstance(p.weight if p.kind != "swiglu" else p.weight[0], Fp8Weight) for p in projections]
        outs = [None] * len(projections)
        for fp8 in (False, True):
            group = [j for j, f in enumerate(is_fp8) if f == fp8]
            if not group:
                continue
            got = self._norm_linear_group(flat, norm_ws, h.eps, [projections[j] for j in group], fp8,
                                          fp8_activations)
            if got is None:
                return None
            for j, o in zip(group, got):
                outs[j] = o.reshape(lead + o.shape[1:])
        return tuple(outs)

    def _norm_linear_small(self, h, projections):
        """The Triton norm + projections (pallas_kernels/norm_linear_triton.py) for one bf16 input of at most
        MAX_ROWS rows and bf16 weights -> (y_s [B, T, *N_s], ...), or None where it does not take the call."""
        if len(h.parts) != 1:
            return None
        ((x, norm_w),) = h.parts
        weights = [w for p in projections for w in (p.weight if p.kind == "swiglu" else (p.weight,))]
        rows = math.prod(x.shape[:-1])
        if (rows > _norm_linear_triton.MAX_ROWS or x.dtype != jnp.bfloat16 or norm_w.dtype != jnp.bfloat16
                or any(isinstance(w, Fp8Weight) or w.dtype != jnp.bfloat16 for w in weights)
                or sum(w.size * w.dtype.itemsize for w in weights) > _norm_linear_triton.MAX_WEIGHT_BYTES):
            return None
        flat_w = lambda w: w.reshape(-1, w.shape[-1])                          # [*N, D] -> [N, D]: free
        args = tuple(tuple(map(flat_w, p.weight)) if p.kind == "swiglu" else flat_w(p.weight) for p in projections)
        projs = tuple(_fused_linear.Proj(p.kind, limit=p.limit) for p in projections)
        cfg = _norm_linear_triton.NormLinearConfig(interpret=self.interpret)
        outs = _norm_linear_triton.norm_linear_small(x.reshape(rows, x.shape[-1]), norm_w, args, projs=projs,
                                                     eps=h.eps, config=cfg)
        lead = x.shape[:-1]
        return tuple(o.reshape(lead + _first(p).shape[:-1]) for o, p in zip(outs, projections))

    def _norm_linear_group(self, flat, norm_ws, eps, projections, fp8: bool, fp8_activations: bool = False):
        """One fused kernel over projections whose weights are all bf16 (fp8=False) or all quant.Fp8Weight ->
        [B*T, *N_s] outputs, or None where the kernel does not take the call."""
        args, projs, widths = [], [], []
        for p in projections:
            proj = _fused_linear.Proj(p.kind, limit=p.limit)
            ws = p.weight if p.kind == "swiglu" else (p.weight,)
            n_out = ws[0].shape[:-1]
            rows = _store_rows(math.prod(n_out), proj.out_dtype)
            ws = tuple((_fp8_rows if fp8 else _bf16_rows)(w, rows) for w in ws)
            if any(w is None for w in ws):
                return None
            args.append(ws if p.kind == "swiglu" else ws[0])
            projs.append(proj)
            widths.append((math.prod(n_out), n_out))
        x = flat if len(flat) > 1 else flat[0]
        nw = norm_ws if len(flat) > 1 else norm_ws[0]
        cfg = self._linear_config(tuple(a.shape[-1] for a in flat))
        try:
            if fp8:
                outs = _fused_linear_fp8.norm_linear_fp8(x, nw, tuple(args), projs=tuple(projs), eps=eps, config=cfg,
                                                         scale_on=self._fp8_scale_on(fp8_activations))
            else:
                outs = _fused_linear.norm_linear(x, nw, tuple(args), projs=tuple(projs), eps=eps, config=cfg)
        except ValueError:  # past the kernel's limits (its message says which): the jnp form serves the call
            return None
        return [o[:, :n].reshape((-1,) + n_out) for o, (n, n_out) in zip(outs, widths)]

    def _fp8_scale_on(self, fp8_activations: bool) -> str:
        """fused_linear_fp8's form: "e4m3" (activations quantised) where the numerics say so, else the field's."""
        return "e4m3" if fp8_activations else self.fp8_linear_scale

    def linear_residual(self, o, w, residual, *, fp8_activations: bool = False):
        """residual + o @ w^T in one kernel (the residual add in the projection's epilogue), or None.
        w: bf16 [N, K] or a quant.Fp8Weight (the fp8 kernel; "e4m3" with fp8_activations)."""
        fp8 = isinstance(w, Fp8Weight)
        if self.linear_residual_triton:
            got = self._linear_residual_small(o, w, residual)
            if got is not None:
                return got
        if (not (self.fused_linear_fp8 if fp8 else self.fused_linear)
                or any(a.dtype != jnp.bfloat16 for a in (o, residual))
                or (not fp8 and w.dtype != jnp.bfloat16)):
            return None
        lead, n = o.shape[:-1], w.shape[0]
        args = (o.reshape(-1, o.shape[-1]), w, residual.reshape(-1, n))
        cfg = self._linear_config((o.shape[-1],))
        try:
            if fp8:
                out = _fused_linear_fp8.linear_residual_fp8(*args, config=cfg,
                                                            scale_on=self._fp8_scale_on(fp8_activations))
            else:
                out = _fused_linear.linear_residual(*args, config=cfg)
        except ValueError:
            return None
        return out.reshape(lead + (n,))

    def _linear_residual_small(self, o, w, residual):
        """residual + o @ w^T through the Triton kernel (pallas_kernels/norm_linear_triton.py) for bf16 o, w and
        residual of at most MAX_ROWS rows, or None."""
        rows = math.prod(o.shape[:-1])
        if (rows > _norm_linear_triton.MAX_ROWS or isinstance(w, Fp8Weight)
                or any(a.dtype != jnp.bfloat16 for a in (o, w, residual))
                or w.size * w.dtype.itemsize > _norm_linear_triton.MAX_WEIGHT_BYTES):
            return None
        cfg = _norm_linear_triton.NormLinearConfig(interpret=self.interpret)
        out = _norm_linear_triton.linear_residual_small(o.reshape(rows, o.shape[-1]), w,
                                                        residual.reshape(rows, w.shape[0]), config=cfg)
        return out.reshape(residual.shape)

    def mtp_input(self, tokens, embed, hidden, enorm, hnorm, w, *, eps: float):
        """eh_proj([rms_norm(embed[tokens], enorm) | rms_norm(hidden, hnorm)]) in one kernel (mtp_input_triton;
        pallas_kernels/mtp_input_triton.py) -> [B, T, N], or None where it does not take the call: the field off,
        more than MAX_ROWS rows, anything not bf16 (an fp8 eh_proj included), an eh_proj past
        norm_linear_triton.MAX_WEIGHT_BYTES (the same tiles rule: past it XLA streams the weight faster)."""
        rows = math.prod(tokens.shape)
        if (not self.mtp_input_triton or rows > _mtp_input.MAX_ROWS or isinstance(w, Fp8Weight)
                or any(a.dtype != jnp.bfloat16 for a in (embed, hidden, enorm, hnorm, w))
                or w.size * w.dtype.itemsize > _norm_linear_triton.MAX_WEIGHT_BYTES):
            return None
        cfg = _mtp_input.NormLinearConfig(interpret=self.interpret)
        y = _mtp_input.mtp_input_small(tokens.reshape(rows), embed, hidden.reshape(rows, -1), enorm, hnorm, w,
                                       eps=eps, config=cfg)
        return y.reshape(tokens.shape + (w.shape[0],))

    def head_argmax(self, h, w):
        """argmax_v (RMSNorm(h) @ w^T) per row without the logits (lm_head_argmax; pallas_kernels/
        lm_head_argmax_triton.py) -> (tokens int32[...], the normed rows [..., D]), or None where it does not take
        the call: the field off, h not a one-input Normed, more than MAX_ROWS rows, an fp8 lm_head, dtypes other
        than all bf16 or all fp32 (lm_logits would promote: not the kernel's math)."""
        if not self.lm_head_argmax or not isinstance(h, Normed) or len(h.parts) != 1 or isinstance(w, Fp8Weight):
            return None
        ((x, norm_w),) = h.parts
        rows = math.prod(x.shape[:-1])
        if (rows > _lm_head_argmax.MAX_ROWS or x.dtype not in (jnp.bfloat16, jnp.float32)
                or norm_w.dtype != x.dtype or w.dtype != x.dtype):
            return None
        cfg = _lm_head_argmax.HeadArgmaxConfig(interpret=self.interpret)
        tokens, normed = _lm_head_argmax.head_argmax(x.reshape(rows, x.shape[-1]), norm_w, w, eps=h.eps, config=cfg)
        return tokens.reshape(x.shape[:-1]), normed.reshape(x.shape)

    def allreduce_residual_norm(self, partial, residual, weight, *, eps: float, axis: str):
        """The layer boundary under TP, per device (call inside shard_map over mesh axis `axis`): y = the sum
        of every device's partial [T, D], x = residual + y rounded to the stream's dtype (the model's `x + y`),
        and the next block's rms_norm(x) -> (x, normed), equal on every device. p2p_allreduce: one
        peer-to-peer kernel where it takes the shapes; otherwise (the default) psum and the model's jnp."""
        if self.p2p_allreduce and jax.lax.axis_size(axis) > 1 and _allreduce.takes(partial, residual, weight):
            return _allreduce.allreduce_residual_norm(partial, residual, weight, eps=eps, axis=axis)
        return add_rms_norm(residual, jax.lax.psum(partial, axis), weight, eps)

    @property
    def fuses_layer_boundary(self) -> bool:
        """Whether the model hands a MoE layer's residual add and the RMSNorm after it (the next layer's input
        norm, or the final norm) to `moe_residual_norm`, and the next block reads that normed input. One device
        has no all-reduce to fuse them with: False (the model's program is as without it). The sharded calls
        (compile.sharding.ShardedKernelCalls) say p2p_allreduce: the all-reduce of the MoE's partial sums, the
        add and the norm become one `allreduce_residual_norm`."""
        return False

    def moe_residual_norm(self, x, ids, weights, w_gate, w_up, w_down, *, limit: float, shared, shared_limit: float,
                          residual, norm_weight, eps: float, fp8_activations: bool = False):
        """The MoE layer and the layer boundary after it -> (residual + moe(...) rounded to the stream's dtype,
        rms_norm of that with norm_weight). Here (one device) the MoE kernel, then the model's add and norm."""
        y = self.moe(x, ids, weights, w_gate, w_up, w_down, limit=limit, shared=shared, shared_limit=shared_limit,
                     fp8_activations=fp8_activations)
        return add_rms_norm(residual, y, norm_weight, eps)


def _any_fp8(experts, shared) -> bool:
    """Whether any routed or shared expert weight is block fp8."""
    return any(isinstance(w, Fp8Weight) for w in (*experts, *(shared or ())))


def _first(proj):
    """A projection's weight (swiglu: its gate; the output's shape is its leading axes)."""
    return proj.weight[0] if proj.kind == "swiglu" else proj.weight


def _normed(x, shape):
    """The rows [T, D] a Normed stands for (the model's RMSNorm in XLA, then the rows), or x itself."""
    return x.value().reshape(shape) if isinstance(x, Normed) else x


def _bf16_rows(w, rows: int):
    """A bf16 weight [*N, D] as [rows, D]: flattened, zero rows appended where the store needs them."""
    w = w.reshape(-1, w.shape[-1])
    return jnp.pad(w, ((0, rows - w.shape[0]), (0, 0)))  # no-op pad where it fits


def _fp8_rows(w: Fp8Weight, rows: int):
    """An Fp8Weight [*N, D] as the (w8 [rows, D], scale [ceil(rows/128), nD]) pair the fp8 kernel reads, or None
    where flattening breaks the blocks (leading axes over a C that is not a multiple of 128)."""
    *lead, c, d = w.w8.shape
    if lead and math.prod(lead) > 1 and c % quant.BLOCK:
        return None
    w8 = w.w8.reshape(-1, d)
    s = w.scale_inv.reshape(-1, w.scale_inv.shape[-1])
    w8 = jnp.pad(w8, ((0, rows - w8.shape[0]), (0, 0)))
    s = jnp.pad(s, ((0, -(-rows // quant.BLOCK) - s.shape[0]), (0, 0)))
    return w8, s


def _store_rows(n: int, dtype) -> int:
    """The output width fused_linear's TMA store tiles (its docstring's limit): bf16 N <= 64 in multiples of 8,
    else a multiple of 64; f32 a multiple of 8."""
    if jnp.dtype(dtype) == jnp.float32 or n <= 64:
        return -(-n // 8) * 8
    return -(-n // 64) * 64


# The kernels measured faster on the GPU than KernelCalls' field defaults (which stay each kernel's baseline, the
# configuration the interpret-mode tests and the A/Bs start from). kernel_calls("auto" / "pallas") applies them
# under the caller's fields. Since 2026-12-07, the five kernel-count fields: on one H100 together they take the
# demo's plain step 251.3 -> 235.1 us and NEXTN5 665.8 -> 610.3 us (8 steps per dispatch; offline census 147 -> 97
# and 324 -> 229 launches), and bench/gate_step.py (8 prompts x 256 greedy tokens, bf16) gives NEXTN == plain on
# 7/8 prompts as the old defaults do; the tokens that change are near-ties (prompt 4's first decoded token: top-2
# logit margin 0.027; the old defaults' NEXTN diff at prompt 0, token 24: margin 0.012)
# (bench/results/step-ling-demo-*-five-ab-h10080gbhbm3x1-2026-12-07.json, gate-five-h100-2026-12-07.json).
# mla_triton since 2026-12-07 (H100, on top of the five): plain 224.0 -> 210.9 us, NEXTN5 575.0 -> 571.3 us, census
# 97 -> 82 / 229 -> 182; the gate: NEXTN == plain 7/8 (as the defaults), accept 4.973 vs 4.976, rerun after sampling
# unchanged, its plain tokens differ from the defaults' on 1/8 prompts (gate-mlat-head-h100-2026-12-07.json).
# At Ling's MLA dims the kernel alone (one H100, kernels-mla-triton-ling-tiles-*-2026-12-07.json): 0.78-1.94x XLA's
# time, faster up to ~5000 live slots, slower at 8192 (T=1 29.8 vs 25.5 us, T=6 57.9 vs 45.3); the full-model step
# with it is not yet timed.
GPU_DEFAULTS = dict(kda_verify_epilogue=True, moe_router_norm=True, moe_shared_segments=True,
                    norm_linear_triton=True, linear_residual_triton=True, mla_triton=True)


def kernel_calls(choice: str = "auto", **fields) -> KernelCalls | None:
    """The KernelCalls for a user-facing choice: "auto" (Pallas when the default backend is a GPU, else the jnp
    model), "pallas", "reference" (None: the jnp model everywhere) or "interpret" (Pallas in the interpreter).
    fields: KernelCalls fields (moe_impl, kda_fused_decode, ...); on "auto" / "pallas" they go over GPU_DEFAULTS,
    on "interpret" over KernelCalls' own defaults."""
    if choice not in CHOICES:
        raise ValueError(f"kernels={choice!r} not in {CHOICES}")
    if choice == "auto":
        choice = "pallas" if jax.default_backend() == "gpu" else "reference"
    if choice == "reference":
        return None
    if choice == "interpret":
        return KernelCalls(interpret=True, **fields)
    return KernelCalls(**{**GPU_DEFAULTS, **fields})
