"""lm_head fused with argmax for greedy decoding: Mosaic GPU (Hopper: TMA + wgmma), swap-AB.

Shape legend: T rows (tokens; T <= N), N token columns (T padded), D hidden, V vocab, BV/BK the
vocab and reduction tiles, NT = ceil(V / BV) vocab tiles.

Math (the model's `ling_jax.model.lm_logits` then `ling_jax.sampling.greedy`, without writing logits):
  logits[t, v] = sum_d hidden[t, d] lm_head[v, d]                fp32 accumulate (wgmma)
  token[t] = min{v : logits[t, v] = max_v' logits[t, v']}         (jnp.argmax: lowest index on ties)
  best[t]  = max_v logits[t, v]

Kernel plan:
  1. `_tile_kernel`, grid (NT,): tile j streams lm_head rows [j*BV, (j+1)*BV) (the wgmma M side) through a
     TMA pipeline over D against hidden^T (N columns) into one [BV, N] fp32 accumulator; epilogue: per column
     the tile max and the lowest row reaching it -> part_max [NT, N] f32, part_idx [NT, N] int32.
     The tail: V need not be a multiple of BV; the last tile loads rows [V - BV, V) (in bounds, no padding
     copy of the weight) and masks the rows that belong to the tile before it.
  2. The row winner, one jnp reduction over the NT partials (`_pick_winner`): tile* = argmax_j part_max[j]
     (lowest tile on ties), token = part_idx[tile*]. This is exact: the lowest winning index i lies in tile
     i // BV, every earlier tile's max is < best (else a lower index would win), and inside its tile i is the
     lowest index reaching best. A jnp reduction, not a second kernel: the partials are NT x N x 8 B
     (1228 x 32 x 8 B = 314 KB at Ling size, default tiles), one XLA argmax fusion over them costs a launch
     like a Pallas kernel would, and keeps the tie rule the same code as jnp.argmax. (One kernel in all would
     need a cross-CTA reduction: a 64-bit atomic max over (orderable float bits, ~index); not done.)

Bytes: the kernel reads lm_head once (V x D x 2 = 805 MB at Ling size) plus hidden (T x D x 2, from L2
once per tile) and writes 2 x NT x N x 4 B; the XLA path also writes and re-reads the logits, T x V x 4 B
(10.7 MB at T = 17), and runs the argmax as its own kernel.
Batch invariance: column t of the accumulator depends only on hidden[t] (padding columns are zeros; N is a
config constant, not T), so a row's token and max do not depend on how many rows run.
Equality with jnp.argmax holds on the kernel's own fp32 logits; against XLA's logits (another accumulation
order) it can differ only where two logits lie within fp32 rounding of each other. NaN logits: not
handled (the max propagates NaN and no index reaches it; the token is then the int32 sentinel).

Sampled decoding is not served here: `ling_jax.sampling.probs` needs softmax(logits / temperature) cut to
the top-p nucleus, and the nucleus threshold needs the sorted distribution over all V. So the sampled
path keeps the logits written (lm_logits). A fused Gumbel-max sample would match only top_p = 1 and would
need jax.random.categorical's exact Threefry stream per (row, v) in-kernel to reproduce its draws; left out.
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

NO_INDEX = 2**31 - 1  # int32 sentinel above every vocab index (masked rows never win the min)


@dataclasses.dataclass(frozen=True)
class LmHeadConfig:
  """Tiling for the fused lm_head + argmax.

  Attributes:
    block_v: vocab rows per CTA (wgmma M; multiple of 64).
    block_k: reduction tile over D per pipeline step (multiple of 64: 128 B swizzle of bf16).
    stages: TMA pipeline depth (SMEM slots in flight; >= 2 because a slot is released one step late).
    n_tokens: token columns N (wgmma N; multiple of 8, <= 256; T <= N). A constant, so results do not
      depend on T.
    interpret: run in the Mosaic GPU interpreter (CPU tests).
  """
  block_v: int = 128
  block_k: int = 128
  stages: int = 4
  n_tokens: int = 32
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_v", "block_k"):
      v = getattr(self, name)
      if v <= 0 or v % 64:
        raise ValueError(f"{name}={v} must be a positive multiple of 64")
    if self.n_tokens <= 0 or self.n_tokens % 8 or self.n_tokens > 256:
      raise ValueError(f"n_tokens={self.n_tokens} must be a multiple of 8 in 8..256 (wgmma N)")
    if self.stages < 2:
      raise ValueError(f"stages={self.stages} must be >= 2")

  def check(self, t: int, d: int, v: int):
    if d % self.block_k:
      raise ValueError(f"block_k={self.block_k} must divide D={d}")
    if v < self.block_v:
      raise ValueError(f"V={v} is below block_v={self.block_v}; lower block_v")
    if v >= NO_INDEX:
      raise ValueError(f"V={v} does not fit the int32 index")
    if t > self.n_tokens:
      raise ValueError(f"T={t} rows exceed n_tokens={self.n_tokens}; raise n_tokens (<= 256)")


def _tile_kernel(x_gmem, w_gmem, max_gmem, idx_gmem, *, cfg: LmHeadConfig, d: int, v: int):
  """part_max[j], part_idx[j] over vocab rows [j*BV, min((j+1)*BV, V)) for every token column."""
  bv, bk, n = cfg.block_v, cfg.block_k, cfg.n_tokens
  j = lax.axis_index("v")
  start = jnp.minimum(j * bv, v - bv)                 # the last tile slides back to stay in bounds

  def acc_scope(acc):
    def step(_, w_smem, x_smem):
      plgpu.wgmma(acc, w_smem, x_smem.transpose((1, 0)))              # [BV, BK] @ [BK, N]

    spec = lambda shape: plgpu.BlockSpec(shape, lambda k: (0, k), delay_release=1)
    tma.check_pipeline("lm_head_argmax", [("weight tiles", (bv, bk), w_gmem.dtype),
                                          ("x tiles", (n, bk), x_gmem.dtype)], min(cfg.stages, d // bk))
    plgpu.emit_pipeline(step, grid=(d // bk,), in_specs=[spec((bv, bk)), spec((n, bk))],
                        max_concurrent_steps=cfg.stages)(w_gmem.at[pl.ds(start, bv)], x_gmem)
    return acc[...]

  logits = pl.run_scoped(acc_scope, plgpu.ACC((bv, n)))              # [BV, N] f32
  row = lax.broadcasted_iota(jnp.int32, (bv, n), 0) + start           # vocab index of each row
  mine = row >= j * bv                                                # rows of tile j (tail: not the overlap)
  logits = jnp.where(mine, logits, -jnp.inf)
  best = jnp.max(logits, axis=0)                                      # [N]
  hit = mine & (logits == lax.broadcast_in_dim(best, (bv, n), (1,)))
  first = jnp.min(jnp.where(hit, row, NO_INDEX), axis=0)              # [N] lowest index reaching best

  def store(max_smem, idx_smem):
    max_smem[...] = best
    idx_smem[...] = first
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(max_smem, max_gmem.at[j])
    plgpu.copy_smem_to_gmem(idx_smem, idx_gmem.at[j])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, plgpu.SMEM((n,), jnp.float32), plgpu.SMEM((n,), jnp.int32))


def _pick_winner(part_max, part_idx):
  """[NT, T] partials -> (token int32[T], best f32[T]): the lowest tile with the row max, its index."""
  tile = jnp.argmax(part_max, axis=0)[None]                           # [1, T] lowest tile on ties
  return (jnp.take_along_axis(part_idx, tile, axis=0)[0],
          jnp.take_along_axis(part_max, tile, axis=0)[0])


@functools.partial(jax.jit, static_argnames=("config",))
def lm_head_argmax(hidden, lm_head, *, config: LmHeadConfig | None = None):
  """Greedy tokens without logits. hidden [..., D] (<= n_tokens rows in all), lm_head [V, D], both bf16
  (or f16). Returns (token int32[...], best logit f32[...]) = (argmax, max) of lm_logits(hidden)."""
  cfg = config or LmHeadConfig()
  lead, d = hidden.shape[:-1], hidden.shape[-1]
  v, d2 = lm_head.shape
  if d2 != d:
    raise ValueError(f"hidden D={d} != lm_head D={d2}")
  if hidden.dtype not in (jnp.bfloat16, jnp.float16) or lm_head.dtype != hidden.dtype:
    raise ValueError(f"hidden {hidden.dtype} / lm_head {lm_head.dtype}: the wgmma path takes bf16 or f16 "
                     "for both (f32 would run as tf32; RuntimeOptions.lm_head_fp32 stays on lm_logits)")
  x = hidden.reshape(-1, d)
  t = x.shape[0]
  cfg.check(t, d, v)
  nt = pl.cdiv(v, cfg.block_v)
  tiles = plgpu.kernel(
      functools.partial(_tile_kernel, cfg=cfg, d=d, v=v),
      out_type=(jax.ShapeDtypeStruct((nt, cfg.n_tokens), jnp.float32),
                jax.ShapeDtypeStruct((nt, cfg.n_tokens), jnp.int32)),
      grid=(nt,), grid_names=("v",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=plgpu.InterpretGPUParams() if cfg.interpret else None)
  part_max, part_idx = tiles(jnp.pad(x, ((0, cfg.n_tokens - t), (0, 0))), lm_head)   # [NT, N] each
  token, best = _pick_winner(part_max[:, :t], part_idx[:, :t])
  return token.reshape(lead), best.reshape(lead)
