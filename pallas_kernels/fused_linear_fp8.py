"""Norm + projection and projection + residual with block-fp8 weights and bf16 activations: fused_linear's
persistent kernel with a weight ring of e4m3 tiles (half the bytes) and their 128 x 128 block scales.

Shape legend (as fused_linear): T rows, TP wgmma N, K reduction width, KB = K / BK steps, N_s rows of
projection s, BN x BK weight tile, G CTAs, M = ceil(tiles / G) tiles per CTA at most, nK = ceil(K / 128)
scale columns, nK' = nK padded to a multiple of 32 (the pitch of the SMEM scale table: every row of it is a TMA
destination, and TMA writes only to 128-byte aligned shared memory; the 80-byte rows of K = 2560 (20 columns)
ran into CUDA_ERROR_MISALIGNED_ADDRESS on the H200; pallas_kernels.tma checks every copy at trace time), nw = 2
for "swiglu" (gate, up), else 1.

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
  1. with the first R weight loads, each CTA TMAs the scale rows of its (up to M) tiles into the SMEM table
     [M nw nK'] (row j at j nK'; one box of the nK scales of the tile's row block per weight, read from the
     checkpoint's [ceil(N_s / 128), nK] array as it is, flattened: no XLA pad of the scales per call, where 4 nK
     bytes are a multiple of 16, a TMA box; barrier m counts the tile's nw copies);
  2. K step k: wait the slot(s), dequantise each fp8 tile into a bf16 SMEM tile [nw, BN, BK] (registers:
     load, convert, store), commit; wgmma into fresh accumulators p_i; read them (waits for this step's
     wgmma); acc_i += s * p_i in registers; refill the slot(s) R loads ahead (after the wgmma read the streamed
     x chunk of the slot; the weight bytes were already in registers).
Why the scale on the partial: the dequantise is one convert per weight (no multiply), and the result is the exact
block product. Measured on the H200 (KDA q|k|v|f|g + b, D = 2560): 44 us, 0.28-0.33 of the HBM ceiling on the fp8
bytes: the per-element convert (e4m3 -> f16 -> f32 -> bf16: this ptxas has no direct e4m3 -> bf16), the SMEM
store + fence of the bf16 tile and the per-step wgmma wait bound it, not the bytes.

scale_on="e4m3": both wgmma operands e4m3 (Hopper's fp8 wgmma takes fp8 for both), no per-element work on the
weight tile. The activations are quantised as quant.quantize_activations does (DeepSeek-V3's act_quant; the
checkpoint's activation_scheme "dynamic"), per row t and 128-column group g of xn:
  s_x[t, g] = amax_g |xn[t, :]| / 448      x8 = e4m3(xn / s_x)      (an all-zero group: s_x = 0, x8 = 0)
  p_k = W8 tile @ x8_k^T                    [BN, TP] fp32 (e4m3 x e4m3 wgmma, BK = 128: step k is group k)
  acc += p_k * (s[rb, k] s_x[:, k])         fp32 (DeepGEMM's promotion: s_x broadcast down the TP columns)
so acc = dequantize_activations(x8, s_x) @ (f32(W8) * s)^T in fp32 (tests: <= 1e-5 against the model's
projection on those activations and weights; the activation rounding itself is ~2 % per element, a numerics
change the bf16 model does not make, so it is a separate switch: KernelCalls.fp8_linear_scale).
  prologue: the norm's second pass (or, for linear_residual, one pass over x) hands each normed chunk^T
     [BK, TP] to `emit_x`: amax down the chunk's columns, s_x, x8 stored to an e4m3 SMEM buffer [KB, TP, BK]
     (128 B swizzle: a K-major wgmma operand, as 8-bit wgmma requires) and s_x to SMEM [KB, TP] f32;
  K step k: wait the slot(s); zero a partial p_i (one of two per weight, alternating); wgmma(p_i, W8 slot,
     x8[k]^T); then wait for step k - 1's wgmma only (its partials, wait_group nw), promote them, refill their
     slots: step k's wgmma runs during step k - 1's promotion and refill (a ring of >= 2 nw slots, else each
     step waits for its own). Per step and weight: one barrier wait, one zeroed partial (BN TP / 128 registers
     per thread), one wgmma (BN / 64 x 4 k32 instructions), one wait_group, BN TP / 128 multiply-adds per thread,
     a scalar (s) and a [TP] (s_x) SMEM load, the refill TMA; nothing per weight element.
x is resident (quantised once per CTA): no stream_x; SMEM adds TP K bytes (x8) + KB TP 4 (s_x).

Not pipelined yet ("partial"): each step waits for its own wgmma before the next step's dequantise (the ring keeps
R loads in flight meanwhile).
Batch invariance: fused_linear's (row t uses only row t, one fixed K order, no split-K); "e4m3" too (s_x[t] is row
t's alone).
Limits (besides fused_linear's): BN and BK in {64, 128} (a tile or step inside one scale block); "e4m3": BK = 128
(one activation group per step), x resident.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import fused_linear as fl
from pallas_kernels import tma

FP8 = jnp.float8_e4m3fn
SCALE_BLOCK = 128
SCALE_ALIGN = tma.SMEM_ALIGN // 4  # f32 scale columns per SMEM row (32): every row a 128-byte aligned TMA destination


SCALE_ON = ("partial", "weight", "e4m3")
E4M3_MAX = float(jnp.finfo(FP8).max)  # 448: s_x = amax / 448 maps a group's largest |x| to e4m3's largest value


COLUMNS = plgpu.Layout.WGMMA.reduce(0)  # a [TP] vector over the columns of a [rows, TP] WGMMA-layout array
CHUNK = plgpu.Layout.WGMMA_TRANSPOSED   # an x chunk^T [BK, TP] loaded through the transposed view of [TP, BK]


def _pin(v, layout=plgpu.Layout.WGMMA):
  """Mosaic's layout inference does not find the layouts of the quantisation and promotion chains alone."""
  return plgpu.layout_cast(v, layout)


class Fp8Refs(NamedTuple):
  """What the fp8 steps read (fused_linear's _Ring.fp8): the scale refs in GMEM (one per weight, flat), the bf16
  dequantised tiles ("partial" / "weight"), the scale table [M nw nK'] and its M barriers, and for "e4m3" the
  quantised activations x8 [KB, TP, BK] e4m3 with their scales s_x [KB, TP] f32."""
  scales: tuple
  tiles: object
  rows: object
  bars: object
  x8: object = None
  sx: object = None


@dataclasses.dataclass(frozen=True)
class Fp8Ring:
  """The fp8 pieces of fused_linear's kernel (its plan holds one): SMEM for the dequantised tiles (or the e4m3
  activations) and the scale rows, the scale-row loads, the activation quantisation, the K loop.
  scale_cols: the SMEM pitch of a scale row, nK padded to SCALE_ALIGN (every row a 128-byte aligned TMA
  destination); src_cols: the length of a row in the flat GMEM scale array the kernel reads ([N/128 * src_cols]
  f32: nK itself, where its 4 nK bytes are a TMA box (a multiple of 16), so the checkpoint's [N/128, nK] array
  is read as it is, with no XLA pad per call; else nK padded to a multiple of 4); by default scale_cols;
  scale_on: see norm_linear_fp8."""
  scale_cols: int
  scale_on: str = "partial"
  src_cols: int | None = None
  weight_dtype = FP8

  @property
  def row_len(self) -> int:
    """f32 scales copied per scale row (the GMEM row's length)."""
    return self.scale_cols if self.src_cols is None else self.src_cols

  @property
  def fp8_activations(self) -> bool:
    """x quantised to e4m3 in the prologue (needs it resident)."""
    return self.scale_on == "e4m3"

  def _buffers(self) -> int:
    return 2 if self.scale_on == "weight" else 1     # "weight": step k's tiles are written while k - 1's are read

  def smem_bytes(self, cfg: fl.LinearConfig, tiles_per_cta: int, nw: int, tp: int, k: int) -> int:
    rows = tiles_per_cta * nw * self.scale_cols * 4
    if self.fp8_activations:                          # x8 [KB, TP, BK] (+ its 1 KB alignment), s_x [KB, TP]
      return tp * k + 1024 + k // cfg.block_k * tp * 4 + rows
    return self._buffers() * nw * cfg.block_n * cfg.block_k * 2 + rows

  def scratch(self, plan):
    """(name, allocation) of the SMEM of fused_linear's kernel scope: bf16 tiles [buffers nw, BN, BK] (or, for
    "e4m3", none), the scale table [M nw nK'] (row j at j nK'), M barriers, and for "e4m3" x8 [KB, TP, BK] e4m3 (swizzled as the
    weight tiles: one wgmma swizzle) and s_x [KB, TP] f32."""
    nw, m = _nw(plan), pl.cdiv(plan.n_tiles, plan.grid)
    bn, bk = plan.cfg.block_n, plan.cfg.block_k
    rows = (("scale rows", plgpu.SMEM((m * nw * self.scale_cols,), jnp.float32)),   # row j at j scale_cols
            ("scale-row barriers", plgpu.Barrier(num_arrivals=nw, num_barriers=m)))
    if self.fp8_activations:
      return rows + (("x8", plgpu.SMEM((plan.kb, plan.tp, bk), FP8, transforms=fl._swizzled(1, bk))),
                     ("s_x", plgpu.SMEM((plan.kb, plan.tp), jnp.float32)))
    return (("dequantised tiles", plgpu.SMEM((self._buffers() * nw, bn, bk), jnp.bfloat16,
                                             transforms=fl._swizzled(2, bk))),) + rows

  def refs(self, scales, *smem) -> Fp8Refs:
    """The scale refs and `scratch`'s SMEM refs, named."""
    return Fp8Refs(scales, None, *smem) if self.fp8_activations else Fp8Refs(scales, *smem)

  def emit_x(self, r):
    """"e4m3": the prologue's sink for each (normed) chunk^T [BK, TP] bf16 of x: quantised per row (one
    128-column group: BK = 128) as quant.quantize_activations, x8 -> x8[kb], s_x -> sx[kb]. Else None (the
    chunk stays bf16 in x's own buffer)."""
    if not self.fp8_activations:
      return None
    x8, sx, shape = r.fp8.x8, r.fp8.sx, (r.plan.cfg.block_k, r.plan.tp)

    def quantize(kb, chunk):
      v = _pin(chunk.astype(jnp.float32), CHUNK)
      scale = _pin(jnp.max(jnp.abs(v), axis=0) / E4M3_MAX, CHUNK.reduce(0))   # [TP]: s_x of group kb, per row
      safe = jnp.where(scale > 0, scale, 1.0)                          # all-zero group: x8 = 0 / 1 = 0
      q = _pin(v / _pin(lax.broadcast_in_dim(safe, shape, (1,)), CHUNK), CHUNK)
      fl._chunk_t(x8, kb)[...] = _pin(q.astype(FP8), CHUNK)
      sx[kb] = scale
    return quantize

  def load_scales(self, r):
    """Scale rows of the CTA's m-th tile -> rows m nw .. m nw + nw - 1 (a one-weight tile copies its row nw
    times, so every barrier counts nw arrivals)."""
    scales, rows, bars = r.fp8.scales, r.fp8.rows, r.fp8.bars
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
          n = self.row_len
          for i in range(nw):
            tma.copy_gmem_to_smem(refs[min(i, len(refs) - 1)].at[pl.ds(row * n, n)],
                                  rows.at[pl.ds((m * nw + i) * self.scale_cols, n)], bars.at[m], kernel=plan.name,
                                  buffer="scale rows")
        pl.when((m < r.n_mine) & (f >= lo) & (f < hi))(copy)

  def gemm(self, r, xs, s, m, tile, base):
    """acc_i [BN, TP] over the KB steps of the CTA's m-th tile (projection s, ring loads base ..)."""
    plgpu.barrier_wait(r.fp8.bars.at[m])
    gemm = {"partial": _gemm_scaled_partial, "weight": _gemm_scaled_weight, "e4m3": _gemm_e4m3}[self.scale_on]
    return gemm(r, xs, s, m, tile, base)


def _dequantised(r, slot, scale=None):
  """The fp8 tile of a ring slot as bf16 (times `scale` in f32 first, when given). e4m3 -> bf16 goes through f32:
  the PTX of this toolchain converts e4m3 only to f16 / f32 (Mosaic's message)."""
  w = r.slots.at[slot][...].astype(jnp.float32)
  return (w if scale is None else w * scale).astype(jnp.bfloat16)


def _scale(r, m, i, k):
  """Scale of weight i of the CTA's m-th tile at K step k (its 128-wide scale column)."""
  col = lax.div(k * r.plan.cfg.block_k, jnp.int32(SCALE_BLOCK))
  return r.fp8.rows[(m * _nw(r.plan) + i) * r.plan.fp8.scale_cols + col]


def _gemm_scaled_partial(r, xs, s, m, tile, base):
  """acc_i = sum_k s_i[k] (bf16(W8_i tile) @ xn_k^T): fresh partials per step, scaled in fp32 (exact block math);
  each step waits for its wgmma."""
  dq, plan = r.fp8.tiles, r.plan
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
  dq, plan = r.fp8.tiles, r.plan
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


def _gemm_e4m3(r, xs, s, m, tile, base):
  """acc_i = sum_k (s_i[k] s_x[:, k]) (W8_i tile @ x8_k^T): one e4m3 x e4m3 wgmma per weight and 128-wide K step
  into a zeroed fp32 partial, promoted into acc_i in registers.
  Pipelined (plan.defer: a ring of >= 2 nw slots): two partials per weight alternate (even / odd steps; the loop
  runs over step pairs, as an accumulator is a static register set) and step k's wgmma is issued before step
  k - 1's partials are read (wait_group nw: only step k's groups still in flight), promoted and their slots
  refilled. Otherwise each step gets fresh partials and waits for its own wgmma."""
  plan, refs = r.plan, r.fp8
  nw, ring, kb = plan.projs[s].n_weights, plan.ring, plan.kb
  shape = (plan.cfg.block_n, plan.tp)
  pin = lambda v: plgpu.layout_cast(v, plgpu.Layout.WGMMA)
  zeros = lambda: pin(jnp.zeros(shape, jnp.float32))

  def mma(k, parts):
    """Step k's wgmmas into `parts` (zero): W8 slot @ x8[k]^T per weight, once the slots have landed."""
    slots = [lax.rem(base + k * nw + i, jnp.int32(ring)) for i in range(nw)]
    for slot in slots:
      plgpu.barrier_wait(r.bars.at[slot])
    for part, slot in zip(parts, slots):
      plgpu.wgmma(part, r.slots.at[slot], fl._chunk_t(refs.x8, k))

  def promote(k, accs, ps):
    """acc_i += p_i * (s_i[k] s_x[:, k]) (s_x down the columns); step k's slots are free: refill them."""
    sx = _pin(refs.sx[k], COLUMNS)                                    # [TP]: s_x of group k, per column
    out = tuple(pin(a + p * pin(lax.broadcast_in_dim(_pin(sx * _scale(r, m, i, k), COLUMNS), shape, (1,))))
                for i, (a, p) in enumerate(zip(accs, ps)))
    fl._refill(r, s, m, tile, base, k)
    return out

  if not plan.defer:
    def step(k, accs):
      def scoped(*parts):
        mma(k, parts)
        return tuple(p[...] for p in parts)                           # waits for this step's wgmma
      return promote(k, accs, pl.run_scoped(scoped, *[plgpu.ACC(shape)] * nw))
    return lax.fori_loop(0, kb, step, (zeros(),) * nw)

  def scope(*parts):
    bufs = (parts[:nw], parts[nw:])

    def issue(k, buf):
      for part in bufs[buf]:                                          # its last wgmma was read: retired
        if plan.cfg.interpret:
          jax.ref.set(part, ..., zeros())                             # the interpreter has no accumulator store
        else:
          part[...] = zeros()
      mma(k, bufs[buf])

    def retire(k, buf, accs, in_flight):
      """Promote step k's partials (buffer buf) once at most `in_flight` wgmma groups remain."""
      ps = [plgpu.wgmma_accumulator_load(p, wait_n=in_flight) for p in bufs[buf]]
      return promote(k, accs, ps)

    def pair(j, accs):                                                # steps 2j + 1 (buffer 1), 2j + 2 (buffer 0)
      k = 2 * j + 1
      issue(k, 1)
      accs = retire(k - 1, 0, accs, nw)
      issue(k + 1, 0)
      return retire(k, 1, accs, nw)

    issue(0, 0)
    accs = lax.fori_loop(0, (kb - 1) // 2, pair, (zeros(),) * nw)    # steps 0 .. 2 ((kb - 1) // 2) issued
    if kb % 2 == 0:                                                   # step kb - 1 (odd: buffer 1) left
      issue(kb - 1, 1)
      accs = retire(kb - 2, 0, accs, nw)
      return retire(kb - 1, 1, accs, 0)
    return retire(kb - 1, 0, accs, 0)

  return pl.run_scoped(scope, *[plgpu.ACC(shape)] * (2 * nw))


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
  if scale_on == "e4m3" and cfg.block_k != SCALE_BLOCK:
    raise ValueError(f"block_k={cfg.block_k}: scale_on='e4m3' steps over the {SCALE_BLOCK}-wide activation groups "
                     f"(block_k={SCALE_BLOCK})")
  w8s, flat = _split(weights, projs)
  k = sum(x.shape[1] for x in xs)
  n_k = pl.cdiv(k, SCALE_BLOCK)
  cols = -(-n_k // SCALE_ALIGN) * SCALE_ALIGN
  # The GMEM rows the kernel copies: the checkpoint's [N/128, nK] scales flattened (free) where a row of nK f32
  # is a TMA box (4 nK bytes a multiple of 16: nK = 20, 32, 48 at Ling's K = 2560, 4096, 6144); only other nK
  # are padded (an XLA pad per call and weight).
  src = tma.pad_to(n_k, jnp.float32, tma.BOX_INNER_ALIGN)
  flat_scales = []
  for w8, sc in flat:
    want = (pl.cdiv(w8.shape[0], SCALE_BLOCK), n_k)
    if w8.dtype != FP8 or w8.ndim != 2 or sc.dtype != jnp.float32 or sc.shape != want:
      raise ValueError(f"fp8 weight {w8.shape} {w8.dtype} with scales {sc.shape} {sc.dtype}: expected "
                       f"float8_e4m3fn [N, K={k}] with float32 scales {want} (128 x 128 blocks)")
    flat_scales.append((jnp.pad(sc, ((0, 0), (0, src - n_k))) if src != n_k else sc).reshape(-1))
  return fl._call(xs, norm_ws, residual, w8s, projs, eps, cfg, fp8=Fp8Ring(cols, scale_on, src),
                  scales=tuple(flat_scales))


@functools.partial(jax.jit, static_argnames=("projs", "eps", "config", "scale_on"))
def norm_linear_fp8(x, norm_w, weights, *, projs, eps, config=None, scale_on="partial"):
  """fused_linear.norm_linear with block-fp8 weights: each entry of `weights` a (w8 [N_s, K] float8_e4m3fn,
  scale_inv [ceil(N_s/128), ceil(K/128)] f32) pair (or, for "swiglu", a (gate pair, up pair)). x, norm_w,
  projs, eps as norm_linear; returns the same tuple of [T, N_s] outputs.
  scale_on: "partial" (s times each step's fp32 partial: the exact block product), "weight" (s times the
  weight before its bf16 rounding: the model's quant.dense weight, one wgmma group in flight) or "e4m3" (xn
  quantised per row and 128 columns as quant.quantize_activations in the prologue, e4m3 x e4m3 wgmma, s s_x times
  each step's partial: the block product on the quantised activations; block_k 128, x resident)."""
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
