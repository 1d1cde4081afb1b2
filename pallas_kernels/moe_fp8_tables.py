"""The fp8 Mosaic MoE's per-call operands (alignment, scale tables, padded x) in ONE Triton launch.

Shape legend (as moe_mosaic_fp8): T tokens (T <= MAX_TOKENS = 32), N token columns, D hidden, A experts per
token, E experts, I expert width, P = T*A pairs, S = P + 1 slots (slot P: the shared expert), nI = ceil(I/128),
nD = ceil(D/128) scale blocks, K = D/BK up steps, KS the down GEMM's split of I, KPS = I/(KS*BKD) down steps per
slot and CTA, W = moe_mosaic_fp8.ROW (16) the scale rows' width, R / R' their row counts. Tiles: BS slots, BQ
down-table positions, BX columns of x per program; PP = P and C = its chunk, powers of 2.

What it replaces: moe_mosaic_fp8.align, the reference (and its only definition of the math): moe_mosaic._align
(dedupe the P expert ids into slots: meta, wc), moe_mosaic_fp8.scale_tables (each slot's expert scale rows
gathered into the per-CTA up and down tables) and the pad of x to N rows: 6-8 small XLA launches per MoE call
(~2 us each; the deviceless H200 compile of one call: 10-12 launches with the two kernels and the split-K sum, 4
with this one), here one. The offline census of the full fp8 model (one H200, 2026-12-08): plain 877 -> 637
launches a step, NEXTN5 1240 -> 765 (XLA also rematerialises some of the chain's fusions there;
bench/results/census-offline-ling3-flash-h200-mft[-off]-2026-12-08.json). The same arrays bit for bit
(tests/test_kernels_moe_fp8_tables.py): every output is an integer count, a copy or (wc) a sum with at most the
terms of one (token, expert) pair, which a top-k never repeats (two equal terms would still add exactly as XLA's
sum, any order).

Math (every program recomputes the alignment, a few thousand compares: no cross-program sync):
  e_p = topk_ids[p // A, p % A]                               pair p's expert
  first_p = #{q < p: e_q == e_p} == 0                         n_active = #{p: first_p}
  slot_p  = #{q: first_q, e_q < e_p}                          (the distinct experts below e_p: ascending slots)
  expert(s) = sum_p [first_p][slot_p == s] e_p                (0 for slots >= n_active, as _align)
  meta = (n_active, expert(0), ..., expert(P - 1))
  wc[s, c] = sum_a [ids[c, a] == expert(s)] w[c, a]  (s < n_active, c < T);  wc[P, c] = [c < T][shared]
  up[s, ii, k]      = gate_s[expert(s), ii, k BK / 128]          k < K
                      up_s[expert(s), ii, (k - K) BK / 128]       K <= k < 2K;  0 past 2K (the row's padding)
  down[dr, ks, q]   = down_s[expert(q // KPS), dr, (ks KPS + q % KPS) BKD / 128]   q < S KPS; 0 past it
  slot P reads the shared expert's scales (zeros without one); x_pad = x with zero rows T..N-1.
Programs: grid G; program g owns slots [g BS, (g + 1) BS) of meta, wc and up, positions [g BQ, (g + 1) BQ) of
the down rows and columns [g BX, (g + 1) BX) of x_pad; G is the most any of these needs (past its range a
program's stores are masked off).
Bytes (Ling, T = 6, N = 16: S = 49): writes x_pad 80 KB, up 56 KB, down 7.7 KB, wc 3 KB, meta; reads x 30 KB and
the picked experts' scale rows (~60 KB, L2). XLA's chain moved the same bytes and more (its intermediates: the
[P, P] and [P, N, P] compare masks, the [S, nI, nD] gathered scales before their column pick) over its launches.
Cost: the [PP, C] compare chunks (PP = 256 at T = 32: 16 chunks of [256, 16]; PP = 64 at T = 6: one [64, 64]),
three [PP, BS|BQ] one-hot sums for the slots' experts, then gathers and stores; latency-bound, not yet timed on
the GPU (KernelCalls.moe_fp8_tables is off until it is).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.moe_mosaic import MosaicMoeConfig
from pallas_kernels.moe_mosaic_fp8 import ROW, SCALE_BLOCK, Aligned

MAX_TOKENS = 32            # decode / verify rows: P = T A <= 256 pairs, the compares in registers
_BIG = 2 ** 30             # the expert id of padding pairs: above every real one, so no real pair counts them


def _pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class TablesConfig:
  """Tiles of the one launch.

  Attributes:
    block_s: slots per program (meta, wc and the up table; a power of 2).
    block_q: down-table positions per program (a power of 2).
    block_x: columns of x per program (the pad; a power of 2).
    num_warps: warps per program.
  """
  block_s: int = 16
  block_q: int = 32
  block_x: int = 256
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block_s", "block_q", "block_x"):
      v = getattr(self, name)
      if v < 1 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of 2 (a Triton block)")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} not in (1, 2, 4, 8, 16)")


def _alignment(ids_ref, *, t, a, pp):
  """(e [PP, 1] pair experts (_BIG past P), first [PP, 1], slot [PP, 1], n_active): _align's dedupe by counting,
  over chunks of C pairs q ([PP, C] compares, at most 4096 elements in registers)."""
  p = t * a
  chunk = max(1, min(pp, 4096 // pp))
  lane = lax.broadcasted_iota(jnp.int32, (pp, 1), 0)                  # [PP, 1] pair p
  live = lane < p

  def experts(pair, ok):  # ids[pair // A, pair % A] (masked lanes read row 0)
    at = jnp.where(ok, pair, 0)
    return jnp.where(ok, plt.load(ids_ref.at[at // a, at % a], mask=ok, other=0).astype(jnp.int32), _BIG)

  e = experts(lane, live)
  count = lambda m, axis: jnp.sum(m.astype(jnp.int32), axis=axis)

  def step(c, carry):
    before, below = carry
    q = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)    # [1, C] pair q
    e_q = experts(q, q < p)
    same, less = e_q == e, e_q < e                                    # [PP, C]
    first_q = count(same & (lane < q), 0)[None, :] == 0               # [1, C]: no pair before q picked e_q
    return before + count(same & (q < lane), 1)[:, None], below + count(less & first_q, 1)[:, None]

  zero = jnp.zeros((pp, 1), jnp.int32)
  before, slot = lax.fori_loop(0, pl.cdiv(pp, chunk), step, (zero, zero))
  first = live & (before == 0)
  # (over the [PP] column: a 2-D -> scalar reduce fails to lower under a mesh)
  return e, first, slot, jnp.sum(first[:, 0].astype(jnp.int32))


def _expert_of(s, e, first, slot):
  """s [R] slot indices -> their experts [R]: the one first pair in each slot (0 past n_active, as _align)."""
  hit = first & (slot == s[None, :])                                  # [PP, R]
  return jnp.sum(jnp.where(hit, e, 0), axis=0)


def _kernel(x_ref, ids_ref, w_ref, gs_ref, us_ref, ds_ref, *refs, t, a, n, d, i, cfg: MosaicMoeConfig,
            tiles: TablesConfig, has_shared):
  """refs: ([shared gate, up, down scales],) x_pad [N, D], meta [1 + P], wc [S, N], up [S, nI, R W],
  down [nD, KS, R' W] (the tables flat per row; the wrapper's reshapes to [.., R, W] are free)."""
  sg_ref, su_ref, sd_ref = refs[:3] if has_shared else (None,) * 3
  xo_ref, meta_ref, wc_ref, up_ref, dn_ref = refs[3:] if has_shared else refs
  p, s_all = t * a, t * a + 1
  n_i, n_d = up_ref.shape[1], dn_ref.shape[0]
  k_up, up_w, dn_w = d // cfg.block_k, up_ref.shape[2], dn_ref.shape[2]
  kps = i // (cfg.split_k * cfg.block_kd)
  g = pl.program_id(0)
  iota = lambda shape, axis: lax.broadcasted_iota(jnp.int32, shape, axis)
  e, first, slot, n_active = _alignment(ids_ref, t=t, a=a, pp=_pow2(p))
  expert_of = functools.partial(_expert_of, e=e, first=first, slot=slot)

  # meta [1 + P]: (n_active, expert of slot 0 .. P - 1)
  bs = tiles.block_s
  m = g * bs + iota((bs,), 0)
  plt.store(meta_ref.at[m], jnp.where(m == 0, n_active, expert_of(m - 1)), mask=m < s_all)

  # wc [S, N]: token c's routing weights on slot s's expert (one term: a top-k picks an expert once per token)
  s = g * bs + iota((bs,), 0)                                         # [BS] this program's slots
  e_s = expert_of(s)
  np_, ap = _pow2(n), _pow2(a)
  c2, a2 = iota((np_, ap), 0), iota((np_, ap), 1)
  pick = (c2 < t) & (a2 < a)
  at_c, at_a = jnp.where(pick, c2, 0), jnp.where(pick, a2, 0)
  ids_t = jnp.where(pick, plt.load(ids_ref.at[at_c, at_a], mask=pick, other=0).astype(jnp.int32), -1)
  w_t = plt.load(w_ref.at[at_c, at_a], mask=pick, other=0.0).astype(jnp.float32)   # [NP, AP]
  hit = (ids_t[None] == e_s[:, None, None]) & (s < n_active)[:, None, None]         # [BS, NP, AP]
  routed = jnp.sum(jnp.where(hit, w_t[None], 0.0), axis=2)            # [BS, NP]
  cols = iota((bs, np_), 1)
  shared_row = ((cols < t) & has_shared).astype(jnp.float32)         # slot P: weight 1 for real tokens
  wc = jnp.where((s == p)[:, None], shared_row, routed)
  plt.store(wc_ref.at[jnp.broadcast_to(s[:, None], cols.shape), cols], wc, mask=(s < s_all)[:, None] & (cols < n))

  # up [S, nI, R W]: column k of row (s, ii) is gate's scale of D step k, up's of step k - K, then zeros
  shape = (bs, _pow2(n_i), _pow2(up_w))
  s3, ii, k = jnp.broadcast_to(s[:, None, None], shape), iota(shape, 1), iota(shape, 2)
  ii_ok = ii < n_i
  ii_at = jnp.where(ii_ok, ii, 0)
  col = (k % k_up) * cfg.block_k // SCALE_BLOCK                       # the D step's scale column
  e3 = jnp.broadcast_to(e_s[:, None, None], shape)
  is_g, is_u = ii_ok & (k < k_up), ii_ok & (k >= k_up) & (k < 2 * k_up)
  routed3 = s3 < p
  up = jnp.where(is_g, plt.load(gs_ref.at[e3, ii_at, col], mask=routed3 & is_g, other=0.0),
                 plt.load(us_ref.at[e3, ii_at, col], mask=routed3 & is_u, other=0.0))
  if has_shared:
    own = s3 == p
    up = jnp.where(own, jnp.where(is_g, plt.load(sg_ref.at[ii_at, col], mask=own & is_g, other=0.0),
                                  plt.load(su_ref.at[ii_at, col], mask=own & is_u, other=0.0)), up)
  # (a masked lane's address stays out of bounds: the interpreter writes masked lanes back, so none may alias a
  # stored one; on the GPU they touch nothing)
  plt.store(up_ref.at[s3, ii, k], up.astype(jnp.float32), mask=(s3 < s_all) & ii_ok & (k < up_w))

  # down [nD, KS, R' W]: position q of row (dr, ks) is down step q % KPS of slot q // KPS (CTA (dr, ks)'s order)
  bq, dp, ksp = tiles.block_q, _pow2(n_d), _pow2(cfg.split_k)
  q = g * bq + iota((bq,), 0)                                         # [BQ] positions
  shape = (dp, ksp, bq)
  e_q = jnp.broadcast_to(expert_of(q // kps)[None, None, :], shape)
  dr, ks, q3 = iota(shape, 0), iota(shape, 1), jnp.broadcast_to(q[None, None, :], shape)
  in_row = (dr < n_d) & (ks < cfg.split_k)
  dr_at, ks_at = jnp.where(in_row, dr, 0), jnp.where(in_row, ks, 0)                  # (loads: clamped)
  col = (ks_at * kps + q3 % kps) * cfg.block_kd // SCALE_BLOCK        # the I block's scale column
  dn = plt.load(ds_ref.at[e_q, dr_at, col], mask=in_row & (q3 // kps < p), other=0.0)
  if has_shared:
    own = in_row & (q3 // kps == p)
    dn = jnp.where(own, plt.load(sd_ref.at[dr_at, col], mask=own, other=0.0), dn)
  plt.store(dn_ref.at[dr, ks, q3], dn.astype(jnp.float32), mask=in_row & (q3 < dn_w))

  # x_pad [N, D]: x's rows, zeros past T
  bx = tiles.block_x
  rows, xc = iota((np_, bx), 0), g * bx + iota((np_, bx), 1)
  xt = plt.load(x_ref.at[pl.ds(0, np_), pl.ds(g * bx, bx)], mask=(rows < t) & (xc < d), other=0.0)
  plt.store(xo_ref.at[pl.ds(0, np_), pl.ds(g * bx, bx)], xt, mask=(rows < n) & (xc < d))


@functools.partial(jax.jit, static_argnames=("cfg", "i", "tiles"))
def align_tables(x, topk_ids, topk_weights, gate_s, up_s, down_s, shared_s=None, *, cfg: MosaicMoeConfig, i: int,
                 tiles: TablesConfig | None = None) -> Aligned:
  """moe_mosaic_fp8.align in one launch (its signature; tiles: this launch's TablesConfig): x [T, D] (bf16, or
  the e4m3 x8 of w8a8), topk_ids / topk_weights [T, A], gate_s / up_s [E, nI, nD], down_s [E, nD, nI], shared_s
  (the shared expert's three scales [nI, nD], [nI, nD], [nD, nI]) or None -> Aligned(x [N, D], meta [1 + P], wc
  [S, N], up [S, nI, R, W], down [nD, KS, R', W]). T <= MAX_TOKENS; the Triton interpreter when cfg.interpret."""
  tiles = tiles or TablesConfig()
  (t, d), (_, a) = x.shape, topk_ids.shape
  e, n_i, n_d = gate_s.shape
  if t > MAX_TOKENS or t > cfg.n_tokens:
    raise ValueError(f"align_tables: T={t} tokens > {min(MAX_TOKENS, cfg.n_tokens)} (MAX_TOKENS {MAX_TOKENS}, "
                     f"n_tokens {cfg.n_tokens}); larger calls align in XLA (moe_mosaic_fp8.align)")
  if (topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t or up_s.shape != gate_s.shape
      or down_s.shape != (e, n_d, n_i)):
    raise ValueError(f"x {x.shape}, topk_ids {topk_ids.shape}, topk_weights {topk_weights.shape}, gate_s "
                     f"{gate_s.shape}, up_s {up_s.shape}, down_s {down_s.shape}: expected [T, D], [T, A], [T, A], "
                     "[E, nI, nD], [E, nI, nD], [E, nD, nI]")
  if d % cfg.block_k or i % (cfg.split_k * cfg.block_kd) or -(-i // SCALE_BLOCK) != n_i:
    raise ValueError(f"D={d}, I={i}: block_k={cfg.block_k} must divide D, split_k x block_kd="
                     f"{cfg.split_k * cfg.block_kd} I, and the scales' nI={n_i} be ceil(I/128)")
  has_shared = shared_s is not None
  if has_shared and tuple(sc.shape for sc in shared_s) != ((n_i, n_d), (n_i, n_d), (n_d, n_i)):
    raise ValueError(f"shared_s {[sc.shape for sc in shared_s]}: expected [nI, nD], [nI, nD], [nD, nI] (the "
                     "shared expert rides as slot P at the routed width)")
  n, p = cfg.n_tokens, t * a
  kps = i // (cfg.split_k * cfg.block_kd)
  up_w = -(-2 * (d // cfg.block_k) // ROW) * ROW                      # scale_tables' rows, padded to W
  dn_w = -(-(p + 1) * kps // ROW) * ROW
  grid = max(pl.cdiv(p + 1, tiles.block_s), pl.cdiv(dn_w, tiles.block_q), pl.cdiv(d, tiles.block_x))
  f32 = jnp.float32
  out = pl.pallas_call(
      functools.partial(_kernel, t=t, a=a, n=n, d=d, i=i, cfg=cfg, tiles=tiles, has_shared=has_shared),
      grid=(grid,),
      out_shape=(jax.ShapeDtypeStruct((n, d), x.dtype), jax.ShapeDtypeStruct((p + 1,), jnp.int32),
                 jax.ShapeDtypeStruct((p + 1, n), f32), jax.ShapeDtypeStruct((p + 1, n_i, up_w), f32),
                 jax.ShapeDtypeStruct((n_d, cfg.split_k, dn_w), f32)),
      compiler_params=plt.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
      interpret=cfg.interpret, name="moe_fp8_tables",
  )(x, topk_ids, topk_weights, gate_s, up_s, down_s, *(shared_s if has_shared else ()))
  x_pad, meta, wc, up, down = out
  return Aligned(x_pad, meta, wc, up.reshape(p + 1, n_i, up_w // ROW, ROW),
                 down.reshape(n_d, cfg.split_k, dn_w // ROW, ROW))
