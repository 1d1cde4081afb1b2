"""MLA decode/verify attention over the LIVE cache prefix, absorbed weights: Mosaic GPU (TMA + wgmma).

Shape legend: B batch, T query positions, H heads, M = T*H query rows (row m = t*H + h), Mp = M padded to
BM = 64, Lr latent width (kv_lora_rank), R rope width, S cache slots, BS slots per block, SB blocks per
split (a split = SB*BS slots), NS = ceil(S / (SB*BS)) splits, BL / BLc ctx columns per program.

Math (the score / softmax / context part of `ling_jax.layers.mla.attend_absorbed`, before W_uv):
  s[m, j] = scale * (q_lat[m] . latent[j] + q_rope[m] . k_rope[j])    fp32 (wgmma)
  visible: j <= pos[m]  (the cache already holds the T new rows; causal inside the verify rows)
  ctx[m] = sum_j softmax_j(s[m])[j] latent[j]                             [M, Lr]
Flash-decoding layout (all M rows share the latent rows, MQA-like, so they sit on the wgmma M side):
  1. `_attend_kernel`, grid (B, Mp/BM, Lr/BL, NS): program (b, mt, lc, sp) runs the online softmax (fp32,
     max trick) over the blocks of split sp below the live length live[b] = max_t pos[b, t] + 1:
       per block: s = Q [BM, Lr+R] @ [latent | k_rope]^T [Lr+R, BS]; m' = max(m, rowmax s);
       p = exp(s - m'); l = l e^(m - m') + rowsum p; acc = acc e^(m - m') + bf16(p) @ latent[:, lc-th BL]
     (the PV operand is a column slice of the latent block already in SMEM: one TMA per block and program)
     and writes acc [BM, BL] f32 and (lc = 0) m, l [BM]. Programs whose split lies past the live length
     exit at once (no loads, no writes). So the work is ceil(live / BS) blocks, not S / BS.
  2. `_combine_kernel`, grid (B, Mp/BM, Lr/BLc): over the live splits only, in split order, the same
     rescale: M' = max(M, m_sp); ctx = ctx e^(M - M') + acc_sp e^(m_sp - M'); L likewise with l_sp;
     ctx / L -> bf16. No global-max pass and no XLA kernel between the two launches.
  Around them: the q reshape (+ row padding when T*H is not a multiple of 64), per-row positions and the
  live length: small XLA fusions the caller's producers can absorb.
Bytes per layer (bf16 cache, Ling: Lr + R = 576): the cache is read for the live prefix only,
ceil(live / BS) * BS * 576 * 2 B from HBM (1.2 MB at live = 1024, 9.4 MB at 8192), vs S * 576 * 2 B for
attend_absorbed at every length (9.5 MB at S = 8256); plus the fp32 partials, written once and read once:
n_live_splits * Mp * Lr * 4 B (16 x 192 x 512 x 4 = 6.3 MB at T = 6, live 8192; 18.9 MB at T = 17), which
mostly stay in the 60 MB L2 between the two launches; split_blocks trades them against parallelism.
The Lr/BL programs of one (b, mt, sp) and the Mp/BM row tiles load the same cache blocks: those repeats
come from L2 (each block reaches SMEM (Mp/BM)(Lr/BL) times, 12 at T = 6: the cost of one warpgroup per
CTA, whose registers cannot hold a [64, 512] fp32 accumulator; two or four compute warpgroups sharing the
block, FlashMLA-style, would remove the Lr/BL factor).
Batch invariance: the split partition is fixed (slot j is in split j // (SB*BS) whatever T, B or the live
length), a row's blocks beyond its position are exact no-ops (p = 0, rescale 1), so are the splits beyond
it in the combine (e^(-inf) = 0, rescale 1), and both sums run in a fixed order: a row's ctx does not
depend on T or on the other rows.
Rounding: p is rounded to bf16 before P @ latent and normalised at the end (the model rounds the
normalised probabilities); the kernel is closer to the fp32 math than the model's bf16 path.
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

BM = 64  # query rows per program (one wgmma M tile)


@dataclasses.dataclass(frozen=True)
class MlaAttentionConfig:
  """Tiling for the live-prefix MLA attention.

  Attributes:
    block_s: cache slots per pipeline step (QK wgmma N, PV wgmma K; 32 or a multiple of 64: P's swizzle).
      SMEM: the [64, Lr + R] query tile + stages x [BS, Lr + R] blocks (216 KB at 64 x 2 at Ling size).
    split_blocks: blocks per split (SB); the split partition is fixed by the slot index (batch invariance).
      Fewer: more programs in flight at short lengths, more fp32 partials.
    block_l: ctx columns per attend program (its fp32 accumulator [64, BL], plus one more for the block's
      P @ latent before the rescale: 2 x 64 registers per thread at 128; multiple of 64).
    stages: attend TMA pipeline depth (>= 2).
    combine_block_l: ctx columns per combine program (multiple of 64).
    interpret: run in the Mosaic GPU interpreter (CPU tests).
  """
  block_s: int = 64
  split_blocks: int = 8
  block_l: int = 128
  stages: int = 2
  combine_block_l: int = 128
  interpret: bool = False

  def __post_init__(self):
    if self.block_s <= 0 or not (self.block_s == 32 or self.block_s % 64 == 0):
      raise ValueError(f"block_s={self.block_s} must be 32 or a positive multiple of 64")
    for name in ("block_l", "combine_block_l"):
      v = getattr(self, name)
      if v <= 0 or v % 64:
        raise ValueError(f"{name}={v} must be a positive multiple of 64")
    if self.split_blocks < 1:
      raise ValueError(f"split_blocks={self.split_blocks} must be >= 1")
    if self.stages < 2:
      raise ValueError(f"stages={self.stages} must be >= 2")

  @property
  def split(self) -> int:
    """Cache slots per split."""
    return self.block_s * self.split_blocks

  def check(self, lr: int, r: int, s: int):
    for name, blk in (("block_l", self.block_l), ("combine_block_l", self.combine_block_l)):
      if lr % blk:
        raise ValueError(f"{name}={blk} must divide Lr={lr}")
    if not (r == 32 or (r > 0 and r % 64 == 0)):
      raise ValueError(f"rope width R={r} must be 32 or a multiple of 64 (its SMEM rows take a swizzle)")
    if s % self.block_s:
      raise ValueError(f"cache slots S={s} must be a multiple of block_s={self.block_s}")


def _load(src_gmem, shape, dtype, buffer):
  """A GMEM tile -> registers, through SMEM (TMA + barrier)."""
  def scope(smem, bar):
    tma.copy_gmem_to_smem(src_gmem, smem, bar, kernel="mla_attention attend", buffer=buffer)
    plgpu.barrier_wait(bar)
    return smem[...]
  return pl.run_scoped(scope, plgpu.SMEM(shape, dtype), plgpu.Barrier(num_barriers=1))


def _online_softmax_step(s, pos, j0, carry, lat_smem, lc, *, bl):
  """One block: mask, rescale, accumulate bf16(p) @ latent chunk. s [BM, BS] scaled scores."""
  acc, m, l = carry
  bs = s.shape[1]
  slot = lax.broadcasted_iota(jnp.int32, (BM, bs), 1) + j0
  s = jnp.where(slot <= lax.broadcast_in_dim(pos, (BM, bs), (0,)), s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)        # a row with nothing visible yet: no NaN
  alpha = jnp.exp(m - m_base)
  p = jnp.exp(s - lax.broadcast_in_dim(m_base, (BM, bs), (0,)))
  l = l * alpha + jnp.sum(p, axis=1)

  def pv(acc_ref):
    def with_p(p_smem):                                     # wgmma takes P from SMEM
      p_smem[...] = p.astype(p_smem.dtype)
      plgpu.commit_smem()
      for c in range(lat_smem.shape[1] // bl):              # static column slices of the latent block
        @pl.when(lc == c)
        def _():
          plgpu.wgmma(acc_ref, p_smem, lat_smem.at[:, pl.ds(c * bl, bl)])   # [BM, BS] @ [BS, BL]
      return acc_ref[...]                                   # waits for the wgmma while P is still live
    return pl.run_scoped(with_p, plgpu.SMEM((BM, bs), lat_smem.dtype))

  acc = acc * lax.broadcast_in_dim(alpha, (BM, bl), (0,)) + pl.run_scoped(pv, plgpu.ACC((BM, bl)))
  return acc, m_new, l


def _attend_kernel(live_gmem, pos_gmem, q_gmem, qr_gmem, cache_gmem, acc_gmem, m_gmem, l_gmem, *,
                   cfg: MlaAttentionConfig, lr: int, r: int, scale: float, layer: int | None):
  b, mt, lc, sp = (lax.axis_index(n) for n in ("b", "m", "l", "s"))
  bs, bl = cfg.block_s, cfg.block_l
  live_blocks = pl.cdiv(live_gmem[b], bs)
  first = sp * cfg.split_blocks
  steps = jnp.clip(live_blocks - first, 0, cfg.split_blocks)   # 0: past the live prefix, no loads
  rows = pl.ds(mt * BM, BM)
  cache = cache_gmem.at[b] if layer is None else cache_gmem.at[layer, b]   # [S, Lr + R]

  def run(q_smem, qr_smem, bar):
    tma.copy_gmem_to_smem(q_gmem.at[b, rows], q_smem, bar.at[0], kernel="mla_attention attend", buffer="q latent")
    tma.copy_gmem_to_smem(qr_gmem.at[b, rows], qr_smem, bar.at[1], kernel="mla_attention attend", buffer="q rope")
    pos = _load(pos_gmem.at[b, rows], (BM,), jnp.int32, "positions")
    plgpu.barrier_wait(bar.at[0])
    plgpu.barrier_wait(bar.at[1])

    def step(idx, lat_smem, rope_smem, carry):
      def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, lat_smem.transpose((1, 0)))      # [BM, Lr] @ [Lr, BS]
        plgpu.wgmma(s_ref, qr_smem, rope_smem.transpose((1, 0)))    # [BM, R] @ [R, BS]
        return s_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((BM, bs))) * scale
      return _online_softmax_step(s, pos, (first + idx[0]) * bs, carry, lat_smem, lc, bl=bl)

    spec = lambda shape, imap: plgpu.BlockSpec(shape, imap, delay_release=1)
    init = (jnp.zeros((BM, bl), jnp.float32), jnp.full((BM,), -jnp.inf, jnp.float32),
            jnp.zeros((BM,), jnp.float32))
    tma.check_pipeline("mla_attention attend", [("latent blocks", (bs, lr), cache.dtype),
                                                ("rope blocks", (bs, r), cache.dtype)], cfg.stages)
    return plgpu.emit_pipeline(
        step, grid=(steps,),
        in_specs=[spec((bs, lr), lambda j: (first + j, 0)),          # latent block (QK)
                  spec((bs, r), lambda j: (first + j, 0))],          # k_rope block (QK)
        max_concurrent_steps=cfg.stages, init_carry=init,
    )(cache.at[:, pl.ds(0, lr)], cache.at[:, pl.ds(lr, r)])

  @pl.when(steps > 0)                                          # past the live prefix: exit, no loads
  def _live():
    acc, m, l = pl.run_scoped(run, plgpu.SMEM((BM, lr), q_gmem.dtype), plgpu.SMEM((BM, r), q_gmem.dtype),
                              plgpu.Barrier(num_barriers=2))

    def store(acc_smem, m_smem, l_smem):
      acc_smem[...] = acc
      m_smem[...] = m
      l_smem[...] = l
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(acc_smem, acc_gmem.at[b, sp, rows, pl.ds(lc * bl, bl)])

      @pl.when(lc == 0)                                          # every column chunk has the same m, l
      def _():
        plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[b, sp, rows])
        plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[b, sp, rows])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(store, plgpu.SMEM((BM, bl), jnp.float32), plgpu.SMEM((BM,), jnp.float32),
                  plgpu.SMEM((BM,), jnp.float32))


def _combine_kernel(live_gmem, m_gmem, l_gmem, acc_gmem, ctx_gmem, *, cfg: MlaAttentionConfig, mp: int):
  """ctx[b, rows, cols] = sum_sp e^(m_sp - M) acc_sp / sum_sp e^(m_sp - M) l_sp over the live splits, with
  the max M found on the way (the flash rescale, split by split in order)."""
  b, mt, lc = (lax.axis_index(n) for n in ("b", "m", "l"))
  bl, tiles = cfg.combine_block_l, mp // BM
  live_splits = pl.cdiv(live_gmem[b], cfg.split)
  col = lambda v: lax.broadcast_in_dim(v, (BM, bl), (0,))

  def step(_, acc_smem, m_smem, l_smem, carry):
    ctx, m_run, l_run = carry
    m_sp = m_smem[...]
    m_new = jnp.maximum(m_run, m_sp)
    m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    keep, take = jnp.exp(m_run - m_base), jnp.exp(m_sp - m_base)   # a split a row cannot see: take = 0
    part = plgpu.layout_cast(acc_smem[...], plgpu.Layout.WGMMA)
    return ctx * col(keep) + part * col(take), m_new, l_run * keep + l_smem[...] * take

  vec = lambda: plgpu.BlockSpec((BM,), lambda s: (s * tiles + mt,))           # m, l viewed [NS*Mp]
  init = (jnp.zeros((BM, bl), jnp.float32), jnp.full((BM,), -jnp.inf, jnp.float32),
          jnp.zeros((BM,), jnp.float32))
  tma.check_pipeline("mla_attention combine", [("partial contexts", (BM, bl), acc_gmem.dtype),
                                               ("row maxima", (BM,), m_gmem.dtype),
                                               ("row sums", (BM,), l_gmem.dtype)], 2)
  ctx, _, l_sum = plgpu.emit_pipeline(
      step, grid=(live_splits,),
      in_specs=[plgpu.BlockSpec((BM, bl), lambda s: (s * tiles + mt, lc)), vec(), vec()],  # acc: [NS*Mp, Lr]
      max_concurrent_steps=2, init_carry=init,
  )(acc_gmem.at[b], m_gmem.at[b], l_gmem.at[b])
  ctx = ctx / col(l_sum)

  def store(ctx_smem):
    ctx_smem[...] = ctx.astype(ctx_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ctx_smem, ctx_gmem.at[b, pl.ds(mt * BM, BM), pl.ds(lc * bl, bl)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, plgpu.SMEM((BM, bl), ctx_gmem.dtype))


@functools.partial(jax.jit, static_argnames=("scale", "config", "layer"))
def mla_attention(q_lat, q_rope, cache, positions, *, scale: float, config: MlaAttentionConfig | None = None,
                  layer: int | None = None):
  """Absorbed MLA context over the live prefix. q_lat [B, T, H, Lr] (q_nope @ W_uk), q_rope [B, T, H, R]
  (rotated), cache [B, S, Lr + R] (rows of the T queries already written), positions int32 [B, T]
  (absolute; row t sees slots j <= positions[b, t]), scale = qk_head_dim^-0.5.
  layer: the cache is the model's stacked [L, B, S, Lr + R] and this call reads its layer `layer` in place
  (a slice of the stack would be a copy of the whole layer's cache: a custom call takes whole buffers).
  Returns ctx [B, T, H, Lr] in the cache dtype (attention-weighted latent, before W_uv)."""
  cfg = config or MlaAttentionConfig()
  stacked = cache if layer is not None else None
  if layer is not None:
    if cache.ndim != 4 or not 0 <= layer < cache.shape[0]:
      raise ValueError(f"layer={layer} needs a stacked cache [L, B, S, F] with L > layer, got {cache.shape}")
    cache = jax.ShapeDtypeStruct(cache.shape[1:], cache.dtype)   # the layer's view, for the checks below
  b, t, h, lr = q_lat.shape
  r, s = q_rope.shape[-1], cache.shape[1]
  if q_rope.shape[:3] != (b, t, h) or cache.shape != (b, s, lr + r) or positions.shape != (b, t):
    raise ValueError(f"shapes q_lat {q_lat.shape}, q_rope {q_rope.shape}, cache {cache.shape}, positions "
                     f"{positions.shape}: want [B,T,H,Lr], [B,T,H,R], [B,S,Lr+R], [B,T]")
  if cache.dtype not in (jnp.bfloat16, jnp.float16) or {q_lat.dtype, q_rope.dtype} != {cache.dtype}:
    raise ValueError(f"q_lat {q_lat.dtype} / q_rope {q_rope.dtype} / cache {cache.dtype}: the wgmma path "
                     "takes one 16-bit dtype (bf16 or f16) for all three")
  cfg.check(lr, r, s)
  m_rows = t * h
  mp, ns = pl.cdiv(m_rows, BM) * BM, pl.cdiv(s, cfg.split)
  pad = lambda a: a if mp == m_rows else jnp.pad(a, ((0, 0), (0, mp - m_rows)) + ((0, 0),) * (a.ndim - 2),
                                                 mode="edge")
  q = pad(q_lat.reshape(b, m_rows, lr))
  qr = pad(q_rope.reshape(b, m_rows, r))
  pos = pad(jnp.repeat(positions.astype(jnp.int32), h, axis=1))      # [B, Mp] position of each row
  live = jnp.minimum(jnp.max(positions, axis=1).astype(jnp.int32) + 1, s)   # [B]; never a block past S
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  interp = plgpu.InterpretGPUParams() if cfg.interpret else None

  attend = plgpu.kernel(
      functools.partial(_attend_kernel, cfg=cfg, lr=lr, r=r, scale=float(scale), layer=layer),
      out_type=(jax.ShapeDtypeStruct((b, ns, mp, lr), jnp.float32),     # acc, m, l per split
                jax.ShapeDtypeStruct((b, ns, mp), jnp.float32),
                jax.ShapeDtypeStruct((b, ns, mp), jnp.float32)),
      grid=(b, mp // BM, lr // cfg.block_l, ns), grid_names=("b", "m", "l", "s"),
      compiler_params=params, interpret=interp)
  acc, m, l = attend(live, pos, q, qr, cache if stacked is None else stacked)   # live splits' partials only

  combine = plgpu.kernel(
      functools.partial(_combine_kernel, cfg=cfg, mp=mp),
      out_type=jax.ShapeDtypeStruct((b, mp, lr), cache.dtype),
      grid=(b, mp // BM, lr // cfg.combine_block_l), grid_names=("b", "m", "l"),
      compiler_params=params, interpret=interp)
  ctx = combine(live, m.reshape(b, ns * mp), l.reshape(b, ns * mp), acc.reshape(b, ns * mp, lr))
  return ctx[:, :m_rows].reshape(b, t, h, lr)
