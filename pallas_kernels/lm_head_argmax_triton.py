"""The greedy token of a few rows on Triton: final RMSNorm + lm_head + argmax, no logits written.

Shape legend: T rows (batch folded in; KernelCalls sends T <= MAX_ROWS = 17), D hidden, V vocabulary (the lm_head
[V, D]), BT x BV the logit tile of one program, BK the K step, NT = ceil(V / BV) vocabulary tiles, BR the partials
one step of the reduction reads.

Why: at batch 1 the tail of every pass that produces a token is the final norm (a reduce and a multiply), the
lm_head matvec, XLA's argmax reduce and whatever reads the logits in between: 3-6 launches of ~2 us each at the v2
demo's sizes (V = 4096, D = 320), and a [T, V] f32 round trip through HBM. Here it is two launches and no logits:
  1. head_tiles  grid (NT, ceil(T / BT)): program (j, i) norms its BT rows (recomputed in every program: x is T D
                 bytes from L2) and computes the logit tile [BT, BV] of vocabulary rows [j BV, (j + 1) BV) in
                 registers, then writes that tile's (max, first index of the max) per row to the partials
                 [T, NT]; programs j = 0 also write the normed rows (the final norm's output: NEXTN's target
                 hidden and the MTP's chained hidden need it; plain decode drops it).
  2. reduce      grid (ceil(T / BT),): the partials of a row block in order j = 0, BR, 2 BR, ... -> tokens [T].
A second launch rather than "the last program to finish reduces": that needs an atomic arrival counter kept
zeroed between calls (state, or a memset launch) and fences between the programs' stores; the tiny second
launch is deterministic by construction and reads T NT 8 bytes.

Math (the model's functions are the reference: ling_jax.model.lm_logits over ling_jax.layers.norms.rms_norm,
then jnp.argmax; tests compare with them):
  r      [T]     = rsqrt(sum_d x^2 / D + eps)                    fp32 squares; the sum in this kernel's order
  xn     [T, D]  = nw * round(x * r, x.dtype)                    rms_norm's rounding points, in act = the dtype
                                                                 of nw * x (the model's hidden)
  logit  [T, V]  = xn @ W^T                                      fp32 accumulation (lm_logits returns fp32 and
                                                                 never rounds: bf16 x bf16 products are exact in
                                                                 fp32, so its lm_head_fp32 form is the same math),
                                                                 K steps in order 0, BK, 2 BK, ...; W read in act
  token  [T]     = argmax_v logit                                jnp.argmax's order: NaN above everything, the
                                                                 first index among equals (within a tile by the
                                                                 lowest column, across tiles by the lowest tile)
Bytes: the lm_head once (the whole cost: V D 2 B, 2.6 MB at the demo's size, 805 MB at Ling's), x once per
program (L2), T NT 8 B of partials written and read back, T D of normed rows.
Batch invariance: row t's token uses only row t; BT, BV, BK, BR and every order are fixed by the config, never by
T (T sets the row-block count and the masks), so row 0 alone or among 17 rows gets the same token and the same
normed bits.
Limits: any T, D, V (masks); the [BT, BK] x tile and the [BT, BV] f32 logit tile live in registers, so T stays
small: T <= MAX_ROWS is what KernelCalls sends.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_ROWS = 17  # the rows KernelCalls sends here: decode (B), verify (B (1 + NEXTN drafts)) and draft (B) passes
_NO_INDEX = np.int32(2**31 - 1)  # above every column: the min over "no candidate" (masked lanes never win)


@dataclasses.dataclass(frozen=True)
class HeadArgmaxConfig:
  """Tiles and launch of head_argmax (none of it depends on T: batch invariant).

  Attributes:
    block_t: rows of one program (tl.dot: >= 16); 32 covers every T <= MAX_ROWS in one block (the lm_head read once).
    block_v: vocabulary rows of one program (>= 16): NT = ceil(V / block_v) programs per row block (32 at the
      demo's V = 4096, 1228 at Ling's 157184).
    block_k: the K step (>= 16); D need not be a multiple (masked).
    block_r: partials one step of the reduction reads (>= 16).
    num_warps, num_stages: the Triton launch of the head tiles (num_stages pipelines the K loop's loads).
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_t: int = 32
  block_v: int = 128
  block_k: int = 64
  block_r: int = 256
  num_warps: int = 4
  num_stages: int = 3
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_t", "block_v", "block_k", "block_r"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of 2 >= 16 (tl.dot / reduction tiles)")
    if self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
      raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4 or 8 and num_stages={self.num_stages} >= 1")


def first_max(vals, cols, live):
  """Per row of vals [R, C] f32 over the lanes where live [R, C]: (the max, NaN where a live lane is NaN; the
  smallest `cols` [R, C] value among the lanes holding it: jnp.argmax's rule). A row with no live lane gives
  (-inf, _NO_INDEX)."""
  nan = (vals != vals) & live
  any_nan = jnp.max(nan.astype(jnp.int32), axis=1) > 0                            # [R]
  clean = jnp.where(live & ~nan, vals, -jnp.inf)
  top = jnp.max(clean, axis=1)                                                    # [R]
  hit = jnp.where(any_nan[:, None], nan, live & (clean == top[:, None]))
  first = jnp.min(jnp.where(hit, cols, _NO_INDEX), axis=1)
  return jnp.where(any_nan, jnp.float32(jnp.nan), top), first


def _tiles_kernel(x_ref, nw_ref, w_ref, val_ref, idx_ref, normed_ref, *, t, d, v, eps, cfg, act_dtype):
  """Program (j, i): rows [i BT, (i + 1) BT), vocabulary rows [j BV, (j + 1) BV) -> partials [:, j] (+ normed)."""
  bt, bv, bk = cfg.block_t, cfg.block_v, cfg.block_k
  j, rb = pl.program_id(0), pl.program_id(1)
  row0, col0 = rb * bt, j * bv
  rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, bk), 0)
  cols = lax.broadcasted_iota(jnp.int32, (bt, bk), 1)
  n_k = pl.cdiv(d, bk)
  x_dtype = x_ref.dtype

  def x_tile(kb):  # [BT, BK] of x, zero past T rows / D columns
    return plt.load(x_ref.at[pl.ds(row0, bt), pl.ds(kb * bk, bk)], mask=(rows < t) & (cols + kb * bk < d),
                    other=0.0)

  # 1. r = rsqrt(mean(x^2) + eps): squares summed per column slot over the K steps, then one row sum / D (a
  #    division, as jnp.mean)
  def sq_step(kb, ss):
    xf = x_tile(kb).astype(jnp.float32)
    return ss + xf * xf

  ss = lax.fori_loop(0, n_k, sq_step, jnp.zeros((bt, bk), jnp.float32))
  r = lax.rsqrt(jnp.sum(ss, axis=1, keepdims=True) / np.float32(d) + eps)           # [BT, 1]

  # 2. the K loop: xn tile (rms_norm's roundings; stored by the j = 0 programs) against the [BV, BK] lm_head tile
  prec = lax.Precision.HIGHEST if act_dtype == jnp.float32 else None
  w_rows = col0 + lax.broadcasted_iota(jnp.int32, (bv, bk), 0)
  w_cols = lax.broadcasted_iota(jnp.int32, (bv, bk), 1)

  def k_step(kb, acc):
    normed = (x_tile(kb).astype(jnp.float32) * r).astype(x_dtype)
    k_ok = lax.broadcasted_iota(jnp.int32, (bk,), 0) + kb * bk < d
    nw = plt.load(nw_ref.at[pl.ds(kb * bk, bk)], mask=k_ok, other=0.0)
    xn = nw.astype(act_dtype)[None, :] * normed.astype(act_dtype)

    @pl.when(j == 0)
    def _():
      plt.store(normed_ref.at[pl.ds(row0, bt), pl.ds(kb * bk, bk)], xn.astype(normed_ref.dtype),
                mask=(rows < t) & (cols + kb * bk < d))

    wb = plt.load(w_ref.at[pl.ds(col0, bv), pl.ds(kb * bk, bk)], mask=(w_rows < v) & (w_cols + kb * bk < d),
                  other=0.0)
    return acc + plt.dot(xn, wb.astype(act_dtype), trans_b=True, precision=prec)

  acc = lax.fori_loop(0, n_k, k_step, jnp.zeros((bt, bv), jnp.float32))
  # 3. the tile's (max, first index of the max) per row, over the vocabulary rows < V
  vcols = col0 + lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
  top, first = first_max(acc, vcols, vcols < v)
  out_rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
  plt.store(val_ref.at[pl.ds(row0, bt), pl.ds(j, 1)], top[:, None], mask=out_rows < t)
  plt.store(idx_ref.at[pl.ds(row0, bt), pl.ds(j, 1)], first[:, None], mask=out_rows < t)


def _reduce_kernel(val_ref, idx_ref, tok_ref, *, t, n_tiles, cfg):
  """Program i: the partials of rows [i BT, (i + 1) BT) in steps of BR tiles, in order -> tokens."""
  bt, br = cfg.block_t, cfg.block_r
  row0 = pl.program_id(0) * bt
  rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, br), 0)
  lanes = lax.broadcasted_iota(jnp.int32, (bt, br), 1)

  def step(s, carry):
    best, best_idx = carry
    live = (rows < t) & (lanes + s * br < n_tiles)
    vals = plt.load(val_ref.at[pl.ds(row0, bt), pl.ds(s * br, br)], mask=live, other=-jnp.inf)
    idx = plt.load(idx_ref.at[pl.ds(row0, bt), pl.ds(s * br, br)], mask=live, other=0)
    top, lane = first_max(vals, lanes, live)                      # the first tile of this step holding the max
    top_idx = jnp.sum(jnp.where(lanes == lane[:, None], idx, 0), axis=1)
    # an earlier step keeps its pick unless this one is strictly above it (NaN above all, the first NaN kept)
    best_nan, top_nan = best != best, top != top
    take = (lane != _NO_INDEX) & ~best_nan & (top_nan | (top > best))
    return jnp.where(take, top, best), jnp.where(take, top_idx, best_idx)

  init = (jnp.full((bt,), -jnp.inf, jnp.float32), jnp.zeros((bt,), jnp.int32))
  best, best_idx = lax.fori_loop(0, pl.cdiv(n_tiles, br), step, init)
  # every tile -inf: no step is strictly above the start, and index 0 is jnp.argmax's answer too
  out_rows = row0 + lax.broadcasted_iota(jnp.int32, (bt,), 0)
  plt.store(tok_ref.at[pl.ds(row0, bt)], best_idx, mask=out_rows < t)


@functools.partial(jax.jit, static_argnames=("eps", "config"))
def head_argmax(x, norm_weight, w, *, eps, config=None):
  """argmax_v (rms_norm(x, norm_weight, eps) @ w^T) per row, in two launches; no logits written.

  x [T, D], norm_weight [D], w [V, D] (the lm_head; read per tile in act = the dtype of norm_weight * x, rms_norm's
  output) -> (tokens int32[T], normed [T, D] in act: rms_norm's output, the model's final hidden)."""
  cfg = config or HeadArgmaxConfig()
  t, d = x.shape
  v = w.shape[0]
  act = jnp.result_type(norm_weight, x)
  if norm_weight.shape != (d,) or w.shape != (v, d):
    raise ValueError(f"x {x.shape}, norm_weight {norm_weight.shape}, w {w.shape}: expected [T, D], [D], [V, D]")
  n_tiles, n_rb = pl.cdiv(v, cfg.block_v), pl.cdiv(t, cfg.block_t)
  tiles = functools.partial(_tiles_kernel, t=t, d=d, v=v, eps=float(eps), cfg=cfg, act_dtype=act)
  vals, idx, normed = pl.pallas_call(
      tiles, grid=(n_tiles, n_rb),
      out_shape=(jax.ShapeDtypeStruct((t, n_tiles), jnp.float32), jax.ShapeDtypeStruct((t, n_tiles), jnp.int32),
                 jax.ShapeDtypeStruct((t, d), act)),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="head_argmax_tiles",
  )(x, norm_weight, w)
  reduce = functools.partial(_reduce_kernel, t=t, n_tiles=n_tiles, cfg=cfg)
  tokens = pl.pallas_call(
      reduce, grid=(n_rb,), out_shape=jax.ShapeDtypeStruct((t,), jnp.int32),
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      interpret=cfg.interpret, name="head_argmax_reduce",
  )(vals, idx)
  return tokens, normed
