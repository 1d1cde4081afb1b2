"""Norm + projection and projection + residual with block-fp8 weights and bf16 activations: fused_linear's
persistent kernel with a weight ring of e4m3 tiles (half the bytes) and their 128 x 128 block scales.

Shape legend (as fused_linear): T rows, TP wgmma N, K reduction width, KB = K / BK steps, N_s rows of
projection s, BN x BK weight tile, G CTAs, M = ceil(tiles / G) tiles per CTA at most, nK = ceil(K / 128)
scale columns (padded to a multiple of 32: every row of the SMEM scale table is a TMA destination, and TMA writes
only to 128-byte aligned shared memory; 16-byte rows ran into CUDA_ERROR_MISALIGNED_ADDRESS on the H200), nw = 2 for "swiglu" (gate, up), else 1.

Weights in the DeepSeek-V3 block layout (ling_jax.quant.Fp8Weight is one (w8, scale_inv) pair):
  w8 [N_s, K] float8_e4m3fn, s [ceil(N_s / 128), ceil(K / 128)] f32,   W = W8 * s per 128 x 128 block.
Math per tile (BN | 128 rows: one scale row block rb) and K step k (BK | 128 columns: one scale column k BK / 128):
  p_k = bf16(W8 tile) @ xn_k^T                 [BN, TP] fp32 (wgmma; e4m3 -> bf16 is exact)
  acc = sum_k s[rb, k BK / 128] * p_k          fp32: the scale multiplies the partial, not the weight
so acc = xn @ (f32(W8) * s)^T: the dequantised math in fp32 (tests: <= 1e-5 against the model's projection on
weights dequantised to f32). The model's bf16 jnp path (quant.dense: W rounded to bf16 before the einsum) differs
from it by that rounding (~1e-3 relative). The epilogues, the output stores, the norm prologue, streamed x, the
persistent grid and the ring order are fused_linear's; only the ring's element type and the K step differ.

Kernel plan (what fused_linear's plan adds):
  1. with the first R weight loads, each CTA TMAs the scale rows of its (up to M) tiles into SMEM [M nw, nK]
     (one 1-row box per weight of the tile; barrier m counts the tile's nw copies);
  2. K step k: wait the slot(s), dequantise each fp8 tile into a bf16 SMEM tile [nw, BN, BK] (registers:
     load, convert, store), commit; wgmma into fresh accumulators p_i; read them (waits for this step's
     wgmma); acc_i += s * p_i in registers; refill the slot(s) R loads ahead (after the wgmma read the streamed
     x chunk of the slot; the weight bytes were already in registers).
Why the scale on the partial: the dequantise is one convert per weight (no multiply), and the result is the exact
block product. Why not e4m3 wgmma: Hopper's fp8 wgmma takes fp8 for both operands, so xn would be quantised (an
activation error the bf16 model does not make) and its per-row scale would be one more prologue pass; the MMAs
are tiny at T <= 24 and the bytes are the cost.
Not pipelined yet: each step waits for its own wgmma before the next step's dequantise (the ring keeps R loads in
flight meanwhile); double-buffered partials would overlap the wgmma with the next convert.
Batch invariance: fused_linear's (row t uses only row t, one fixed K order, no split-K).
Limits (besides fused_linear's): BN and BK in {64, 128} (a tile or step inside one scale block).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import fused_linear as fl

FP8 = jnp.float8_e4m3fn
SCALE_BLOCK = 128
SCALE_ALIGN = 32  # f32 scale columns per SMEM row: 128 bytes, the alignment of a TMA destination in SMEM


SCALE_ON = ("partial", "weight")


@dataclasses.dataclass(frozen=True)
class Fp8Ring:
  """The fp8 pieces of fused_linear's kernel (its plan holds one): SMEM for the dequantised tiles and the scale
  rows, the scale-row loads, the K loop. scale_cols: nK padded to SCALE_ALIGN; scale_on: see Fp8Config."""
  scale_cols: int
  scale_on: str = "partial"
  weight_dtype = FP8

  def _buffers(self) -> int:
    return 2 if self.scale_on == "weight" else 1     # "weight": step k's tiles are written while k - 1's are read

  def smem_bytes(self, cfg: fl.LinearConfig, tiles_per_cta: int, nw: int) -> int:
    return self._buffers() * nw * cfg.block_n * cfg.block_k * 2 + tiles_per_cta * nw * self.scale_cols * 4

  def scratch(self, plan):
    """SMEM of fused_linear's kernel scope: bf16 tiles [buffers nw, BN, BK], scale rows [M nw, nK], M barriers."""
    nw, m = _nw(plan), pl.cdiv(plan.n_tiles, plan.grid)
    bn, bk = plan.cfg.block_n, plan.cfg.block_k
    return (plgpu.SMEM((self._buffers() * nw, bn, bk), jnp.bfloat16, transforms=fl._swizzled(2, bk)),
            plgpu.SMEM((m * nw, self.scale_cols), jnp.float32),
            plgpu.Barrier(num_arrivals=nw, num_barriers=m))

  def load_scales(self, r):
    """Scale rows of the CTA's m-th tile -> rows m nw .. m nw + nw - 1 (a one-weight tile copies its row nw
    times, so every barrier counts nw arrivals)."""
    scales, _, rows, bars = r.fp8
    plan, nw = r.plan, _nw(r.plan)
    per_proj, at = [], 0
    for p in plan.projs:
      per_proj.append(scales[at:at + p.n_weights])
      at += p.n_weights
    for m in range(pl.cdiv(plan.n_tiles, plan.grid)):
      f = r.tile(m)
      for s, (lo, hi) in enumerate(plan.tiles()):
        def copy(m=m, refs=per_proj[s], lo=lo, f=f):
          row = lax.div((f - lo) * plan.cfg.block_n, jnp.int32(SCALE_BLOCK))
          for i in range(nw):
            plgpu.copy_gmem_to_smem(refs[min(i, len(refs) - 1)].at[pl.ds(row, 1)],
                                    rows.at[pl.ds(m * nw + i, 1)], bars.at[m])
        pl.when((m < r.n_mine) & (f >= lo) & (f < hi))(copy)

  def gemm(self, r, xs, s, m, tile, base):
    """acc_i [BN, TP] over the KB steps of the CTA's m-th tile (projection s, ring loads base ..)."""
    plgpu.barrier_wait(r.fp8[3].at[m])
    return (_gemm_scaled_weight if self.scale_on == "weight" else _gemm_scaled_partial)(r, xs, s, m, tile, base)


def _dequantised(r, slot, scale=None):
  """The fp8 tile of a ring slot as bf16 (times `scale` in f32 first, when given). e4m3 -> bf16 goes through f32:
  the PTX of this toolchain converts e4m3 only to f16 / f32 (Mosaic's message)."""
  w = r.slots.at[slot][...].astype(jnp.float32)
  return (w if scale is None else w * scale).astype(jnp.bfloat16)


def _scale(r, m, i, k):
  """Scale of weight i of the CTA's m-th tile at K step k (its 128-wide scale column)."""
  col = lax.div(k * r.plan.cfg.block_k, jnp.int32(SCALE_BLOCK))
  return r.fp8[2][m * _nw(r.plan) + i, col]


def _gemm_scaled_partial(r, xs, s, m, tile, base):
  """acc_i = sum_k s_i[k] (bf16(W8_i tile) @ xn_k^T): fresh partials per step, scaled in fp32 (exact block math);
  each step waits for its wgmma."""
  dq, plan = r.fp8[1], r.plan
  nw, ring = plan.projs[s].n_weights, plan.ring
  shape = (plan.cfg.block_n, plan.tp)
  pin = lambda v: plgpu.layout_cast(v, plgpu.Layout.WGMMA)

  def step(k, accs):
    slots = [lax.rem(base + k * nw + i, jnp.int32(ring)) for i in range(nw)]
    for i, slot in enumerate(slots):
      plgpu.barrier_wait(r.bars.at[slot])
      dq.at[i][...] = _dequantised(r, slot)
    plgpu.commit_smem()                                               # generic -> async proxy (wgmma)
    x_chunk = (r.x_slots.at[slots[0]] if plan.stream_x else xs.at[k]).transpose((1, 0))

    def mma(*parts):
      for i, part in enumerate(parts):
        plgpu.wgmma(part, dq.at[i], x_chunk)
      return tuple(part[...] for part in parts)                       # waits for this step's wgmma

    parts = pl.run_scoped(mma, *[plgpu.ACC(shape)] * nw)
    fl._refill(r, s, m, tile, base, k)                                # after the wgmma read a streamed x chunk
    return tuple(pin(a + _scale(r, m, i, k) * p) for i, (a, p) in enumerate(zip(accs, parts)))

  return lax.fori_loop(0, plan.kb, step, (pin(jnp.zeros(shape, jnp.float32)),) * nw)


def _gemm_scaled_weight(r, xs, s, m, tile, base):
  """acc_i += bf16(f32(W8_i tile) s_i[k]) @ xn_k^T: the model's dequantised weight (quant.dequantize), one
  accumulator, one wgmma group in flight as fused_linear's bf16 step (the dequantised tiles double-buffered)."""
  dq, plan = r.fp8[1], r.plan
  nw, ring = plan.projs[s].n_weights, plan.ring
  nwb = _nw(plan)

  def scope(*accs):
    def step(k, carry):
      slots = [lax.rem(base + k * nw + i, jnp.int32(ring)) for i in range(nw)]
      half = lax.rem(k, jnp.int32(2)) * nwb
      for i, slot in enumerate(slots):
        plgpu.barrier_wait(r.bars.at[slot])
        dq.at[half + i][...] = _dequantised(r, slot, _scale(r, m, i, k))
      plgpu.commit_smem()
      x_chunk = (r.x_slots.at[slots[0]] if plan.stream_x else xs.at[k]).transpose((1, 0))
      for i, acc in enumerate(accs):
        plgpu.wgmma(acc, dq.at[half + i], x_chunk)
      if plan.defer:
        plgpu.wgmma_wait(1)                                           # step k - 1 retired: its slots, its tiles
        fl._when(k > 0, functools.partial(fl._refill, r, s, m, tile, base, k - 1))
      else:
        plgpu.wgmma_wait(0)
        fl._refill(r, s, m, tile, base, k)
      return carry

    lax.fori_loop(0, plan.kb, step, 0)
    if plan.defer:
      plgpu.wgmma_wait(0)
      fl._refill(r, s, m, tile, base, plan.kb - 1)
    return tuple(a[...] for a in accs)

  return pl.run_scoped(scope, *[plgpu.ACC((plan.cfg.block_n, plan.tp))] * nw)


def _nw(plan) -> int:
  return max(p.n_weights for p in plan.projs)


def _split(weights, projs):
  """weights (one (w8, s) pair per projection, ((w8, s), (w8, s)) for swiglu) -> (w8 per projection in
  fused_linear's form, the flat (w8, s) pairs in weight order)."""
  if len(weights) != len(projs):
    raise ValueError(f"{len(weights)} weights for {len(projs)} projections")
  w8s, flat = [], []
  for p, w in zip(projs, weights):
    pairs = tuple(w) if p.kind == "swiglu" else (w,)
    if len(pairs) != p.n_weights or any(len(q) != 2 for q in pairs):
      raise ValueError(f"{p.kind} takes {p.n_weights} (w8, scale_inv) pair(s)")
    w8s.append(tuple(q[0] for q in pairs) if p.kind == "swiglu" else pairs[0][0])
    flat += [tuple(q) for q in pairs]
  return tuple(w8s), flat


def _fp8_call(xs, norm_ws, residual, weights, projs, eps, cfg, scale_on):
  if scale_on not in SCALE_ON:
    raise ValueError(f"scale_on={scale_on!r} not in {SCALE_ON}")
  for name in ("block_n", "block_k"):
    if SCALE_BLOCK % getattr(cfg, name):
      raise ValueError(f"{name}={getattr(cfg, name)}: fp8 tiles must divide the {SCALE_BLOCK}-wide scale blocks "
                       "(64 or 128)")
  w8s, flat = _split(weights, projs)
  k = sum(x.shape[1] for x in xs)
  n_k = pl.cdiv(k, SCALE_BLOCK)
  cols = -(-n_k // SCALE_ALIGN) * SCALE_ALIGN
  padded = []
  for w8, sc in flat:
    want = (pl.cdiv(w8.shape[0], SCALE_BLOCK), n_k)
    if w8.dtype != FP8 or w8.ndim != 2 or sc.dtype != jnp.float32 or sc.shape != want:
      raise ValueError(f"fp8 weight {w8.shape} {w8.dtype} with scales {sc.shape} {sc.dtype}: expected "
                       f"float8_e4m3fn [N, K={k}] with float32 scales {want} (128 x 128 blocks)")
    padded.append(jnp.pad(sc, ((0, 0), (0, cols - n_k))) if cols != n_k else sc)
  return fl._call(xs, norm_ws, residual, w8s, projs, eps, cfg, fp8=Fp8Ring(cols, scale_on), scales=tuple(padded))


@functools.partial(jax.jit, static_argnames=("projs", "eps", "config", "scale_on"))
def norm_linear_fp8(x, norm_w, weights, *, projs, eps, config=None, scale_on="partial"):
  """fused_linear.norm_linear with block-fp8 weights: each entry of `weights` a (w8 [N_s, K] float8_e4m3fn,
  scale_inv [ceil(N_s/128), ceil(K/128)] f32) pair (or, for "swiglu", a (gate pair, up pair)). x, norm_w,
  projs, eps as norm_linear; returns the same tuple of [T, N_s] outputs.
  scale_on: "partial" (s times each step's fp32 partial: the exact block product) or "weight" (s times the
  weight before its bf16 rounding: the model's quant.dense weight, one wgmma group in flight)."""
  xs, nws = fl.normed_inputs(x, norm_w)
  return _fp8_call(xs, nws, None, weights, projs, eps, config or fl.LinearConfig(), scale_on)


@functools.partial(jax.jit, static_argnames=("config", "scale_on"))
def linear_residual_fp8(x, w, residual, *, config=None, scale_on="partial"):
  """residual + bf16(x @ (W8 * s)^T): x [T, K] bf16, w a (w8 [N, K], scale_inv) pair, residual [T, N] bf16."""
  n = w[0].shape[0]
  if residual.shape != (x.shape[0], n) or residual.dtype != jnp.bfloat16:
    raise ValueError(f"residual {residual.shape} {residual.dtype} must be [T, N] = {(x.shape[0], n)} bf16")
  return _fp8_call((x,), None, residual, (w,), (fl.Proj(),), 0.0, config or fl.LinearConfig(),
                   scale_on)[0]
