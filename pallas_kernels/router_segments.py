"""The MoE router with the Triton MoE's expert alignment in its own launch (decode / verify rows).

Reference: the model's ling_jax.layers.moe.router_logits (fp32_weight=False) + route (+ borrow_routing) for the
ids and weights; pallas_kernels.moe's alignment of those ids (moe._rows: the pairs sorted by expert) for the
tables; with a norm weight, ling_jax.layers.norms.rms_norm for the normed rows. `route_segments` ->
moe.moe_segments is router -> up -> down with no XLA kernel between them (with the norm: none before the router
either; the post-attention RMSNorm is this program's prologue).

Shape legend: T tokens (T' = router.padded_tokens(T): a power of 2 >= 16), D hidden, E experts in G groups of
EG, A experts per token (AP lanes), P = T*A (token, expert) pairs, S = P slots (+1: the shared expert),
R = P rows (+T: the shared expert's).

One program for all T tokens:
  (norm_weight given; only where the gate is one score tile, see takes_norm) x is the residual stream:
  r [T'] = rsqrt(sum_d x^2 * (1/D) + eps)  (fp32; ONE sum over each whole row, as XLA sums rms_norm's mean)
  xn = w * round(x * r) per K tile          (round: to x's dtype; the product in the dtype of w * x), stored as
                                             the xn output (the MoE's and the shared expert's input) and fed to
                                             the matvec below
  logits [T', E] = x @ gate_w.T (xn)    (router.router_scores' tiles and K loop, in this program when the gate
                                          is one score tile, E == block_e: the v2 demo's E = 16; else
                                          router_scores runs first and this program reads its scores)
  s = sigmoid(logits);  ids, w [T', AP] = the grouped top-k of s + bias, row by row (router.topk_rows)
  rows past a sequence's live count take its last live row's (ids, w) (router.source_rows)
then the tables in moe._align's layout, by counting (no sort; "onehot": every cell a one-hot sum with one
nonzero term, so every value is exact; "scatter": the same counts, each stored at its row):
  taken[t, e] = 1 if token t picked e      cnt[e] = sum_t taken[t, e]      start[e] = sum_{e' < e} cnt[e']
  row(t, a) = start[e] + #{t' < t: taken[t', e]}   (e = ids[t, a]: the rank of key e * P + t*A + a in a sort)
  slot(e) = #{e' < e: cnt[e'] > 0}
  order[row(t, a)] = t*A + a      tok[r] = order[r] // A      w_rows[r] = w[t, a] of that pair
  seg[:, slot(e)] = (start[e], cnt[e], e); empty slots (P, 0, the largest picked e); slot P the shared expert
  (P, T, 0), its rows P + t: tok t, weight 1.
Bytes (one launch, the v2 demo at T = 6 bf16): reads gate_w E D 2 (10 KB), x T D 2 (3.8 KB; with the norm twice,
the whole rows for the sum and then the K tiles, the second from L1/L2), expert_bias, live_rows, norm_weight D 2;
writes ids, w (T A 4 each), order, seg, tok, w_rows (< 1 KB) and with the norm xn T D (3.8 KB).

Two programs compute that, bit for bit the same (RouterConfig.segments; bench/kernels_moe_router_tables.py):
"onehot" (_segments_kernel) as written above, and "scatter" (_scatter_kernel), for the latency. A ~15 KB job is
latency-bound: what counts is the chain of dependent steps, and on the GPU every reduction over an axis that
spans warps and every layout conversion is a shared-memory round trip behind a barrier (~50-100 cycles).
"onehot" at the v2 demo, T = 6 (SASS of the Triton 3.8 sm_90 compile; 4 warps, all doing one 16 x 16 tile):
  the K loop, pipelined 4 deep: 5 steps, each waiting on its tile's copy (2 global round trips in the chain),
  the top-k: 2 x 2 group rounds + 3 group-top-2 reductions + 4 x 2 pick rounds = 15 reductions in a chain, half
  over G, which spans warps (shared memory + 2 barriers each),
  the tables: per pair column (4): its expert and weight out of [T', AP] (a reduction across warps), the
  one-hot gathers at its expert (2-axis reductions), the [RL, T'] and [SL, T'] one-hots of order, w_rows and
  seg's 3 rows (5 reductions over T', each behind a layout conversion of a [T'] vector); the borrow (live
  rows) two [T', T', AP] one-hot sums more:
  162 barriers, 581 shuffles, 2432 instructions (each warp); ~6.7 us in an in-order latency model of that SASS
  (bench/sass_model.py; measured: 7.3 us a call; 8.7 us modeled with live rows).
"scatter":
  every K tile's loads issued before the first product (the gate's tile loaded transposed by its index, [BK, E],
  so no tile waits on a register transpose of the one before): ONE memory round trip; the same per-tile
  products added in the same order;
  the borrow applied to the rows the scores come from (x's rows gathered in those loads: a row's routing is a
  function of its scores alone, so routing row src[r] in row r is the borrow);
  past the product, the first TQ = T's power of 2 rows only (1 at decode, 8 at T = 6; 16 are the product's
  minimum);
  the selection's "max, then the lowest index holding it" pairs as one argmax each (router.topk_columns):
  2 + 2 + 4 = 8 reductions in the chain, none across warps (the program's warps hold TQ / 16 of the rows);
  the tables by counting on the [TQ, E] grid of (token, expert) cells: before = a cumsum over the tokens, cnt
  a sum over them, start / slot a cumsum over the experts (_store_tables), then each pair's row start[e] +
  before[t, e] addresses ONE scatter store of its order / tok / w_rows entries (the rows are a permutation),
  seg's columns one scatter store at slot(e):
  5 barriers, 1008 instructions; ~2.0 us modeled (1.7 at decode).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import router as _router

# The tables are [rows, T'] and [slots, T'] one-hots in registers, one per pair column a: decode / verify rows.
MAX_TOKENS = 32
# The RMSNorm's rows, [T', pow2(D)] f32, are in registers at once (one sum per row): 128 per thread at 4 warps.
NORM_ELEMENTS = 32 * 512


class RoutedSegments(NamedTuple):
  """The router's outputs for pallas_kernels.moe.moe_segments.
  ids [T, A] int32, weights [T, A] f32 (as router.route; rows past their sequence's live count borrow);
  order [P] int32 (sorted row -> pair t*A + a), seg [3, S] int32, tok [R] int32, w_rows [R] f32 (moe._align's
  layout; see the module docstring); xn [T, D] the normed rows the router read (route_segments with
  norm_weight), else None."""
  ids: jax.Array
  weights: jax.Array
  order: jax.Array
  seg: jax.Array
  tok: jax.Array
  w_rows: jax.Array
  xn: jax.Array | None = None


def _pow2(n):
  return max(2, 1 << (n - 1).bit_length())


def _take_rows(a, src):
  """a [T', AP] -> row r of a[src[r]] (a one-hot sum over the rows: exact)."""
  tp = a.shape[0]
  hit = src[:, None, None] == lax.broadcasted_iota(jnp.int32, (tp, tp, 1), 1)        # [T', T', 1]
  return jnp.sum(jnp.where(hit, a[None], jnp.zeros((), a.dtype)), axis=1)


def _tables(ids, w, valid, *, t, g, eg, top_k, ap, has_shared):
  """ids [T', AP], w [T', AP], valid [T'] -> (order [RL], seg rows (start, len, expert) [SL] each, tok [RL],
  w_rows [RL]); lanes past P (order), S (seg) and R (tok, w_rows) are not stored."""
  tp, p = ids.shape[0], t * top_k
  grp = lambda *s: lax.broadcasted_iota(jnp.int32, s, len(s) - 2)
  col = lambda *s: lax.broadcasted_iota(jnp.int32, s, len(s) - 1)
  flat = grp(tp, g, eg) * eg + col(tp, g, eg)                           # expert id
  lane = col(tp, ap)
  e_k = [jnp.sum(jnp.where(lane == k, ids, 0), axis=1) for k in range(top_k)]          # [T'] pair column a = k
  w_k = [jnp.sum(jnp.where(lane == k, w, 0.0), axis=1) for k in range(top_k)]
  hot = [(flat == e[:, None, None]) & valid[:, None, None] for e in e_k]               # [T', G, EG]
  taken = functools.reduce(lambda a, b: a + b, [h.astype(jnp.int32) for h in hot])    # 0/1: distinct experts
  cnt = jnp.sum(taken, axis=0)                                          # [G, EG]
  before = jnp.cumsum(taken, axis=0) - taken                            # #{t' < t: taken[t', e]}
  excl = lambda v: jnp.cumsum(v, axis=1) - v + (jnp.cumsum(jnp.sum(v, axis=1)) - jnp.sum(v, axis=1))[:, None]
  start = excl(cnt)                                                     # sum over experts below e (flat order)
  used = (cnt > 0).astype(jnp.int32)
  rank = excl(used)                                                     # slot of expert e
  n_active = jnp.sum(jnp.sum(used, axis=1))  # (one axis at a time: a 2-D -> scalar reduce fails under a mesh)
  e_max = jnp.max(jnp.max(jnp.where(used > 0, grp(g, eg) * eg + col(g, eg), -1), axis=1))
  at = lambda h, v: jnp.sum(jnp.sum(jnp.where(h, v, 0), axis=2), axis=1)               # v at each row's expert

  n_rows, n_slots = (p + t, p + 1) if has_shared else (p, p)
  rl, sl = _pow2(n_rows), _pow2(n_slots)
  r_lane, s_lane = grp(rl, tp), grp(sl, tp)                             # [RL, T'], [SL, T']
  tok_id = lax.broadcasted_iota(jnp.int32, (tp,), 0)
  order = jnp.zeros((rl,), jnp.int32)
  w_rows = jnp.zeros((rl,), jnp.float32)
  st = ln = ex = jnp.zeros((sl,), jnp.int32)
  for k in range(top_k):
    row = at(hot[k], start[None] + before)                              # [T'] sorted row of pair (t, k)
    hit = (r_lane == row[None, :]) & valid[None, :]                     # one pair per row
    order = order + jnp.sum(jnp.where(hit, (tok_id * top_k + k)[None, :], 0), axis=1)
    w_rows = w_rows + jnp.sum(jnp.where(hit, w_k[k][None, :], 0.0), axis=1)
    first = valid & (at(hot[k], before) == 0)                           # the expert's first pair
    shot = (s_lane == at(hot[k], rank)[None, :]) & first[None, :]       # one expert per slot
    st = st + jnp.sum(jnp.where(shot, row[None, :], 0), axis=1)
    ln = ln + jnp.sum(jnp.where(shot, at(hot[k], cnt[None])[None, :], 0), axis=1)
    ex = ex + jnp.sum(jnp.where(shot, e_k[k][None, :], 0), axis=1)
  r = lax.broadcasted_iota(jnp.int32, (rl,), 0)
  tok = jnp.where(r < p, order // top_k, r - p)                         # rows P + t: the shared expert's
  w_rows = jnp.where(r < p, w_rows, 1.0)
  s = lax.broadcasted_iota(jnp.int32, (sl,), 0)
  empty = s >= n_active
  st, ln, ex = jnp.where(empty, p, st), jnp.where(empty, 0, ln), jnp.where(empty, e_max, ex)
  if has_shared:
    st, ln, ex = jnp.where(s == p, p, st), jnp.where(s == p, t, ln), jnp.where(s == p, 0, ex)
  return order, (st, ln, ex), tok, w_rows


def _rms_scale(x_ref, *, t, tp, d, eps):
  """r [T', 1] f32 = rsqrt(mean(x^2) + eps) of x's rows, as ling_jax.layers.norms.rms_norm computes it: fp32
  squares, ONE sum over the whole row (loaded at once, zero columns past D: the same sum as over D), the mean
  as XLA's x * (1/D) (its simplifier's form of x / D). Both programs call this on the same [T', pow2(D)] tile
  (T' = padded_tokens(T)) at the same num_warps, and take a borrowed row's r from its source row's."""
  dp = _pow2(d)
  live = (lax.broadcasted_iota(jnp.int32, (tp, dp), 0) < t) & (lax.broadcasted_iota(jnp.int32, (tp, dp), 1) < d)
  xf = plt.load(x_ref.at[pl.ds(0, tp), pl.ds(0, dp)], mask=live, other=0.0).astype(jnp.float32)
  mean_sq = jnp.sum(xf * xf, axis=1, keepdims=True) * (np.float32(1) / np.float32(d))
  return lax.rsqrt(mean_sq + eps)


def _segments_kernel(*refs, t, tp, d, g, eg, topk_group, top_k, ap, scale, norm, has_shared, rows_per_seq,
                     block_k, from_x, rms_eps):
  """from_x: refs = (x, gate_w[, norm_w], bias[, live], outs...), the scores computed here; else (scores, bias
  [, live], outs...). Outputs: ids, w, order, seg, tok, w_rows (RoutedSegments) [, xn].
  rms_eps (from_x only; None: x is the router's input as given): x is the residual stream, and the router (and
  the MoE, through the xn output) reads xn = rms_norm(x, norm_w, rms_eps), computed here."""
  with_norm = rms_eps is not None
  n_in = (3 if from_x else 2) + (1 if with_norm else 0) + (1 if rows_per_seq else 0)
  ins, outs = refs[:n_in], refs[n_in:]
  ids_ref, w_ref, order_ref, seg_ref, tok_ref, wrow_ref = outs[:6]
  live_ref = ins[-1] if rows_per_seq else None
  b_ref = ins[n_in - 1 - (1 if rows_per_seq else 0)]
  row = lax.broadcasted_iota(jnp.int32, (tp,), 0)
  valid = row < t
  if from_x:
    x_ref, g_ref = ins[:2]
    e = g * eg
    x_tile = None
    if with_norm:  # the post-attention RMSNorm: the rows' scale first, then each K step's tile normed and stored
      nw_ref, xn_ref = ins[2], outs[6]
      r = _rms_scale(x_ref, t=t, tp=tp, d=d, eps=rms_eps)
      out_rows = jnp.broadcast_to(valid[:, None], (tp, block_k))

      def x_tile(kb, xb):  # rms_norm's roundings: normed in x's dtype, then weight * normed in xn's dtype
        normed = (xb.astype(jnp.float32) * r).astype(x_ref.dtype)
        wb = nw_ref[pl.ds(kb * block_k, block_k)]
        xn = wb.astype(xn_ref.dtype)[None, :] * normed.astype(xn_ref.dtype)
        plt.store(xn_ref.at[pl.ds(0, tp), pl.ds(kb * block_k, block_k)], xn, mask=out_rows)
        return xn

    logits = _router.gate_logits(x_ref, g_ref, 0, t=t, tp=tp, be=e, bk=block_k, d=d, x_tile=x_tile)
    s = _router.sigmoid(logits).reshape(tp, g, eg)                      # [T', G, EG]
  else:
    shape = (tp, g, eg)
    rows = jnp.broadcast_to(jnp.where(valid, row, 0)[:, None, None], shape)
    s = plt.load(ins[0].at[rows, lax.broadcasted_iota(jnp.int32, shape, 1), lax.broadcasted_iota(jnp.int32, shape, 2)],
                 mask=jnp.broadcast_to(valid[:, None, None], shape), other=0.0)
  _, ids, w = _router.topk_rows(s, b_ref[...], valid, g=g, eg=eg, topk_group=topk_group, top_k=top_k, ap=ap,
                                scale=scale, norm=norm)
  if live_ref is not None:  # the routing borrow of padding rows
    src = _router.source_rows(live_ref, t=t, tp=tp, rows_per_seq=rows_per_seq)
    ids, w = _take_rows(ids, src), _take_rows(w, src)
  out_mask = valid[:, None] & (lax.broadcasted_iota(jnp.int32, (tp, ap), 1) < top_k)
  plt.store(ids_ref.at[pl.ds(0, tp), pl.ds(0, ap)], ids, mask=out_mask)
  plt.store(w_ref.at[pl.ds(0, tp), pl.ds(0, ap)], w, mask=out_mask)

  order, seg, tok, w_rows = _tables(ids, w, valid, t=t, g=g, eg=eg, top_k=top_k, ap=ap, has_shared=has_shared)
  p, n_rows, n_slots = order_ref.shape[0], tok_ref.shape[0], seg_ref.shape[1]
  r = lax.broadcasted_iota(jnp.int32, order.shape, 0)
  plt.store(order_ref.at[pl.ds(0, order.shape[0])], order, mask=r < p)
  plt.store(tok_ref.at[pl.ds(0, tok.shape[0])], tok, mask=r < n_rows)
  plt.store(wrow_ref.at[pl.ds(0, w_rows.shape[0])], w_rows, mask=r < n_rows)
  sl = seg[0].shape[0]
  s_ok = (lax.broadcasted_iota(jnp.int32, (1, sl), 1) < n_slots)
  for k, v in enumerate(seg):
    plt.store(seg_ref.at[pl.ds(k, 1), pl.ds(0, sl)], v[None, :], mask=s_ok)


def _first_rows(x, rows):
  """x [T', ...] -> its first `rows` rows (a power of 2 dividing T'): a masked sum over the row blocks (one
  nonzero term: exact, but for a -0 turning +0)."""
  if rows == x.shape[0]:
    return x
  blocks = x.reshape(x.shape[0] // rows, rows, *x.shape[1:])
  first = lax.broadcasted_iota(jnp.int32, blocks.shape, 0) == 0
  return jnp.sum(jnp.where(first, blocks, jnp.zeros((), x.dtype)), axis=0)


def _store_tables(cols, valid, order_ref, seg_ref, tok_ref, wrow_ref, *, t, e, top_k, has_shared):
  """_tables' values from the pairs' columns [(expert [TQ], weight [TQ])], each stored where it goes (variant
  "scatter"). On the [TQ, E] grid of (token, expert) cells: before[t, e] = #{t' < t: taken[t', e]} (a cumsum
  over the tokens), cnt[e] (a sum over them), start[e] / slot(e) (the pairs / the picked experts below e: a
  cumsum over the experts); then each pair's row start[e] + before[t, e] addresses ONE scatter store of its
  order / tok / w_rows entries (the rows are a permutation: no two lanes write one address) and each picked
  expert's slot one of its seg column (a [4, E] grid: (start, cnt, e) in its rows 0-2)."""
  tq, p = valid.shape[0], t * top_k
  n_rows, n_slots = (p + t, p + 1) if has_shared else (p, p)
  tok2, expert = lax.broadcasted_iota(jnp.int32, (tq, e), 0), lax.broadcasted_iota(jnp.int32, (tq, e), 1)
  hot = [(expert == idx[:, None]) & valid[:, None] for idx, _ in cols]  # [TQ, E] pair column k
  taken = functools.reduce(lambda a, b: a | b, hot).astype(jnp.int32)  # 0/1: distinct experts per token
  before = jnp.cumsum(taken, axis=0) - taken                            # #{t' < t: taken[t', e]}
  cnt = jnp.sum(taken, axis=0)                                          # [E]
  used = (cnt > 0).astype(jnp.int32)
  start, slot = jnp.cumsum(cnt) - cnt, jnp.cumsum(used) - used          # over the experts below e
  n_active = jnp.sum(used)
  e1 = lax.broadcasted_iota(jnp.int32, (e,), 0)
  e_max = jnp.max(jnp.where(used > 0, e1, -1))
  pair = functools.reduce(lambda a, b: a + b, [jnp.where(h, k, 0) for k, h in enumerate(hot)])  # column of (t, e)
  w_pair = functools.reduce(lambda a, b: a + b, [jnp.where(h, wk[:, None], 0.0) for h, (_, wk) in zip(hot, cols)])
  # A masked lane's address is one past the end: the interpreter's masked scatter writes the old value back at
  # every masked lane's address (a lane of another pair's row would be overwritten) but drops out-of-bounds
  # ones; on the GPU a masked lane touches nothing.
  row = jnp.where(taken > 0, start[None, :] + before, n_rows)           # [TQ, E] sorted row of pair (t, e)
  plt.store(order_ref.at[row], tok2 * top_k + pair, mask=taken > 0)
  plt.store(tok_ref.at[row], tok2, mask=taken > 0)
  plt.store(wrow_ref.at[row], w_pair, mask=taken > 0)
  if has_shared:  # rows P + t: the shared expert's, token t at weight 1
    r = lax.broadcasted_iota(jnp.int32, (tq,), 0)
    shared_row = jnp.where(valid, p + r, n_rows)
    plt.store(tok_ref.at[shared_row], r, mask=valid)
    plt.store(wrow_ref.at[shared_row], jnp.ones((tq,), jnp.float32), mask=valid)
  k4 = lax.broadcasted_iota(jnp.int32, (4, e), 0)
  picked = (used[None, :] > 0) & (k4 < 3)
  at_slot = jnp.where(picked, slot[None, :], n_slots)
  plt.store(seg_ref.at[jnp.minimum(k4, 2), at_slot],                   # seg[:, slot(e)] = (start, cnt, e)
            jnp.where(k4 == 0, start[None, :], jnp.where(k4 == 1, cnt[None, :], e1[None, :])), mask=picked)
  sl = _pow2(n_slots)
  k3, s = lax.broadcasted_iota(jnp.int32, (4, sl), 0), lax.broadcasted_iota(jnp.int32, (4, sl), 1)
  empty = jnp.where(k3 == 0, p, jnp.where(k3 == 1, 0, e_max))          # the empty slots: (P, 0, e_max)
  if has_shared:  # slot P: the shared expert (P, T, 0)
    empty = jnp.where(s == p, jnp.where(k3 == 0, p, jnp.where(k3 == 1, t, 0)), empty)
  rest = (k3 < 3) & (s >= n_active) & (s < n_slots)
  plt.store(seg_ref.at[jnp.minimum(k3, 2), jnp.where(rest, s, n_slots)], empty, mask=rest)


def _scatter_kernel(*refs, t, tp, d, g, eg, topk_group, top_k, ap, scale, norm, has_shared, rows_per_seq,
                    block_k, from_x, rms_eps):
  """_segments_kernel's refs and outputs, bit for bit, with fewer dependent steps (RouterConfig.segments =
  "scatter", the module docstring): the K tiles' loads all issued before the first product, the routing borrow
  applied to the rows the scores are computed from, the rows past the product cut to TQ = T's power of 2, the
  selection as argmaxes with the pairs as columns (router.topk_columns; the weights' normalising sum is
  router.normalised_weights' left-to-right chain of the picks' columns in both programs, so the weights do not
  depend on the row tile: TQ here, T' there) and the tables stored where they go (_store_tables). With the
  norm: x's own rows normed and stored as xn, their source rows' (the borrow) normed for the product."""
  with_norm = rms_eps is not None
  n_in = (3 if from_x else 2) + (1 if with_norm else 0) + (1 if rows_per_seq else 0)
  ins, outs = refs[:n_in], refs[n_in:]
  ids_ref, w_ref, order_ref, seg_ref, tok_ref, wrow_ref = outs[:6]
  live_ref = ins[-1] if rows_per_seq else None
  b_ref = ins[n_in - 1 - (1 if rows_per_seq else 0)]
  row = lax.broadcasted_iota(jnp.int32, (tp,), 0)
  valid = row < t
  src = None if live_ref is None else _router.source_rows(live_ref, t=t, tp=tp, rows_per_seq=rows_per_seq)
  tq = 1 << (t - 1).bit_length()                                        # the rows past the product: T's power of 2
  valid_q = lax.broadcasted_iota(jnp.int32, (tq,), 0) < t
  if from_x:
    x_ref, g_ref = ins[:2]
    e, bk, nk = g * eg, block_k, d // block_k
    live_cols = jnp.broadcast_to(valid[:, None], (tp, bk))
    cols = lax.broadcasted_iota(jnp.int32, (tp, bk), 1)

    def x_tiles(rows):  # x's K tiles [T', BK] of its rows `rows` [T'] (None: its own), rows >= T read as 0
      at = (lambda kb: (pl.ds(0, tp), pl.ds(kb * bk, bk))) if rows is None else (
          lambda kb: (jnp.broadcast_to(rows[:, None], (tp, bk)), kb * bk + cols))
      return [plt.load(x_ref.at[at(kb)], mask=live_cols, other=0.0) for kb in range(nk)]

    # [BK, E]: gate_w's tile, transposed by its index (a [E, BK] tile's transpose for the product is a layout
    # conversion in registers behind a barrier, which the next tile's load would wait on)
    k_of, e_of = lax.broadcasted_iota(jnp.int32, (bk, e), 0), lax.broadcasted_iota(jnp.int32, (bk, e), 1)
    gate = [plt.load(g_ref.at[e_of, kb * bk + k_of]) for kb in range(nk)]
    xs = x_tiles(src)
    if with_norm:  # the post-attention RMSNorm: xn of x's own rows stored, the router reads its source rows'
      nw_ref, xn_ref = ins[2], outs[6]
      own = xs if src is None else x_tiles(None)
      w_tiles = [nw_ref[pl.ds(kb * bk, bk)] for kb in range(nk)]
      # rms_norm's roundings: normed in x's dtype, then weight * normed in xn's dtype
      normed = lambda xb, r, wb: wb.astype(xn_ref.dtype)[None, :] * (
          (xb.astype(jnp.float32) * r).astype(x_ref.dtype).astype(xn_ref.dtype))
      r_own = _rms_scale(x_ref, t=t, tp=tp, d=d, eps=rms_eps)
      xn = [normed(xb, r_own, wb) for xb, wb in zip(own, w_tiles)]
      for kb, xnb in enumerate(xn):
        plt.store(xn_ref.at[pl.ds(0, tp), pl.ds(kb * bk, bk)], xnb, mask=live_cols)
      if src is not None:  # the source rows' scales taken from r_own (exact), not summed again over gathered
        # rows: a second sum over another load's layout could associate differently, and onehot's borrowed rows
        # route on their source row's own r
        r_src = _take_rows(r_own, src)
        xn = [normed(xb, r_src, wb) for xb, wb in zip(xs, w_tiles)]
      xs = xn
    logits = jnp.zeros((tp, e), jnp.float32)
    for xb, gb in zip(xs, gate):  # router.gate_logits' sum: acc + one product per tile, in tile order
      prec = lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None
      logits = logits + plt.dot(xb, gb, precision=prec)
    s = _router.sigmoid(_first_rows(logits, tq)).reshape(tq, g, eg)     # [TQ, G, EG]
  else:
    shape = (tq, g, eg)
    src = _router.source_rows(live_ref, t=t, tp=tq, rows_per_seq=rows_per_seq)   # (without live_ref: the row)
    rows = jnp.broadcast_to(src[:, None, None], shape)
    s = plt.load(ins[0].at[rows, lax.broadcasted_iota(jnp.int32, shape, 1), lax.broadcasted_iota(jnp.int32, shape, 2)],
                 mask=jnp.broadcast_to(valid_q[:, None, None], shape), other=0.0)
  ids, w, cols = _router.topk_columns(s, b_ref[...], g=g, eg=eg, topk_group=topk_group, top_k=top_k, ap=ap,
                                      scale=scale, norm=norm)
  out_mask = valid_q[:, None] & (lax.broadcasted_iota(jnp.int32, (tq, ap), 1) < top_k)
  plt.store(ids_ref.at[pl.ds(0, tq), pl.ds(0, ap)], ids, mask=out_mask)
  plt.store(w_ref.at[pl.ds(0, tq), pl.ds(0, ap)], w, mask=out_mask)
  _store_tables(cols, valid_q, order_ref, seg_ref, tok_ref, wrow_ref, t=t, e=g * eg, top_k=top_k,
                has_shared=has_shared)


def _launch(cfg, t, from_x, with_norm):
  """The program's Triton launch parameters (see RouterConfig)."""
  if cfg.segments == "onehot":  # the score kernel's where the scores are computed here (its pipelined K loop)
    return (plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if from_x
            else plt.CompilerParams(num_warps=cfg.slots_warps, num_stages=1))
  if not from_x:
    warps = cfg.slots_warps
  elif with_norm:
    warps = cfg.num_warps
  else:  # segments_warps per 16 of the rows past the product
    warps = cfg.segments_warps * max(1, (1 << (t - 1).bit_length()) // 16)
  return plt.CompilerParams(num_warps=warps, num_stages=1)                # (no loop to pipeline)


def takes_norm(t, d, e, config=None) -> bool:
  """Whether route_segments computes the input's RMSNorm in its program for x [T, D] and E experts: where the
  gate is one score tile (E == block_e: the matvec is in this program; the router_scores launch of wider gates
  reads x itself, so their norm stays the caller's) and the whole row of every token, [T', pow2(D)] f32, fits
  the program's registers (NORM_ELEMENTS)."""
  cfg = config or _router.RouterConfig()
  return e == cfg.block_e and t <= MAX_TOKENS and _router.padded_tokens(t) * _pow2(d) <= NORM_ELEMENTS


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k", "routed_scaling_factor",
                                             "norm_topk_prob", "has_shared", "rows_per_seq", "eps", "config"))
def route_segments(x, gate_w, expert_bias, live_rows=None, norm_weight=None, *, n_group, topk_group, top_k,
                   routed_scaling_factor, norm_topk_prob=True, has_shared, rows_per_seq=0, eps=None,
                   config=None) -> RoutedSegments:
  """The router and the Triton MoE's tables: x [T, D], gate_w [E, D], expert_bias [E] f32, live_rows int32[B]
  or None (with rows_per_seq = T / B: rows past a sequence's live count borrow its last live row's routing)
  -> RoutedSegments. One launch when E == config.block_e (the gate one score tile), else router_scores first.
  has_shared: the tables carry the shared expert as slot P (its width the routed width).
  norm_weight [D] with eps (only where takes_norm): x is the residual stream, the router reads xn =
  ling_jax.layers.norms.rms_norm(x, norm_weight, eps) computed in the program, returned as RoutedSegments.xn
  (dtype: that of weight * x; gate_w must have it) for the MoE to read."""
  cfg = config or _router.RouterConfig()
  t, d = x.shape
  e = gate_w.shape[0]
  assert gate_w.shape == (e, d) and expert_bias.shape == (e,), (x.shape, gate_w.shape, expert_bias.shape)
  cfg.check(d, e, n_group, topk_group, top_k, t=t, itemsize=x.dtype.itemsize)
  if t > MAX_TOKENS:
    raise ValueError(f"route_segments: T={t} tokens > {MAX_TOKENS} (its tables are one-hots over T' rows in "
                     "registers; larger calls align in moe.moe)")
  if live_rows is not None and (not rows_per_seq or live_rows.shape[0] * rows_per_seq != t):
    raise ValueError(f"live_rows {live_rows.shape} with rows_per_seq={rows_per_seq} must cover T={t}")
  with_norm = norm_weight is not None
  if with_norm != (eps is not None):
    raise ValueError("route_segments: norm_weight and eps come together (the RMSNorm of x) or not at all")
  if with_norm and not takes_norm(t, d, e, cfg):
    raise ValueError(f"route_segments: no RMSNorm in the program at T={t}, D={d}, E={e} (block_e={cfg.block_e}): "
                     "see takes_norm; the caller norms x")
  xn_dtype = jnp.result_type(norm_weight, x) if with_norm else x.dtype
  if with_norm and (norm_weight.shape != (d,) or gate_w.dtype != xn_dtype):
    raise ValueError(f"norm_weight {norm_weight.shape} must be [D={d}] and gate_w ({gate_w.dtype}) of the normed "
                     f"rows' dtype {xn_dtype}")
  tp, eg, p = _router.padded_tokens(t), e // n_group, t * top_k
  from_x = e == cfg.block_e
  if from_x:
    head = (x, gate_w) + ((norm_weight,) if with_norm else ())
  else:
    head = (_router.router_scores(x, gate_w, cfg).reshape(t, n_group, eg),)
  n_rows, n_slots = (p + t, p + 1) if has_shared else (p, p)
  kern = functools.partial(
      _scatter_kernel if cfg.segments == "scatter" else _segments_kernel, t=t, tp=tp, d=d, g=n_group, eg=eg, topk_group=topk_group, top_k=top_k,
      ap=_pow2(top_k), scale=float(routed_scaling_factor), norm=norm_topk_prob, has_shared=has_shared,
      rows_per_seq=rows_per_seq if live_rows is not None else 0, block_k=cfg.block_k, from_x=from_x,
      rms_eps=float(eps) if with_norm else None)
  live = () if live_rows is None else (live_rows.astype(jnp.int32),)
  i32 = jnp.int32
  out = pl.pallas_call(
      kern, grid=(1,),
      out_shape=(jax.ShapeDtypeStruct((t, top_k), i32), jax.ShapeDtypeStruct((t, top_k), jnp.float32),
                 jax.ShapeDtypeStruct((p,), i32), jax.ShapeDtypeStruct((3, n_slots), i32),
                 jax.ShapeDtypeStruct((n_rows,), i32), jax.ShapeDtypeStruct((n_rows,), jnp.float32))
                + ((jax.ShapeDtypeStruct((t, d), xn_dtype),) if with_norm else ()),
      compiler_params=_launch(cfg, t, from_x, with_norm),
      interpret=cfg.interpret, name="router_segments",
  )(*head, expert_bias.astype(jnp.float32).reshape(n_group, eg), *live)
  return RoutedSegments(*out)
