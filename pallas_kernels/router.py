"""MoE router (DeepSeek-V3 noaux_tc, sigmoid scores, grouped top-k) in Pallas (Triton).

Reference: the model's own ling_jax.layers.moe.router_logits (fp32_weight=False) + route.

Shape legend: T tokens (T' padded to a power of 2, >= 16), D hidden, E experts, G groups
(n_group), EG = E / G experts per group, A experts per token (top_k), BE/BK gate tiles.

  logits = x @ gate_w.T                      (fp32 accumulation)
  s  = sigmoid(logits);  sb = s + expert_bias          # the bias only selects
  group score = sum of the top-2 sb in each of G groups; keep the top topk_group groups
  ids = top_k(sb masked to -inf outside kept groups);  w = s[ids]
  w = w / (sum w + 1e-20) * routed_scaling_factor      (if norm_topk_prob; the sum left to right over the picks)

Pallas version (`route`), two launches (a one-launch version would need a grid-wide sync:
the 2.6 MB gate matvec wants many CTAs, the top-k wants all E scores of a token in one):
  1. `router_scores`, grid (E/BE): s[T, BE tile] = sigmoid(x @ gate_w[tile].T), fp32.
  2. `router_topk`, grid (T,): per token, on the [G, EG] score tile: group top-2 sums, keep
     topk_group groups, top_k over the kept experts by repeated argmax, normalised weights.
The MoE layer's router on the Triton MoE path, with its segment tables and (when the gate is one
score tile) the scores in the same one program, is pallas_kernels/router_segments.py (it reuses
gate_logits, topk_rows / topk_columns and source_rows from here).
Tie rule (same as lax.top_k, which returns the lower index first among equal values): every
selection (the top-2 inside a group, the kept groups, the final experts) takes the LOWEST
index among equal values; ids come out in descending score order.
Numerics: sigmoid is 1 / (1 + exp(-z)) (Triton has no logistic); the matvec's fp32 sum order
differs from XLA's, so ids can differ from the model's `route` only on scores tied within
rounding (not seen on random inputs).
"""
from __future__ import annotations

import dataclasses
import functools
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


SMEM_BYTES = 227 * 1024   # H100/H200 opt-in shared memory per block (232448 B)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """Tiling for the Triton router.

  Attributes:
    block_e: experts per program of the score kernel (grid = E / block_e); >= 16 (tl.dot).
    block_k: reduction tile over D.
    num_warps, num_stages: Triton launch parameters of the score kernel.
    topk_warps: num_warps of the per-token top-k kernel.
    slots_warps: num_warps of router_segments' one-program top-k + table kernels.
    segments: router_segments' program: "onehot" (per pair column [rows, T'] one-hot sums, the K loop
      pipelined) or "scatter" (the K tiles' loads issued at once, the selection as argmaxes, the tables
      stored where they go: router_segments._scatter_kernel); the same outputs bit for bit.
      bench/kernels_moe_router_tables.py times the two.
    segments_warps: num_warps of the "scatter" program per 16 of its rows past the product (T's power of 2)
      where it computes the scores (E == block_e) without the RMSNorm (with it: num_warps, whose layout its row
      sums' order follows; from router_scores' scores: slots_warps).
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_e: int = 16
  block_k: int = 256
  num_warps: int = 4
  num_stages: int = 4
  topk_warps: int = 2
  slots_warps: int = 4
  segments: str = "onehot"
  segments_warps: int = 1
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_e", "block_k"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of 2 >= 16")
    if self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages} must be >= 1")
    if self.segments not in ("onehot", "scatter"):
      raise ValueError(f"segments={self.segments!r}: 'onehot' or 'scatter'")

  def check(self, d, e, n_group, topk_group, top_k, t=None, itemsize=2):
    """The tiles divide the dims, the groups fit the top-k kernels and (given T tokens of `itemsize` bytes) the
    score kernel's SMEM fits an H100/H200 block (not in the interpreter, which has none): a clear error here
    instead of XLA's RESOURCE_EXHAUSTED when the GPU compiles it."""
    if d % self.block_k or e % self.block_e:
      raise ValueError(f"block_k={self.block_k} must divide D={d} and block_e={self.block_e} "
                       f"must divide E={e}")
    check_groups(e, n_group, topk_group, top_k)
    if t is not None and not self.interpret and (smem := self.scores_smem(t, d, itemsize)) > SMEM_BYTES:
      raise ValueError(f"router_scores at T={t} (T'={padded_tokens(t)}), D={d}, E={e}: block_k={self.block_k}, "
                       f"block_e={self.block_e}, num_stages={self.num_stages} need {smem} B of shared memory > "
                       f"{SMEM_BYTES} B per block (H100/H200)")

  def scores_smem(self, t, d, itemsize=2):
    """Shared memory of the score kernel: Triton's pipeliner keeps num_stages copies of the [T', BK] x tile and
    the [BE, BK] gate tile (one copy when D / BK = 1: no loop to pipeline). Checked against Triton's own count
    of the lowered kernel in tests/test_router_smem.py (v2 demo at T = 512: 4 x 67584 = 270336 B)."""
    stages = self.num_stages if d // self.block_k > 1 else 1
    return stages * (padded_tokens(t) + self.block_e) * self.block_k * itemsize


def padded_tokens(t):
  """T' of the score kernel: T padded to a power of 2, >= 16 (tl.dot)."""
  return max(16, 1 << (t - 1).bit_length())


def check_groups(e, n_group, topk_group, top_k):
  """The top-k kernels' group structure: power-of-2 groups of a power-of-2 size >= 2."""
  eg = e // n_group if e % n_group == 0 else 0
  if not eg or eg & (eg - 1) or n_group & (n_group - 1) or eg < 2:
    raise ValueError(f"E={e} / n_group={n_group} must give a power-of-2 group size >= 2 "
                     "with a power-of-2 n_group")
  if not (1 <= topk_group <= n_group and 1 <= top_k <= topk_group * eg):
    raise ValueError(f"topk_group={topk_group}, top_k={top_k} out of range for "
                     f"n_group={n_group}, E={e}")


def gate_logits(x_ref, g_ref, e0, *, t, tp, be, bk, d, x_tile=None):
  """logits [T', BE] = x @ gate_w[e0:e0+BE].T: [T', BK] x [BE, BK] tiles over D, fp32 accumulation; rows >= T
  of x read as 0. x_tile(kb, xb) -> the tile the gate multiplies in place of xb (router_segments: the RMSNorm of
  x's rows)."""
  rows = lax.broadcasted_iota(jnp.int32, (tp, 1), 0) < t               # [T', 1]

  def k_step(kb, acc):
    xb = plt.load(x_ref.at[pl.ds(0, tp), pl.ds(kb * bk, bk)],
                  mask=jnp.broadcast_to(rows, (tp, bk)), other=0.0)
    if x_tile is not None:
      xb = x_tile(kb, xb)
    gb = g_ref[pl.ds(e0, be), pl.ds(kb * bk, bk)]                      # [BE, BK]
    prec = lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None
    return acc + plt.dot(xb, gb, trans_b=True, precision=prec)

  return lax.fori_loop(0, d // bk, k_step, jnp.zeros((tp, be), jnp.float32))


def sigmoid(z):
  """1 / (1 + exp(-z)): Triton has no logistic."""
  return 1.0 / (1.0 + jnp.exp(-z))


def _scores_kernel(x_ref, g_ref, s_ref, *, t, tp, cfg, d):
  """s[:, tile] = sigmoid(x @ gate_w[tile].T): [T', BK] x [BE, BK] tiles, fp32 accumulate."""
  be, bk = cfg.block_e, cfg.block_k
  e0 = pl.program_id(0) * be
  rows = lax.broadcasted_iota(jnp.int32, (tp, 1), 0) < t               # [T', 1]
  s = sigmoid(gate_logits(x_ref, g_ref, e0, t=t, tp=tp, be=be, bk=bk, d=d))
  plt.store(s_ref.at[pl.ds(0, tp), pl.ds(e0, be)], s, mask=jnp.broadcast_to(rows, s.shape))


def _argmax_lowest(v, idx, big):
  """(max value, lowest index among the maxima) of v with index array idx (same shape)."""
  red = lambda a, f: f(a, axis=0) if a.ndim == 1 else f(f(a, axis=1), axis=0)
  m = red(v, jnp.max)
  return m, red(jnp.where(v == m, idx, big), jnp.min)


def normalised_weights(ws, *, scale, norm):
  """The picks' weights ws = [w_0, ..., w_{A-1}] (each [T'] or a scalar: one column per pick, in pick order) ->
  [w_k / (((w_0 + w_1) + ...) + w_{A-1} + 1e-20) * scale] (norm) or [w_k * scale]: the model's rounding points
  (ling_jax.layers.moe.route) and its sum's order (topk_weight_sum: left to right). Elementwise adds of the
  columns, not a reduce over an [T', AP] tile: a reduce's association follows the tile's lane layout, which
  changes with T' and with the program (a row tile of 1 at decode vs 16), so a token's weights would depend on
  the batch it is in. Every router program here (route's per-token kernel, topk_rows, topk_columns) normalises
  through this one function. (On the GPU Triton lowers an f32 `/` to div.full.f32, within 2 ulp of the IEEE
  quotient the model and the interpreter take: elementwise, so the same in every program and at every T.)"""
  if norm:
    den = ws[0]
    for wk in ws[1:]:
      den = den + wk
    den = den + 1e-20
    ws = [wk / den for wk in ws]
  return [wk * scale for wk in ws]


def _topk_kernel(s_ref, b_ref, ids_ref, w_ref, *, g, eg, topk_group, top_k, ap, scale, norm):
  """One token: [G, EG] scores -> ids [A], weights [A] (lowest index wins every tie)."""
  t = pl.program_id(0)
  s = s_ref[t]                                                          # [G, EG] f32
  sb = s + b_ref[...]
  col = lax.broadcasted_iota(jnp.int32, (g, eg), 1)
  flat = lax.broadcasted_iota(jnp.int32, (g, eg), 0) * eg + col        # expert id
  # group score = top-2 sum: the max, plus the max of the rest after removing its first index
  m1 = jnp.max(sb, axis=1)                                              # [G]
  i1 = jnp.min(jnp.where(sb == m1[:, None], col, eg), axis=1)
  m2 = jnp.max(jnp.where(col == i1[:, None], -jnp.inf, sb), axis=1)
  gscore = m1 + m2
  gid = lax.broadcasted_iota(jnp.int32, (g,), 0)
  keep = jnp.zeros((g,), jnp.bool_)
  for _ in range(topk_group):                                           # kept groups
    _, gi = _argmax_lowest(jnp.where(keep, -jnp.inf, gscore), gid, g)
    keep = keep | (gid == gi)
  masked = jnp.where(keep[:, None], sb, -jnp.inf)                       # [G, EG]
  taken = jnp.zeros((g, eg), jnp.bool_)
  slot = lax.broadcasted_iota(jnp.int32, (ap,), 0)
  ids = jnp.zeros((ap,), jnp.int32)
  ws = []
  for k in range(top_k):                                                # final experts
    m = jnp.max(jnp.max(jnp.where(taken, -jnp.inf, masked), axis=1), axis=0)
    hit = jnp.where(~taken & (masked == m), flat, g * eg)
    idx = jnp.min(jnp.min(hit, axis=1), axis=0)
    pick = flat == idx
    taken = taken | pick
    ws.append(jnp.sum(jnp.sum(jnp.where(pick, s, 0.0), axis=1), axis=0))  # one nonzero term: exact
    ids = jnp.where(slot == k, idx, ids)
  w = jnp.zeros((ap,), jnp.float32)
  for k, wk in enumerate(normalised_weights(ws, scale=scale, norm=norm)):
    w = jnp.where(slot == k, wk, w)
  live = slot < top_k
  plt.store(ids_ref.at[t, pl.ds(0, ap)], ids, mask=live)
  plt.store(w_ref.at[t, pl.ds(0, ap)], w, mask=live)


def source_rows(live_ref, *, t, tp, rows_per_seq):
  """[T'] int32: the row whose routing row r takes. Row r = b * Tb + j of sequence b borrows row
  b * Tb + min(j, max(live[b], 1) - 1) (ling_jax.layers.moe.borrow_routing); no live_ref: itself."""
  r = lax.broadcasted_iota(jnp.int32, (tp,), 0)
  if live_ref is None:
    return jnp.where(r < t, r, 0)
  nb = live_ref.shape[0]
  bp = max(2, 1 << (nb - 1).bit_length())
  live = plt.load(live_ref.at[pl.ds(0, bp)], mask=lax.broadcasted_iota(jnp.int32, (bp,), 0) < nb,
                  other=1)
  seq = r // rows_per_seq
  live_r = jnp.sum(jnp.where(seq[:, None] == lax.broadcasted_iota(jnp.int32, (tp, bp), 1),
                             live[None, :], 0), axis=1)                       # live[b] of row r
  src = seq * rows_per_seq + jnp.minimum(r % rows_per_seq, jnp.maximum(live_r, 1) - 1)
  return jnp.where(r < t, src, 0)  # padding rows: any in-bounds row (masked)


def topk_rows(s, b, valid, *, g, eg, topk_group, top_k, ap, scale, norm):
  """_topk_kernel's selection on all rows at once: s [T', G, EG] -> (taken [T', G, EG] bool (rows
  past `valid` none), ids [T', AP] int32, w [T', AP] f32 normalised and scaled). Same ops in the same
  order as _topk_kernel, row by row."""
  tp = s.shape[0]
  sb = s + b[None]
  col = lax.broadcasted_iota(jnp.int32, (tp, g, eg), 2)
  flat = lax.broadcasted_iota(jnp.int32, (tp, g, eg), 1) * eg + col
  m1 = jnp.max(sb, axis=2)                                              # [T', G]
  i1 = jnp.min(jnp.where(sb == m1[:, :, None], col, eg), axis=2)
  m2 = jnp.max(jnp.where(col == i1[:, :, None], -jnp.inf, sb), axis=2)
  gscore = m1 + m2
  gid = lax.broadcasted_iota(jnp.int32, (tp, g), 1)
  keep = jnp.zeros((tp, g), jnp.bool_)
  for _ in range(topk_group):
    masked_g = jnp.where(keep, -jnp.inf, gscore)
    mg = jnp.max(masked_g, axis=1)
    gi = jnp.min(jnp.where(masked_g == mg[:, None], gid, g), axis=1)
    keep = keep | (gid == gi[:, None])
  masked = jnp.where(keep[:, :, None], sb, -jnp.inf)
  taken = jnp.zeros((tp, g, eg), jnp.bool_)
  slot = lax.broadcasted_iota(jnp.int32, (tp, ap), 1)
  ids = jnp.zeros((tp, ap), jnp.int32)
  ws = []
  for k in range(top_k):
    m = jnp.max(jnp.max(jnp.where(taken, -jnp.inf, masked), axis=2), axis=1)
    hit = jnp.where(~taken & (masked == m[:, None, None]), flat, g * eg)
    idx = jnp.min(jnp.min(hit, axis=2), axis=1)                         # [T']
    pick = flat == idx[:, None, None]
    taken = taken | pick
    ws.append(jnp.sum(jnp.sum(jnp.where(pick, s, 0.0), axis=2), axis=1))  # [T'] (one nonzero term: exact)
    ids = jnp.where(slot == k, idx[:, None], ids)
  taken = taken & valid[:, None, None]
  w = jnp.zeros((tp, ap), jnp.float32)
  for k, wk in enumerate(normalised_weights(ws, scale=scale, norm=norm)):
    w = jnp.where(slot == k, wk[:, None], w)
  return taken, ids, w


def topk_columns(s, b, *, g, eg, topk_group, top_k, ap, scale, norm):
  """topk_rows' selection and weights with half its dependent reductions, plus the pairs as columns: s [T', G, EG]
  -> (ids [T', AP] int32, w [T', AP] f32 normalised and scaled, cols: top_k (expert [T'] int32, weight [T'] f32
  = w[:, k]) in pick order). The same values as topk_rows bit for bit: each "max, then the lowest index holding
  it" pair of reductions is one argmax (the lowest index among the maxima: the same tie rule; the maxima are
  finite, every kept group holding finite scores and top_k <= the kept experts), each pick's weight a one-hot
  sum (exact), and the normalisation the same normalised_weights of the same columns (elementwise: the same
  values whatever the row count or the lane layout). The picks run on the [T', E] view of the scores; cols'
  weights are normalised_weights' columns themselves (no reduction over w's lanes to take them out)."""
  tp, e = s.shape[0], g * eg
  sb = s + b[None]
  col = lax.broadcasted_iota(jnp.int32, (tp, g, eg), 2)
  i1 = jnp.argmax(sb, axis=2).astype(jnp.int32)                          # [T', G]
  m1 = jnp.max(sb, axis=2)
  m2 = jnp.max(jnp.where(col == i1[:, :, None], -jnp.inf, sb), axis=2)
  gscore = m1 + m2
  gid = lax.broadcasted_iota(jnp.int32, (tp, g), 1)
  keep = jnp.zeros((tp, g), jnp.bool_)
  for _ in range(topk_group):
    gi = jnp.argmax(jnp.where(keep, -jnp.inf, gscore), axis=1).astype(jnp.int32)
    keep = keep | (gid == gi[:, None])
  masked = jnp.where(keep[:, :, None], sb, -jnp.inf).reshape(tp, e)    # [T', E]
  s_flat = s.reshape(tp, e)
  flat = lax.broadcasted_iota(jnp.int32, (tp, e), 1)
  taken = jnp.zeros((tp, e), jnp.bool_)
  slot = lax.broadcasted_iota(jnp.int32, (tp, ap), 1)
  ids = jnp.zeros((tp, ap), jnp.int32)
  picks, ws = [], []
  for k in range(top_k):
    idx = jnp.argmax(jnp.where(taken, -jnp.inf, masked), axis=1).astype(jnp.int32)   # [T']
    pick = flat == idx[:, None]
    taken = taken | pick
    wk = jnp.sum(jnp.where(pick, s_flat, 0.0), axis=1)                 # one nonzero term: exact
    ids = jnp.where(slot == k, idx[:, None], ids)
    picks.append(idx)
    ws.append(wk)
  ws = normalised_weights(ws, scale=scale, norm=norm)                  # [T'] each: w[:, k]
  w = jnp.zeros((tp, ap), jnp.float32)
  for k, wk in enumerate(ws):
    w = jnp.where(slot == k, wk[:, None], w)
  return ids, w, list(zip(picks, ws))


def router_scores(x, gate_w, cfg):
  """The score launch alone: x [T, D], gate_w [E, D] -> s [T, E] f32 (grid E / block_e)."""
  t, d = x.shape
  return pl.pallas_call(
      functools.partial(_scores_kernel, t=t, tp=padded_tokens(t), cfg=cfg, d=d), grid=(gate_w.shape[0] // cfg.block_e,),
      out_shape=jax.ShapeDtypeStruct((t, gate_w.shape[0]), jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="router_scores",
  )(x, gate_w)


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k",
                                             "routed_scaling_factor", "norm_topk_prob",
                                             "config"))
def route(x, gate_w, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor,
          norm_topk_prob=True, config=None):
  """Pallas (Triton) router: x [T, D], gate_w [E, D], expert_bias [E] f32 -> (ids [T, A] int32, weights [T, A]
  f32), the result of the model's route(router_logits(x, gate_w, fp32_weight=False), expert_bias, cfg)."""
  cfg = config or RouterConfig()
  t, d = x.shape
  e = gate_w.shape[0]
  assert gate_w.shape == (e, d) and expert_bias.shape == (e,), (x.shape, gate_w.shape,
                                                                 expert_bias.shape)
  cfg.check(d, e, n_group, topk_group, top_k, t=t, itemsize=x.dtype.itemsize)
  eg = e // n_group
  scores = router_scores(x, gate_w, cfg)
  ap = 1 << (top_k - 1).bit_length()
  kern = functools.partial(_topk_kernel, g=n_group, eg=eg, topk_group=topk_group, top_k=top_k,
                           ap=ap, scale=float(routed_scaling_factor), norm=norm_topk_prob)
  ids, w = pl.pallas_call(
      kern, grid=(t,),
      out_shape=(jax.ShapeDtypeStruct((t, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((t, top_k), jnp.float32)),
      compiler_params=plt.CompilerParams(num_warps=cfg.topk_warps, num_stages=1),
      interpret=cfg.interpret, name="router_topk",
  )(scores.reshape(t, n_group, eg), expert_bias.astype(jnp.float32).reshape(n_group, eg))
  return ids, w
