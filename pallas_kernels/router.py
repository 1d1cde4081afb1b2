"""MoE router (DeepSeek-V3 noaux_tc, sigmoid scores, grouped top-k): XLA reference + Pallas (Triton).

Shape legend: T tokens (T' padded to a power of 2, >= 16), D hidden, E experts, G groups
(n_group), EG = E / G experts per group, A experts per token (top_k), BE/BK gate tiles.

  logits = x @ gate_w.T                      (fp32 accumulation)
  s  = sigmoid(logits);  sb = s + expert_bias          # the bias only selects
  group score = sum of the top-2 sb in each of G groups; keep the top topk_group groups
  ids = top_k(sb masked to -inf outside kept groups);  w = s[ids]
  w = w / (sum w + 1e-20) * routed_scaling_factor      (if norm_topk_prob)

Pallas version (`route`), two launches (a one-launch version would need a grid-wide sync:
the 2.6 MB gate matvec wants many CTAs, the top-k wants all E scores of a token in one):
  1. `router_scores`, grid (E/BE): s[T, BE tile] = sigmoid(x @ gate_w[tile].T), fp32.
  2. `router_topk`, grid (T,): per token, on the [G, EG] score tile: group top-2 sums, keep
     topk_group groups, top_k over the kept experts by repeated argmax, normalised weights.
Tie rule (same as lax.top_k, which returns the lower index first among equal values): every
selection (the top-2 inside a group, the kept groups, the final experts) takes the LOWEST
index among equal values; ids come out in descending score order.
Numerics: sigmoid is 1 / (1 + exp(-z)) (Triton has no logistic); the matvec's fp32 sum order
differs from XLA's, so ids can differ from `route_reference` only on scores tied within
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


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k",
                                             "routed_scaling_factor", "norm_topk_prob"))
def route_reference(x, gate_w, expert_bias, *, n_group, topk_group, top_k,
                    routed_scaling_factor, norm_topk_prob=True):
  """x [T, D], gate_w [E, D], expert_bias [E] f32 -> (ids [T, A] int32, weights [T, A] f32)."""
  t = x.shape[0]
  e = gate_w.shape[0]
  logits = jnp.einsum("td,ed->te", x, gate_w, preferred_element_type=jnp.float32)  # [T, E]
  s = jax.nn.sigmoid(logits)
  sb = s + expert_bias.astype(jnp.float32)[None, :]
  grouped = sb.reshape(t, n_group, e // n_group)                      # [T, G, E/G]
  group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)                  # [T, G]
  _, keep = jax.lax.top_k(group_score, topk_group)                    # [T, topk_group]
  group_mask = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
  masked = jnp.where(jnp.repeat(group_mask, e // n_group, axis=1), sb, -jnp.inf)
  _, ids = jax.lax.top_k(masked, top_k)                               # [T, A]
  w = jnp.take_along_axis(s, ids, axis=1)
  if norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  return ids.astype(jnp.int32), w * routed_scaling_factor


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """Tiling for the Triton router.

  Attributes:
    block_e: experts per program of the score kernel (grid = E / block_e); >= 16 (tl.dot).
    block_k: reduction tile over D.
    num_warps, num_stages: Triton launch parameters of the score kernel.
    topk_warps: num_warps of the per-token top-k kernel.
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_e: int = 16
  block_k: int = 256
  num_warps: int = 4
  num_stages: int = 4
  topk_warps: int = 2
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_e", "block_k"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of 2 >= 16")

  def check(self, d, e, n_group, topk_group, top_k):
    if d % self.block_k or e % self.block_e:
      raise ValueError(f"block_k={self.block_k} must divide D={d} and block_e={self.block_e} "
                       f"must divide E={e}")
    eg = e // n_group if e % n_group == 0 else 0
    if not eg or eg & (eg - 1) or n_group & (n_group - 1) or eg < 2:
      raise ValueError(f"E={e} / n_group={n_group} must give a power-of-2 group size >= 2 "
                       "with a power-of-2 n_group")
    if not (1 <= topk_group <= n_group and 1 <= top_k <= topk_group * eg):
      raise ValueError(f"topk_group={topk_group}, top_k={top_k} out of range for "
                       f"n_group={n_group}, E={e}")


def _scores_kernel(x_ref, g_ref, s_ref, *, t, tp, cfg, d):
  """s[:, tile] = sigmoid(x @ gate_w[tile].T): [T', BK] x [BE, BK] tiles, fp32 accumulate."""
  be, bk = cfg.block_e, cfg.block_k
  e0 = pl.program_id(0) * be
  rows = lax.broadcasted_iota(jnp.int32, (tp, 1), 0) < t               # [T', 1]
  prec = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

  def k_step(kb, acc):
    xb = plt.load(x_ref.at[pl.ds(0, tp), pl.ds(kb * bk, bk)],
                  mask=jnp.broadcast_to(rows, (tp, bk)), other=0.0)
    gb = g_ref[pl.ds(e0, be), pl.ds(kb * bk, bk)]                      # [BE, BK]
    return acc + plt.dot(xb, gb, trans_b=True, precision=prec)

  logits = lax.fori_loop(0, d // bk, k_step, jnp.zeros((tp, be), jnp.float32))
  s = 1.0 / (1.0 + jnp.exp(-logits))
  plt.store(s_ref.at[pl.ds(0, tp), pl.ds(e0, be)], s, mask=jnp.broadcast_to(rows, s.shape))


def _argmax_lowest(v, idx, big):
  """(max value, lowest index among the maxima) of v with index array idx (same shape)."""
  red = lambda a, f: f(a, axis=0) if a.ndim == 1 else f(f(a, axis=1), axis=0)
  m = red(v, jnp.max)
  return m, red(jnp.where(v == m, idx, big), jnp.min)


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
  w = jnp.zeros((ap,), jnp.float32)
  for k in range(top_k):                                                # final experts
    m = jnp.max(jnp.max(jnp.where(taken, -jnp.inf, masked), axis=1), axis=0)
    hit = jnp.where(~taken & (masked == m), flat, g * eg)
    idx = jnp.min(jnp.min(hit, axis=1), axis=0)
    pick = flat == idx
    taken = taken | pick
    wk = jnp.sum(jnp.sum(jnp.where(pick, s, 0.0), axis=1), axis=0)
    ids = jnp.where(slot == k, idx, ids)
    w = jnp.where(slot == k, wk, w)
  if norm:
    w = w / (jnp.sum(w) + 1e-20)
  live = slot < top_k
  plt.store(ids_ref.at[t, pl.ds(0, ap)], ids, mask=live)
  plt.store(w_ref.at[t, pl.ds(0, ap)], w * scale, mask=live)


@functools.partial(jax.jit, static_argnames=("n_group", "topk_group", "top_k",
                                             "routed_scaling_factor", "norm_topk_prob",
                                             "config"))
def route(x, gate_w, expert_bias, *, n_group, topk_group, top_k, routed_scaling_factor,
          norm_topk_prob=True, config=None):
  """Pallas (Triton) router; same signature and result as `route_reference` (+ config)."""
  cfg = config or RouterConfig()
  t, d = x.shape
  e = gate_w.shape[0]
  assert gate_w.shape == (e, d) and expert_bias.shape == (e,), (x.shape, gate_w.shape,
                                                                 expert_bias.shape)
  cfg.check(d, e, n_group, topk_group, top_k)
  tp = max(16, 1 << (t - 1).bit_length())
  eg = e // n_group
  scores = pl.pallas_call(
      functools.partial(_scores_kernel, t=t, tp=tp, cfg=cfg, d=d), grid=(e // cfg.block_e,),
      out_shape=jax.ShapeDtypeStruct((t, e), jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="router_scores",
  )(x, gate_w)
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
