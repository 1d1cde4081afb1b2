"""Routed + shared MoE: a Pallas (Triton) kernel pair that reads only the activated experts.

Shape legend: T tokens, D hidden, A experts per token, E experts, I expert width,
P = T*A (token, expert) pairs, S = P (+ T rows for the shared expert) segment slots,
M rows per block inside one expert segment.

Math (per token t, chosen experts e_a with weights w_a, clamp L > 0 only when on):
  g = x @ w_gate[e].T ; u = x @ w_up[e].T                  (fp32 accumulate)
  h = silu(min(g, L)) * clip(u, -L, L)                      (routed)
  h = min(silu(g), Ls) * clip(u, -Ls, Ls)                   (shared)
  out[t] = sum_a w_a * (h_a @ w_down[e_a].T) + shared(x_t)  (fp32, returned in x.dtype)

Kernel plan (no host sync, no limit on E):
  1. on device, argsort the P pairs by expert id; each run of equal ids is a segment;
     segment s has (start, length, expert) and its rows xs[start:start+len] = x[token];
  2. `_up_kernel`, grid (S, I/BI): each program reads the [BI, D] gate and up tiles of ITS
     segment's expert once, for all the segment's rows, and writes h = SwiGLU(+clamp) [M, BI];
  3. `_down_kernel`, grid (S, D/BD): reads the [BD, I] down tile once, scales each row by its
     routing weight and writes y[row] (fp32);
  4. combine: out[t] = sum_a y[pos(t, a)] (+ shared row), one XLA gather-sum fusion.
The shared expert rides as one extra segment (all T tokens, weight 1) when Is == I.
Empty segment slots (fewer distinct experts than P) exit without loading anything.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """Tiling for the Triton MoE kernels.

  Attributes:
    block_m: rows (pairs of one expert) per block; >= 16 for tl.dot.
    block_i: expert-width tile of the up kernel (output columns of gate/up).
    block_k: reduction tile over D in the up kernel.
    block_d: output tile over D in the down kernel.
    block_kd: reduction tile over I in the down kernel.
    num_warps, num_stages: Triton launch parameters.
    interpret: run the kernels in the Pallas interpreter (CPU tests).
  """
  block_m: int = 16
  block_i: int = 32
  block_k: int = 256
  block_d: int = 64
  block_kd: int = 256
  num_warps: int = 4
  num_stages: int = 4
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_m", "block_i", "block_k", "block_d", "block_kd"):
      v = getattr(self, name)
      if v <= 0 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a positive power of 2")
    if self.block_m < 16:
      raise ValueError(f"block_m={self.block_m} must be >= 16 (tl.dot minimum)")

  def check(self, d: int, i: int):
    for name, blk, dim in (("block_i", self.block_i, i), ("block_k", self.block_k, d),
                           ("block_d", self.block_d, d), ("block_kd", self.block_kd, i)):
      if dim % blk:
        raise ValueError(f"{name}={blk} must divide {dim}")


# ----------------------------------------------------------------------------- reference


def _swiglu(g, u, limit, shared):
  """g, u fp32 -> h fp32 with the routed (clamp g before silu) or shared clamp."""
  if limit > 0:
    if shared:
      return jnp.minimum(jax.nn.silu(g), limit) * jnp.clip(u, -limit, limit)
    return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)
  return jax.nn.silu(g) * u


def _dense_expert(x, wg, wu, wd, limit, shared):
  """x [T, D], wg/wu [I, D], wd [D, I] -> [T, D] fp32."""
  g = jnp.einsum("td,id->ti", x, wg, preferred_element_type=jnp.float32)
  u = jnp.einsum("td,id->ti", x, wu, preferred_element_type=jnp.float32)
  h = _swiglu(g, u, limit, shared).astype(x.dtype)
  return jnp.einsum("ti,di->td", h, wd, preferred_element_type=jnp.float32)


def moe_reference(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, limit=0.0,
                  shared=None, shared_limit=0.0, config=None):
  """Pure-jnp MoE (gathers the selected experts' weights: small T only).

  x [T, D]; topk_ids [T, A] int32; topk_weights [T, A] f32; w_gate/w_up [E, I, D];
  w_down [E, D, I]; shared = (sw_gate [Is, D], sw_up [Is, D], sw_down [D, Is]) or None.
  Returns [T, D] in x.dtype.
  """
  del config
  wg, wu, wd = w_gate[topk_ids], w_up[topk_ids], w_down[topk_ids]      # [T, A, I, D] ...
  g = jnp.einsum("td,taid->tai", x, wg, preferred_element_type=jnp.float32)
  u = jnp.einsum("td,taid->tai", x, wu, preferred_element_type=jnp.float32)
  h = _swiglu(g, u, limit, False).astype(x.dtype)                      # [T, A, I]
  y = jnp.einsum("tai,tadi->tad", h, wd, preferred_element_type=jnp.float32)
  out = jnp.einsum("tad,ta->td", y, topk_weights.astype(jnp.float32))
  if shared is not None:
    out = out + _dense_expert(x, *shared, shared_limit, True)
  return out.astype(x.dtype)


# ----------------------------------------------------------------------------- kernels


def _dot_t(a, b):
  """a [M, K] @ b[N, K].T -> [M, N] fp32 (IEEE for fp32 operands)."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plt.dot(a, b, trans_b=True, precision=prec)


def _up_body(xs_ref, wg, wu, h_ref, start, length, col0, *, cfg, d, limit, shared):
  """h[start:start+length, col0:col0+BI] = SwiGLU(xs @ wg.T, xs @ wu.T).

  wg, wu: callables kb -> [BI, BK] weight tiles of this segment's expert.
  """
  bm, bk = cfg.block_m, cfg.block_k
  rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)

  def m_block(mb, carry):
    r0 = start + mb * bm
    mask = rows + mb * bm < length                                     # [M, 1]

    def k_step(kb, acc):
      ag, au = acc
      xb = plt.load(xs_ref.at[pl.ds(r0, bm), pl.ds(kb * bk, bk)],
                    mask=jnp.broadcast_to(mask, (bm, bk)), other=0.0)
      return ag + _dot_t(xb, wg(kb)), au + _dot_t(xb, wu(kb))

    zero = jnp.zeros((bm, cfg.block_i), jnp.float32)
    g, u = lax.fori_loop(0, d // bk, k_step, (zero, zero))
    h = _swiglu(g, u, limit, shared).astype(h_ref.dtype)
    plt.store(h_ref.at[pl.ds(r0, bm), pl.ds(col0, cfg.block_i)], h,
              mask=jnp.broadcast_to(mask, h.shape))
    return carry

  lax.fori_loop(0, pl.cdiv(length, bm), m_block, 0)


def _up_kernel(seg_ref, xs_ref, wg_ref, wu_ref, *rest, cfg, d, limit, shared_limit,
               n_routed_slots, has_shared):
  if has_shared:
    swg_ref, swu_ref, h_ref = rest
  else:
    (h_ref,) = rest
  s, ib = pl.program_id(0), pl.program_id(1)
  start, length, e = seg_ref[0, s], seg_ref[1, s], seg_ref[2, s]
  col0 = ib * cfg.block_i
  cols, bk = pl.ds(col0, cfg.block_i), cfg.block_k
  body = functools.partial(_up_body, xs_ref, cfg=cfg, d=d)

  @pl.when((s < n_routed_slots) & (length > 0))
  def _routed():
    body(lambda kb: wg_ref[e, cols, pl.ds(kb * bk, bk)],
         lambda kb: wu_ref[e, cols, pl.ds(kb * bk, bk)],
         h_ref, start, length, col0, limit=limit, shared=False)

  if has_shared:
    @pl.when(s == n_routed_slots)
    def _shared():
      body(lambda kb: swg_ref[cols, pl.ds(kb * bk, bk)],
           lambda kb: swu_ref[cols, pl.ds(kb * bk, bk)],
           h_ref, start, length, col0, limit=shared_limit, shared=True)


def _down_body(h_ref, wd, w_ref, y_ref, start, length, col0, *, cfg, i):
  """y[rows, col0:col0+BD] = w[row] * (h[rows] @ wd.T) for one segment."""
  bm, bk = cfg.block_m, cfg.block_kd
  rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)

  def m_block(mb, carry):
    r0 = start + mb * bm
    mask = rows + mb * bm < length

    def k_step(kb, acc):
      hb = plt.load(h_ref.at[pl.ds(r0, bm), pl.ds(kb * bk, bk)],
                    mask=jnp.broadcast_to(mask, (bm, bk)), other=0.0)
      return acc + _dot_t(hb, wd(kb))

    acc = lax.fori_loop(0, i // bk, k_step, jnp.zeros((bm, cfg.block_d), jnp.float32))
    w = plt.load(w_ref.at[pl.ds(r0, bm)], mask=mask[:, 0], other=0.0)   # [M]
    plt.store(y_ref.at[pl.ds(r0, bm), pl.ds(col0, cfg.block_d)], acc * w[:, None],
              mask=jnp.broadcast_to(mask, acc.shape))
    return carry

  lax.fori_loop(0, pl.cdiv(length, bm), m_block, 0)


def _down_kernel(seg_ref, h_ref, w_ref, wd_ref, *rest, cfg, i, n_routed_slots, has_shared):
  if has_shared:
    swd_ref, y_ref = rest
  else:
    (y_ref,) = rest
  s, db = pl.program_id(0), pl.program_id(1)
  start, length, e = seg_ref[0, s], seg_ref[1, s], seg_ref[2, s]
  col0 = db * cfg.block_d
  cols, bk = pl.ds(col0, cfg.block_d), cfg.block_kd
  body = functools.partial(_down_body, h_ref, cfg=cfg, i=i)

  @pl.when((s < n_routed_slots) & (length > 0))
  def _routed():
    body(lambda kb: wd_ref[e, cols, pl.ds(kb * bk, bk)], w_ref, y_ref, start, length, col0)

  if has_shared:
    @pl.when(s == n_routed_slots)
    def _shared():
      body(lambda kb: swd_ref[cols, pl.ds(kb * bk, bk)], w_ref, y_ref, start, length, col0)


# ----------------------------------------------------------------------------- wrapper


def _segments(topk_ids, topk_weights):
  """Sort the P pairs by expert; return (order, seg [3, P] = start/len/expert, w_sorted)."""
  t, a = topk_ids.shape
  p = t * a
  flat = topk_ids.reshape(p).astype(jnp.int32)
  # One single-operand sort: key = expert * P + pair index (stable, unique keys).
  keys = jnp.sort(flat * p + jnp.arange(p, dtype=jnp.int32))
  order = keys % p                                                    # [P] pair index
  e_sorted = keys // p                                                # [P]
  is_start = jnp.concatenate([jnp.ones((1,), bool), e_sorted[1:] != e_sorted[:-1]])
  (starts,) = jnp.nonzero(is_start, size=p, fill_value=p)            # [P], padded with P
  ends = jnp.concatenate([starts[1:], jnp.full((1,), p, starts.dtype)])
  lengths = jnp.where(starts < p, ends - starts, 0)
  experts = e_sorted[jnp.minimum(starts, p - 1)]
  seg = jnp.stack([starts, lengths, experts]).astype(jnp.int32)       # [3, P]
  w_sorted = topk_weights.reshape(p).astype(jnp.float32)[order]
  return order, seg, w_sorted


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "config"))
def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, limit=0.0, shared=None,
        shared_limit=0.0, config=None):
  """Pallas (Triton) MoE; same signature and result as `moe_reference`."""
  cfg = config or MoeConfig()
  t, d = x.shape
  e, i, d2 = w_gate.shape
  a = topk_ids.shape[1]
  assert d2 == d and w_up.shape == w_gate.shape and w_down.shape == (e, d, i), (
      x.shape, w_gate.shape, w_up.shape, w_down.shape)
  cfg.check(d, i)
  if shared is not None and shared[0].shape[0] != i:
    # Shared width differs: run it as its own dense call (weight 1) and add.
    routed = moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, limit=limit, config=cfg)
    sh = _dense_expert(x, *shared, shared_limit, True)
    return (routed.astype(jnp.float32) + sh).astype(x.dtype)

  p = t * a
  order, seg, w_sorted = _segments(topk_ids, topk_weights)
  xs = x[order // a]                                                  # [P, D]
  has_shared = shared is not None
  if has_shared:
    xs = jnp.concatenate([xs, x])                                     # [P + T, D]
    w_sorted = jnp.concatenate([w_sorted, jnp.ones((t,), jnp.float32)])
    seg = jnp.concatenate([seg, jnp.array([[p], [t], [0]], jnp.int32)], axis=1)
  n_slots = seg.shape[1]
  rows = xs.shape[0]
  # Pad rows so every masked [M, *] block stays inside the buffers.
  pad = cfg.block_m
  xs = jnp.pad(xs, ((0, pad), (0, 0)))
  w_sorted = jnp.pad(w_sorted, (0, pad))
  params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)

  up = functools.partial(_up_kernel, cfg=cfg, d=d, limit=float(limit),
                         shared_limit=float(shared_limit), n_routed_slots=p,
                         has_shared=has_shared)
  extra_up = (shared[0], shared[1]) if has_shared else ()
  h = pl.pallas_call(
      up, grid=(n_slots, i // cfg.block_i),
      out_shape=jax.ShapeDtypeStruct((rows + pad, i), x.dtype),
      compiler_params=params, interpret=cfg.interpret, name="moe_up_swiglu",
  )(seg, xs, w_gate, w_up, *extra_up)

  down = functools.partial(_down_kernel, cfg=cfg, i=i, n_routed_slots=p,
                           has_shared=has_shared)
  extra_down = (shared[2],) if has_shared else ()
  y = pl.pallas_call(
      down, grid=(n_slots, d // cfg.block_d),
      out_shape=jax.ShapeDtypeStruct((rows + pad, d), jnp.float32),
      compiler_params=params, interpret=cfg.interpret, name="moe_down_combine",
  )(seg, h, w_sorted, w_down, *extra_down)

  # Combine: pair j (= t*A + a) sits at sorted row inv[j].
  inv = jnp.zeros((p,), jnp.int32).at[order].set(jnp.arange(p, dtype=jnp.int32))
  out = y[inv].reshape(t, a, d).sum(axis=1)                           # [T, D] fp32
  if has_shared:
    out = out + y[p:p + t]
  return out.astype(x.dtype)
