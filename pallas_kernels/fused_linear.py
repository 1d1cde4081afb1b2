"""Norm + projection and projection + residual for few rows: Mosaic GPU (Hopper: TMA + wgmma), swap-AB.

Shape legend: T rows (batch folded in, T <= 24 for Ling's K), TR = T rounded so TMA can tile it (T if
T <= 8 or T % 8 == 0, else the next multiple of 8), TP = TR rounded up to 8 (wgmma N), K reduction width
(D, or D1 + D2 for two normed inputs), KB = K / BK steps, N_s rows of projection s, BN x BK weight tile,
G CTAs (persistent grid), R weight-ring slots of one [BN, BK] tile each.

Math (the model's functions are the references; tests compare with them):
  norm_linear:      xn = concat_i rms_norm(x_i, w_i, eps)   (ling_jax.layers.norms: fp32 stats, bf16 rounding of
                                                              x * r, then bf16 of w * that: two rounding points)
                    y_s = epilogue_s(W_s @ xn^T)            [N_s, T] fp32 accumulation (wgmma)
  linear_residual:  out = residual + bf16(x @ W^T)           (the model adds the bf16 projection to the stream)
Epilogues (`Proj.kind`), each with the model's rounding points:
  "linear"   y = round(acc, out)                           (einsum output: bf16, or f32 = router logits)
  "sigmoid"  y = sigmoid(f32(round(acc, logit)))           (KDA beta, MLA gate: bf16 logit; router: f32 logit)
  "swiglu"   g, u = bf16(acc_g), bf16(acc_u); a = bf16(silu(g)); with L > 0: a = min(a, L), u = clip(u, -L, L);
             h = bf16(a * u)                               (layers.moe.swiglu; the routed clamp becomes
                                                            this formula too). Weights: the (gate, up) pair.
  The router's selection bias is not added here: route() needs s = sigmoid(logits) for the weights and
  s + bias only to pick; keeping s exact lets the top-k consumer add the bias (one add, no second output).

Bytes moved: every weight once (sum_s N_s K 2, the whole cost at T <= 24), x (T K 2 per CTA, from L2 after the
first), the outputs. The kernel is a weight stream; what limits it is how many bytes are in flight and for how
long each SM's stream runs without a gap (Little's law: ~4.3 TB/s x ~1.5 us ~ 6.4 MB in flight, ~50 KB / SM).

Kernel plan (one launch, persistent: G = min(tiles, sms * ctas_per_sm) CTAs; the BN-row tiles of all
projections are numbered f = 0.. in projection order and CTA c owns tiles c, c + G, c + 2G, ... (static
round robin: neighbouring CTAs stream neighbouring weight rows at the same time)):
  1. issue the CTA's first R weight-tile TMA loads (they depend on no producer), then griddepcontrol.wait
     (PDL: the previous kernel's x is only read after it) and griddepcontrol.launch_dependents;
  2. TMA x [TR, K] into SMEM once per CTA (resident: [KB, TP, BK] bf16, 128 B swizzle), norm weights alongside;
  3. prologue (norm_linear), once per CTA: per KB chunk load x^T [BK, TP] (transposed view, WGMMA layout),
     sum of squares down the columns, r = rsqrt(ss / K + eps); a second pass writes xn back in place (bf16; or
     hands each chunk to the fp8 kernel's activation quantisation, fused_linear_fp8 scale_on="e4m3");
  4. per owned tile, K loop: wgmma(acc[BN, TP], W tile [BN, BK], xn chunk^T [BK, TP]). The ring is ONE
     stream over all of the CTA's tiles: load g (tile m, load j of its KB * n_weights) sits in slot g % R, and
     the slot freed by load g is refilled with load g + R, near a tile's end the NEXT tile's first loads
     (R <= KB, so g + R lies in tile m or m + 1): the next tile's weights are in flight during this tile's
     last steps and its epilogue. With R >= 2 n_weights one wgmma group stays in flight (step k is issued
     before step k - 1's slots are released), so the refill does not wait on the wgmma latency;
  5. epilogue in registers, stored transposed (o_smem [TP, BN]) and TMA'd to out [TR, N_s]: bf16 outputs are
     row-major [T, N], no XLA transpose after the kernel (f32 ones: see `_store`).
Ring depth: by default as deep as the CTA's SMEM share allows (T = 1: 10 slots = 160 KB in flight per SM, T = 17:
5 = 80 KB), so the tail, where only the SMs with one tile more are busy (KDA: 57 of 132), still has MBs in flight.
Streamed x (`LinearConfig.stream_x`, linear_residual only: no norm needs the whole row): each ring slot also
carries x's chunk [TP, BK] for its step (same barrier), so x need not fit in SMEM (o_proj K = 4096 at T = 17:
x is 196 KB); x is re-read from L2 per tile, TP / BN of the weight bytes.
Why persistent: one CTA per tile (the first version) redid the x load and the norm per tile, ramped its short
ring up and down per tile and ran 2.4 waves for the 321 KDA tiles. Why not emit_pipeline: its first loads
are issued inside the pipeline call (the weight prefetch could not start before griddepcontrol.wait nor
overlap the norm), and it pipelines one tile grid, not a CTA's run over tiles of projections of several kinds.
Not done: split-K. Projections of few tiles (shared expert + router: 20, o_proj: 40) use only that many SMs;
a fixed-order split-K needs a cross-CTA handoff (GMEM semaphores, which the CPU interpreter cannot run) or
a second launch for the reduction, which costs more than it saves at 10-20 MB.
Why linear_residual does not also return the normed output: every consumer of the residual stream (the next
attention projections, the MLP / shared expert + router, the MTP and lm_head) is itself a norm_linear, whose
prologue normalises on the fly from the L2-resident x; a normed copy from the residual kernel would need all
N columns of the row in one CTA (a grid-wide reduction), i.e. one more kernel.
Batch invariance: row t's result uses only row t (column t of every tile), one fixed K order, no split-K; the
grid and the ring depth change which CTA computes a tile and when, never the arithmetic.
T < TP rows are zero-filled by TMA (out-of-bounds rows), their columns are never stored.
Limits: T in 9..15 and 17..23 (not a TMA tile multiple) costs an XLA pad of x and a slice of each output;
bf16 N_s must be <= 64 or a multiple of 64 (the TMA store tiles GMEM), f32 N_s a multiple of 8; K >= 2 BK;
resident x: TP * K * 2 bytes (T = 17, K = 2560: 123 KB) + 2 ring slots must fit the CTA's SMEM share.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tma

SMEM_BYTES = 227 * 1024       # H100/H200 opt-in shared memory per block
SM_SMEM_BYTES = 228 * 1024    # per SM, shared by its resident CTAs (1 KB of it reserved per CTA)
SMEM_SLACK = 4 * 1024         # barriers, 1 KB alignment of swizzled buffers: kept free when sizing the ring
KINDS = ("linear", "sigmoid", "swiglu")
DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class Proj:
  """One projection of the fused weight read.

  Attributes:
    kind: "linear", "sigmoid" or "swiglu" (its weight is the (gate, up) pair).
    out: output dtype of "linear" ("bfloat16" or "float32"); "sigmoid" outputs f32, "swiglu" bf16.
    logit: "sigmoid": the dtype its logit is rounded to first (the model's einsum output dtype).
    limit: "swiglu": the clamp L (0 = off).
  """
  kind: str = "linear"
  out: str = "bfloat16"
  logit: str = "bfloat16"
  limit: float = 0.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind={self.kind!r} not in {KINDS}")
    for name in ("out", "logit"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"{name}={getattr(self, name)!r} not in {DTYPES}")
    if self.kind == "swiglu" and self.out != "bfloat16":
      raise ValueError(f"swiglu outputs bfloat16 (as swiglu), got out={self.out!r}")
    if self.limit < 0 or (self.limit and self.kind != "swiglu"):
      raise ValueError(f"limit={self.limit} is a swiglu clamp (>= 0); kind={self.kind!r}")

  @property
  def n_weights(self) -> int:
    return 2 if self.kind == "swiglu" else 1

  @property
  def out_dtype(self):
    return jnp.float32 if self.kind == "sigmoid" else jnp.dtype(self.out)


@dataclasses.dataclass(frozen=True)
class LinearConfig:
  """Tiling and grid of the fused projections (none of it changes the arithmetic: batch invariant).

  Attributes:
    block_n: weight rows per tile (wgmma M; multiple of 64).
    block_k: reduction tile per ring slot (multiple of 64: 128 B swizzle of bf16); BK * 2 bytes is the
      contiguous run read from each weight row per TMA.
    ring_bytes: weight bytes in flight per CTA (R = ring_bytes // (BN BK 2) slots, BN BK 1 for fp8 weights; at
      least 2, at most KB);
      None: as many slots as the CTA's SMEM share holds next to x and the output tile.
    ctas_per_sm: persistent CTAs per SM (1 or 2); each gets SM_SMEM_BYTES / ctas_per_sm of shared memory.
    sms: SMs of the target GPU (132 on the H100 / H200 SXM); the grid is min(tiles, sms * ctas_per_sm).
    stream_x: carry x's chunk in each ring slot instead of keeping x resident (linear_residual only);
      None: stream when resident x would not leave room for a ring of 4 slots.
    pdl: issue griddepcontrol.wait / launch_dependents (programmatic dependent launch; off in interpret).
    interpret: run in the Mosaic GPU interpreter (CPU tests).
  """
  block_n: int = 64
  block_k: int = 128
  ring_bytes: int | None = None
  ctas_per_sm: int = 1
  sms: int = 132
  stream_x: bool | None = None
  pdl: bool = True
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_n", "block_k"):
      v = getattr(self, name)
      if v <= 0 or v % 64:
        raise ValueError(f"{name}={v} must be a positive multiple of 64")
    if self.block_n > 256:
      raise ValueError(f"block_n={self.block_n} must be <= 256")
    if self.ring_bytes is not None and self.ring_bytes < 2 * self.tile_bytes:
      raise ValueError(f"ring_bytes={self.ring_bytes} must hold 2 {self.block_n}x{self.block_k} bf16 tiles "
                       f"({2 * self.tile_bytes} bytes)")
    if self.ctas_per_sm not in (1, 2):
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")
    if self.sms < 1:
      raise ValueError(f"sms={self.sms} must be >= 1")

  @property
  def tile_bytes(self) -> int:
    return self.block_n * self.block_k * 2

  @property
  def cta_smem(self) -> int:
    """Shared memory one CTA may use so that ctas_per_sm of them are resident on an SM."""
    return min(SMEM_BYTES, SM_SMEM_BYTES // self.ctas_per_sm - 1024)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one call (shapes resolved, grid and ring sized)."""
  rows: int                 # TR: rows of x and of the outputs as the kernel sees them
  tp: int                   # TP: wgmma N
  k_parts: tuple            # K of each input (one norm each)
  n_rows: tuple             # N_s of each projection
  projs: tuple
  eps: float
  norm: bool
  residual: bool
  stream_x: bool
  ring: int                 # R slots
  cfg: LinearConfig
  fp8: object = None        # fused_linear_fp8.Fp8Ring: e4m3 weight tiles + their block scales (None: bf16)

  @property
  def kb(self) -> int:
    return sum(self.k_parts) // self.cfg.block_k

  def tiles(self):
    """(first flat tile, last + 1) of each projection."""
    out, start = [], 0
    for n in self.n_rows:
      out.append((start, start + pl.cdiv(n, self.cfg.block_n)))
      start = out[-1][1]
    return out

  @property
  def n_tiles(self) -> int:
    return self.tiles()[-1][1]

  @property
  def grid(self) -> int:
    return min(self.n_tiles, self.cfg.sms * self.cfg.ctas_per_sm)

  @property
  def defer(self) -> bool:
    """Keep one wgmma group in flight: needs the slots of two steps held at once (else the ring deadlocks)."""
    return self.ring >= 2 * max(p.n_weights for p in self.projs)

  def loads(self, s: int) -> int:
    """Ring loads of one tile of projection s (KB steps of n_weights tiles)."""
    return self.kb * self.projs[s].n_weights

  @property
  def name(self) -> str:
    """The kernel's name in tma's alignment errors."""
    return "fused_linear_fp8" if self.fp8 else "fused_linear"


def _swizzled(itemsize: int = 2, cols: int = 128):
  """128 B swizzle of a [rows, cols] tile of 2-byte (or, for fp8 weight tiles, 1-byte: 64 B when BK = 64) elements."""
  swizzle = min(128, cols * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _fixed_smem(tp, k, norm, stream_x, cfg, extra=0):
  """SMEM besides the weight ring: resident x (or per-slot x chunks, counted with the ring), the norm
  weights, the bf16 and f32 output tiles, `extra` (fp8: the dequantised tiles or the e4m3 activations, and
  the scale rows)."""
  x = 0 if stream_x else tp * k * 2
  return x + (k * 2 if norm else 0) + tp * cfg.block_n * (2 + 4) + SMEM_SLACK + extra


def _slot_bytes(tp, stream_x, cfg, w_bytes=2):
  return cfg.block_n * cfg.block_k * w_bytes + (tp * cfg.block_k * 2 if stream_x else 0)


# ----------------------------------------------------------------------------- prologue


def _x_group(kb: int) -> int:
  """x chunks per barrier: Mosaic allows at most 32 barriers in a group, so K / BK > 32 (o_proj's 4096, the
  dense down's 6144) shares each barrier between G chunks (G the smallest divisor of kb with kb / G <= 32)."""
  return next(g for g in range(1, kb + 1) if kb % g == 0 and kb // g <= 32)


def _wait_chunk(x_bar, kb, g):
  """Wait for x chunk kb: on the first chunk of its barrier's group (a barrier is waited once per phase)."""
  if g == 1:
    plgpu.barrier_wait(x_bar.at[kb])
    return

  @pl.when(kb % g == 0)
  def _():
    plgpu.barrier_wait(x_bar.at[kb // g])


def _load_x(x_gmems, nw_gmems, xs, nw_smem, x_bar, nw_bar, plan):
  """TMA every x chunk [TR rows, BK] into xs[kb] (rows TR..TP zero-filled) and the norm weights."""
  bk, kb0, g = plan.cfg.block_k, 0, _x_group(plan.kb)
  for i, x_gmem in enumerate(x_gmems):
    kbi = plan.k_parts[i] // bk
    for kb in range(kbi):
      tma.copy_gmem_to_smem(x_gmem.at[pl.ds(0, plan.tp), pl.ds(kb * bk, bk)], xs.at[kb0 + kb],
                            x_bar.at[(kb0 + kb) // g], kernel=plan.name, buffer="x chunks")
    if plan.norm:
      tma.copy_gmem_to_smem(nw_gmems[i], nw_smem.at[pl.ds(kb0, kbi)], nw_bar.at[i], kernel=plan.name,
                            buffer="norm weights")
    kb0 += kbi


def _chunk_t(xs, kb):
  return xs.at[kb].transpose((1, 0))                                 # [BK, TP] view of [TP, BK]


def _normalize(xs, nw_smem, x_bar, nw_bar, plan, emit=None):
  """xs[kb] <- bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) per input, computed on x^T chunks [BK, TP].
  emit(kb, xn_chunk^T): where the normed chunk goes instead (fp8 activations: quantised into their own buffer)."""
  bk, tp, kb0 = plan.cfg.block_k, plan.tp, 0
  chunk_t = functools.partial(_chunk_t, xs)
  for i, k in enumerate(plan.k_parts):
    kbi = k // bk

    def sum_squares(kb, ss):
      _wait_chunk(x_bar, kb, _x_group(plan.kb))
      v = chunk_t(kb)[...].astype(jnp.float32)
      return ss + jnp.sum(v * v, axis=0)                              # [TP]

    ss = lax.fori_loop(kb0, kb0 + kbi, sum_squares, jnp.zeros((tp,), jnp.float32))
    r = lax.broadcast_in_dim(lax.rsqrt(ss / k + plan.eps), (bk, tp), (1,))
    plgpu.barrier_wait(nw_bar.at[i])

    def scale(kb, carry):
      v = chunk_t(kb)[...].astype(jnp.float32)
      w = lax.broadcast_in_dim(nw_smem[kb].astype(jnp.float32), (bk, tp), (0,))
      normed = (v * r).astype(xs.dtype).astype(jnp.float32)         # normed.astype(x.dtype)
      xn = (w * normed).astype(xs.dtype)                             # weight * normed (bf16)
      if emit is None:
        chunk_t(kb)[...] = xn
      else:
        emit(kb, xn)
      return carry

    lax.fori_loop(kb0, kb0 + kbi, scale, 0)
    kb0 += kbi


def _wait_x(x_bar, plan):
  g = _x_group(plan.kb)
  for b in range(plan.kb // g):
    plgpu.barrier_wait(x_bar.at[b])


def _emit_x(xs, plan, emit):
  """emit(kb, x chunk^T [BK, TP]) for every chunk of the (loaded, un-normed) x: linear_residual's prologue when
  the activations are quantised."""
  def chunk(kb, carry):
    emit(kb, _chunk_t(xs, kb)[...])
    return carry
  lax.fori_loop(0, plan.kb, chunk, 0)



# ----------------------------------------------------------------------------- weight ring + GEMM


def _when(cond, body):
  """pl.when that also takes a static bool (the prefetch's tile and load indices are Python ints)."""
  if isinstance(cond, bool):
    if cond:
      body()
  else:
    pl.when(cond)(body)


def _div(a, b):
  return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _rem(a, b):
  return a % b if isinstance(a, int) else lax.rem(a, jnp.int32(b))


@dataclasses.dataclass(frozen=True)
class _Ring:
  """One CTA's weight stream: load g (its tile m, load j of that tile) lands in slots[g % R] on bars[g % R]."""
  plan: _Plan
  ws: tuple           # per projection: its weight ref(s) in GMEM
  x: object           # x in GMEM (streamed x) or None
  slots: object       # [R, BN, BK] bf16
  x_slots: object     # [R, TP, BK] bf16 (streamed x) or None
  bars: object        # R barriers (1 arrival, 2 with streamed x)
  cta: object         # c
  fp8: tuple = ()     # fp8 weights: Fp8Ring.refs (the scale refs in GMEM, Fp8Ring.scratch's SMEM refs)

  def tile(self, m):
    """Flat tile index of the CTA's m-th tile."""
    return self.cta + m * self.plan.grid

  @property
  def n_mine(self):
    g = self.plan.grid
    return (self.plan.n_tiles - self.cta + g - 1) // g


def _issue_proj(r, s, tile, j, slot):
  """TMA load j of `tile` (local to projection s): step k = j // n_weights of weight i = j % n_weights."""
  bn, bk, nw = r.plan.cfg.block_n, r.plan.cfg.block_k, r.plan.projs[s].n_weights
  k = _div(j, nw)
  for i, w in enumerate(r.ws[s]):
    def copy(w=w):
      tma.copy_gmem_to_smem(w.at[pl.ds(tile * bn, bn), pl.ds(k * bk, bk)], r.slots.at[slot], r.bars.at[slot],
                            kernel=r.plan.name, buffer="weight ring")
      if r.x is not None:                                             # streamed x: its chunk rides along
        tma.copy_gmem_to_smem(r.x.at[pl.ds(0, r.plan.tp), pl.ds(k * bk, bk)], r.x_slots.at[slot],
                              r.bars.at[slot], kernel=r.plan.name, buffer="streamed x slots")
    _when(True if nw == 1 else _rem(j, nw) == i, copy)


def _issue(r, m, j, slot):
  """Load j of the CTA's m-th tile, whichever projection it belongs to (nothing past the CTA's last tile)."""
  f = r.tile(m)
  for s, (lo, hi) in enumerate(r.plan.tiles()):
    _when((m < r.n_mine) & (f >= lo) & (f < hi), functools.partial(_issue_proj, r, s, f - lo, j, slot))


def _refill(r, s, m, tile, base, k):
  """Step k's slots are free: refill each with the load R ahead (this tile's, or the next tile's first)."""
  nw, ring, n_loads = r.plan.projs[s].n_weights, r.plan.ring, r.plan.loads(s)
  for i in range(nw):
    slot = lax.rem(base + k * nw + i, jnp.int32(ring))
    ahead = k * nw + i + ring
    _when(ahead < n_loads, functools.partial(_issue_proj, r, s, tile, ahead, slot))
    _when(ahead >= n_loads, functools.partial(_issue, r, m + 1, ahead - n_loads, slot))


def _gemm(r, xs, s, m, tile, base):
  """acc_i [BN, TP] = W_i[tile rows] @ xn^T over the KB steps of the CTA's m-th tile (projection s), whose
  loads are the ring's base .. base + loads(s) - 1 (issued R ahead). With R >= 2 n_weights (`plan.defer`)
  one wgmma group stays in flight: step k's wgmmas are issued before step k - 1's slots are released."""
  plan = r.plan
  nw, ring = plan.projs[s].n_weights, plan.ring

  def scope(*accs):
    def step(k, carry):
      slots = [lax.rem(base + k * nw + i, jnp.int32(ring)) for i in range(nw)]
      for slot in slots:
        plgpu.barrier_wait(r.bars.at[slot])
      for acc, slot in zip(accs, slots):
        x_chunk = r.x_slots.at[slot] if plan.stream_x else xs.at[k]
        plgpu.wgmma(acc, r.slots.at[slot], x_chunk.transpose((1, 0)))
      if plan.defer:
        plgpu.wgmma_wait(1)                                           # step k - 1 retired: its slots are free
        _when(k > 0, functools.partial(_refill, r, s, m, tile, base, k - 1))
      else:
        plgpu.wgmma_wait(0)
        _refill(r, s, m, tile, base, k)
      return carry

    lax.fori_loop(0, plan.kb, step, 0)
    if plan.defer:
      plgpu.wgmma_wait(0)
      _refill(r, s, m, tile, base, plan.kb - 1)
    return tuple(a[...] for a in accs)

  return pl.run_scoped(scope, *[plgpu.ACC((plan.cfg.block_n, plan.tp))] * nw)


def _epilogue(proj, accs):
  """The model's rounding points on the fp32 accumulator(s) [BN, TP] (every value pinned to the WGMMA
  layout: Mosaic's layout inference does not find one through the elementwise chain on its own)."""
  f32, bf = jnp.float32, jnp.bfloat16
  pin = lambda v: plgpu.layout_cast(v, plgpu.Layout.WGMMA)
  rnd = lambda v, dt: pin(pin(v.astype(dt)).astype(f32))             # round to dt, back to f32
  if proj.kind == "linear":
    return pin(accs[0].astype(proj.out_dtype))
  if proj.kind == "sigmoid":
    return pin(jax.nn.sigmoid(rnd(accs[0], jnp.dtype(proj.logit))))
  g, u = rnd(accs[0], bf), rnd(accs[1], bf)
  act = rnd(pin(g * pin(jax.nn.sigmoid(g))), bf)                      # silu, rounded (swiglu)
  if proj.limit > 0:
    act, u = pin(jnp.minimum(act, proj.limit)), pin(jnp.clip(u, -proj.limit, proj.limit))
  return pin(pin(act * u).astype(bf))


def _store(y, out_gmem, res_gmem, tile, plan, o_bf, o_f32, res_bar):
  """out[:, tile cols] = y^T (+ residual): a bf16 y [BN, TP] is stored through a transposed [TP, BN] view
  (stmatrix.trans); f32 has no transposed SMEM store, so f32 outputs are written as out^T [N_s, TP]."""
  bn, tp = plan.cfg.block_n, plan.tp
  transposed = out_gmem.dtype == jnp.bfloat16
  cols = pl.ds(tile * bn, bn)
  o_smem = o_bf if transposed else o_f32
  if res_gmem is not None:                                            # out = residual + bf16(x W^T)
    tma.copy_gmem_to_smem(res_gmem.at[pl.ds(0, tp), cols], o_bf, res_bar.at[0], kernel=plan.name,
                          buffer="residual / output tile")
    plgpu.barrier_wait(res_bar.at[0])
    res = o_bf.transpose((1, 0))[...].astype(jnp.float32)
    o_bf.transpose((1, 0))[...] = (res + y.astype(jnp.float32)).astype(o_bf.dtype)
  elif transposed:
    o_bf.transpose((1, 0))[...] = y.astype(o_bf.dtype)
  else:
    o_f32[...] = y
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(0, tp), cols] if transposed else out_gmem.at[cols])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)                     # o_smem is the next tile's


# ----------------------------------------------------------------------------- kernel


def _kernel(*refs, plan):
  n_in = len(plan.k_parts)
  x_gmems, refs = refs[:n_in], refs[n_in:]
  nw_gmems, refs = (refs[:n_in], refs[n_in:]) if plan.norm else ((), refs)
  res_gmem, refs = (refs[0], refs[1:]) if plan.residual else (None, refs)
  n_w = sum(p.n_weights for p in plan.projs)
  w_flat, outs = refs[:n_w], refs[n_w:]
  scales, outs = (outs[:n_w], outs[n_w:]) if plan.fp8 else ((), outs)
  ws, at = [], 0
  for p in plan.projs:
    ws.append(tuple(w_flat[at:at + p.n_weights]))
    at += p.n_weights
  cfg = plan.cfg

  def scope(slots, bars, xs, x_bar, nw_smem, nw_bar, o_bf, o_f32, res_bar, *fp8_smem):
    r = _Ring(plan, tuple(ws), x_gmems[0] if plan.stream_x else None, slots, xs if plan.stream_x else None,
              bars, lax.axis_index("n"), plan.fp8.refs(tuple(scales), *fp8_smem) if plan.fp8 else ())
    for j in range(plan.ring):                                        # 1. producer-independent loads
      _issue(r, 0, j, j)
    if plan.fp8:                                                      # ... and the scale rows of the CTA's tiles
      plan.fp8.load_scales(r)
    if cfg.pdl and not cfg.interpret:                                 # PDL: x is the producer's output
      plgpu.griddepcontrol_wait()
      plgpu.griddepcontrol_launch_dependents()
    if not plan.stream_x:
      _load_x(x_gmems, nw_gmems, xs, nw_smem, x_bar, nw_bar, plan)    # 2.
      emit = plan.fp8.emit_x(r) if plan.fp8 else None                 # fp8 activations: x quantised here
      if plan.norm:                                                   # 3.
        _normalize(xs, nw_smem, x_bar, nw_bar, plan, emit)
      else:
        _wait_x(x_bar, plan)
        if emit is not None:
          _emit_x(xs, plan, emit)
      plgpu.commit_smem()                                             # generic -> async proxy (wgmma)

    def tile_step(m, base):                                           # 4. + 5., base: the tile's first load
      f = r.tile(m)
      n_loads = jnp.int32(0)
      for s, (lo, hi) in enumerate(plan.tiles()):
        mine = (m < r.n_mine) & (f >= lo) & (f < hi)

        @pl.when(mine)
        def _tile(s=s, lo=lo):
          accs = (plan.fp8.gemm if plan.fp8 else _gemm)(r, xs, s, m, f - lo, base)
          _store(_epilogue(plan.projs[s], accs), outs[s], res_gmem, f - lo, plan, o_bf, o_f32, res_bar)
        n_loads = jnp.where(mine, jnp.int32(plan.loads(s)), n_loads)
      return base + n_loads

    lax.fori_loop(0, pl.cdiv(plan.n_tiles, plan.grid), tile_step, jnp.int32(0))

  bn, bk, tp = cfg.block_n, cfg.block_k, plan.tp
  x_smem = (plgpu.SMEM((plan.ring, tp, bk), jnp.bfloat16, transforms=_swizzled()) if plan.stream_x else
            plgpu.SMEM((plan.kb, tp, bk), jnp.bfloat16, transforms=_swizzled()))
  g = 1 if plan.stream_x else _x_group(plan.kb)
  w_dtype = jnp.dtype(plan.fp8.weight_dtype if plan.fp8 else jnp.bfloat16)
  scratch = (
      ("weight ring", plgpu.SMEM((plan.ring, bn, bk), w_dtype, transforms=_swizzled(w_dtype.itemsize, bk))),
      ("ring barriers", plgpu.Barrier(num_arrivals=2 if plan.stream_x else 1, num_barriers=plan.ring)),
      ("x chunks", x_smem),
      ("x barriers", plgpu.Barrier(num_arrivals=g, num_barriers=1 if plan.stream_x else plan.kb // g)),
      ("norm weights", plgpu.SMEM((plan.kb if plan.norm else 1, bk), jnp.bfloat16)),
      ("norm barriers", plgpu.Barrier(num_barriers=n_in)),
      ("residual / output tile", plgpu.SMEM((tp, bn), jnp.bfloat16)),
      ("f32 output tile", plgpu.SMEM((bn, tp), jnp.float32)),
      ("residual barrier", plgpu.Barrier(num_barriers=1)),
      *(plan.fp8.scratch(plan) if plan.fp8 else ()))
  tma.check_scratch(plan.name, scratch)
  pl.run_scoped(scope, *(alloc for _, alloc in scratch))


# ----------------------------------------------------------------------------- wrappers


def _check(xs, weights, projs, cfg, w_dtype=jnp.bfloat16):
  """Shapes and dtypes (weights of w_dtype); returns (TR, TP, N_s per projection)."""
  t = xs[0].shape[0]
  for x in xs:
    if x.ndim != 2 or x.shape[0] != t or x.dtype != jnp.bfloat16:
      raise ValueError(f"inputs must be [T, K_i] bfloat16 with one T, got {[(a.shape, a.dtype) for a in xs]}")
    if x.shape[1] % cfg.block_k:
      raise ValueError(f"K={x.shape[1]} must be a multiple of block_k={cfg.block_k}")
  k = sum(x.shape[1] for x in xs)
  if k < 2 * cfg.block_k:
    raise ValueError(f"K={k} must be >= 2 * block_k={cfg.block_k} (a ring of two slots)")
  if len(weights) != len(projs):
    raise ValueError(f"{len(weights)} weights for {len(projs)} projections")
  n_rows = []
  for p, w in zip(projs, weights):
    ws = w if p.kind == "swiglu" else (w,)
    if len(ws) != p.n_weights or any(a.shape != ws[0].shape or a.dtype != w_dtype for a in ws):
      raise ValueError(f"{p.kind} takes {p.n_weights} {jnp.dtype(w_dtype).name} weight(s) of one shape, got "
                       f"{[(a.shape, a.dtype) for a in ws]}")
    n, kw = ws[0].shape
    tile = 64 if p.out_dtype == jnp.bfloat16 else 8
    if kw != k or n % 8 or (n > tile and n % tile):
      raise ValueError(f"weight [{n}, {kw}]: needs K={k}, N % 8 == 0 and N <= {tile} or N % {tile} == 0 "
                       "(the output TMA tiles GMEM); pass projections separately")
    n_rows.append(n)
  if t < 1 or t > 256:
    raise ValueError(f"T={t} rows must be in 1..256 (wgmma N)")
  rows = t if (t <= 8 or t % 8 == 0) else -(-t // 8) * 8
  return rows, max(8, -(-rows // 8) * 8), tuple(n_rows)


def _ring_and_stream(tp, k, norm, cfg, w_bytes=2, extra=0, resident=False):
  """(R ring slots, streamed x?) for the CTA's SMEM share; a clear error when not even 2 slots fit.
  w_bytes: bytes per weight element (2 bf16, 1 fp8); extra: SMEM the fp8 step needs besides the ring;
  resident: x must be resident (fp8 activations: quantised once, in the prologue)."""
  stream = cfg.stream_x
  if stream and norm:
    raise ValueError("stream_x=True: the norm needs all of x resident; only linear_residual streams x")
  if stream and resident:
    raise ValueError("stream_x=True: fp8 activations are quantised once, in the prologue: x must be resident")
  if resident:
    stream = False
  if stream is None:
    stream = not norm and _fixed_smem(tp, k, norm, False, cfg, extra) + 4 * cfg.tile_bytes > cfg.cta_smem
  fixed, slot = _fixed_smem(tp, k, norm, stream, cfg, extra), _slot_bytes(tp, stream, cfg, w_bytes)
  ring = (cfg.cta_smem - fixed) // slot if cfg.ring_bytes is None else cfg.ring_bytes // (
      cfg.block_n * cfg.block_k * w_bytes)
  ring = min(ring, k // cfg.block_k)                                  # R <= KB: load g + R is in tile m or m + 1
  if ring < 2 or fixed + ring * slot > cfg.cta_smem:
    raise ValueError(f"SMEM: {fixed} B (x [{tp}, {k}] {'streamed' if stream else 'resident'}, outputs) + "
                     f"{max(ring, 2)} ring slots of {slot} B > {cfg.cta_smem} B per CTA at ctas_per_sm="
                     f"{cfg.ctas_per_sm}; lower ring_bytes, T or ctas_per_sm, or stream x")
  return ring, bool(stream)


def _call(xs, norm_ws, residual, weights, projs, eps, cfg, fp8=None, scales=()):
  """fp8: a fused_linear_fp8.Fp8Ring (weights e4m3, `scales` one f32 array per weight, flat in weight order)."""
  rows, tp, n_rows = _check(xs, weights, projs, cfg, fp8.weight_dtype if fp8 else jnp.bfloat16)
  t, k = xs[0].shape[0], sum(x.shape[1] for x in xs)
  if norm_ws is not None and cfg.block_k > 256:
    raise ValueError(f"block_k={cfg.block_k}: the norm weight is loaded as [KB, BK] TMA boxes (<= 256 wide); "
                     "norm_linear takes block_k <= 256")
  n_tiles = sum(pl.cdiv(n, cfg.block_n) for n in n_rows)
  tiles_per_cta = pl.cdiv(n_tiles, min(n_tiles, cfg.sms * cfg.ctas_per_sm))
  extra = fp8.smem_bytes(cfg, tiles_per_cta, max(p.n_weights for p in projs), tp, k) if fp8 else 0
  ring, stream = _ring_and_stream(tp, k, norm_ws is not None, cfg, 1 if fp8 else 2, extra,
                                  resident=bool(fp8 and fp8.fp8_activations))
  plan = _Plan(rows, tp, tuple(x.shape[1] for x in xs), n_rows, tuple(projs), float(eps),
               norm_ws is not None, residual is not None, stream, ring, cfg, fp8)
  pad = lambda a: jnp.pad(a, ((0, rows - t), (0, 0))) if rows != t else a
  args = [pad(x) for x in xs]
  if norm_ws is not None:
    args += [w.reshape(-1, cfg.block_k) for w in norm_ws]            # [KB_i, BK]: TMA boxes <= 256
  if residual is not None:
    args.append(pad(residual))
  for p, w in zip(projs, weights):
    args += list(w) if p.kind == "swiglu" else [w]
  args += list(scales)
  out_type = [jax.ShapeDtypeStruct((rows, n) if p.out_dtype == jnp.bfloat16 else (n, tp), p.out_dtype)
              for p, n in zip(projs, n_rows)]
  kernel = plgpu.kernel(
      functools.partial(_kernel, plan=plan), out_type=out_type,
      grid=(plan.grid,), grid_names=("n",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=plgpu.InterpretGPUParams() if cfg.interpret else None)
  outs = kernel(*args)
  # f32 outputs come back as out^T [N_s, TP] (small: router / gate columns); XLA fuses this transpose
  # into their consumer.
  return tuple((o[:t] if rows != t else o) if o.dtype == jnp.bfloat16 else o[:, :t].T for o in outs)


@functools.partial(jax.jit, static_argnames=("projs", "eps", "config"))
def norm_linear(x, norm_w, weights, *, projs, eps, config=None):
  """y_s = epilogue_s(rms_norm(x) @ W_s^T) for every projection s, one weight read, one launch.

  x: [T, D] bf16, or a tuple of inputs ([T, D_i], ...) normed separately and concatenated along K
    (MTP: (embed, hidden) with (enorm, hnorm) against eh_proj [D, D_1 + D_2]).
  norm_w: [D] (or a tuple, one per input), any float dtype the model stores (cast to bf16 as rms_norm's
    `weight * normed` computes in the activation dtype).
  weights: one entry per projection: [N_s, K] bf16, or (gate [F, K], up [F, K]) for "swiglu".
  projs: tuple of Proj (static). Returns a tuple of [T, N_s] (or [T, F]) arrays.
  """
  xs, nws = normed_inputs(x, norm_w)
  return _call(xs, nws, None, weights, projs, eps, config or LinearConfig())


def normed_inputs(x, norm_w):
  """(inputs, bf16 norm weights) as tuples, one norm weight [K_i] per input [T, K_i]."""
  xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  nws = tuple(norm_w) if isinstance(norm_w, (tuple, list)) else (norm_w,)
  if len(nws) != len(xs) or any(w.shape != (a.shape[1],) for w, a in zip(nws, xs)):
    raise ValueError(f"one norm weight [K_i] per input: {[w.shape for w in nws]} vs {[a.shape for a in xs]}")
  return xs, tuple(w.astype(jnp.bfloat16) for w in nws)


@functools.partial(jax.jit, static_argnames=("config",))
def linear_residual(x, w, residual, *, config=None):
  """residual + bf16(x @ w^T): x [T, K] bf16, w [N, K] bf16, residual [T, N] bf16 -> [T, N] bf16."""
  cfg = config or LinearConfig()
  if residual.shape != (x.shape[0], w.shape[0]) or residual.dtype != jnp.bfloat16:
    raise ValueError(f"residual {residual.shape} {residual.dtype} must be [T, N] = {(x.shape[0], w.shape[0])} bf16")
  return _call((x,), None, residual, (w,), (Proj(),), 0.0, cfg)[0]
