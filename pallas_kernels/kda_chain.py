"""The KDA chain of one layer in ONE kernel (decode / verify, T <= 17 rows): short conv + SiLU, l2norm, lower-bound
gate, beta, the delta rule over the T rows and the output epilogue (RMSNorm over V, o_norm, sigmoid(g) gate), so
the kernel hands o_proj a ready [B, T, H*V] in the activation dtype. Optionally it first replays the previous
step's pending rows (the NEXTN commit folded into the next verify) or advances the state over its own rows (decode).

Shape legend: B batch, T new rows, Tp pending rows of the previous verify, H heads, K = V head dims (one stream
layout, so V = K), C = H*K channels of a stream, W conv width (4), act the activation dtype (proj's dtype).

Math per head, the model's own (ling_jax/layers/kda.py: kda_project, kda_recurrent, kda_output, kda_commit), with
the model's rounding points written once here as R(.) = round to act and back to fp32:
  window  = R(conv_window)                                     [W-1 rows per stream]
  q|k|v_t = R(silu(sum_j w[c, j] xcat_{t+j}))                 xcat = concat(window, raw rows of stream q|k|v)
  qn_t    = R(q_t rsqrt(|q_t|^2 + 1e-6)) K^-0.5,   kn_t = R(k_t rsqrt(|k_t|^2 + 1e-6))
  g_t     = lb sigmoid(exp(A_log[h]) (f_t + dt_bias)),  beta_t = sigmoid(b_t)
  S       = diag(exp g_t) S;   S = S + (beta_t kn_t) (v_t - S^T kn_t)^T;   o_t = S^T qn_t      (fp32, S [K, V])
  out_t   = act((R(o_t) rsqrt(mean_V R(o_t)^2 + eps)) o_norm sigmoid(gate_t))                 -> o_proj
Pending replay (folded commit): rows tp < n_prev of the previous verify are replayed from the stored base state with
the model's no-op mask (g = 0, beta = 0 past n_prev: S unchanged, exactly), and the conv window slides by n_prev.

Schemes and the bytes each moves per KDA layer (|S| = H K V 4 = 32 x 128 x 128 x 4 B = 2.1 MB at B = 1; the rows,
weights and window are < 0.3 MB at T = 17):
  verify + commit (today): verify reads S (|S|); the commit reads S and writes it (2|S|): 3|S| = 6.3 MB, 2 kernels
    (+ XLA's kda_output kernels and the window slide). DecodeState carries S, the window and nothing else.
  folded (pending=..., n_prev=...): one kernel reads S, replays, writes the new base once and runs the new rows on
    the in-register state: 2|S| = 4.2 MB, 1 kernel. The model must carry to the next step, per KDA layer: the
    pending rows (qkv_raw [B, Tp, 3, C] act, or the whole proj [B, Tp, 5, C]; k, g [B, Tp, H, K] f32,
    v [B, Tp, H, V] f32, beta [B, Tp, H] f32: 0.44 MB at Tp = 6) and n_prev [B] (the accept count of the step
    that produced them; 0 when there is nothing to commit). Every reader of S (prefill, plain decode, draft
    rollback) must first apply the pending rows: the stored S is one step behind.
  advance=True (plain decode, T = 1): verify + commit + window in one kernel, 2|S|, the same serial row math as
    verify (so a plain decode row equals the verify row bitwise, unlike kda_decode's S^T(e q) + u (k.q) form).

Tiling: grid (B, H); one program owns a head's whole [K, V] state, because the RMSNorm over V needs the whole row
of o_t and Triton programs cannot exchange partial sums (no grid sync, no cluster shared memory in Pallas Triton).
The 128 x 128 fp32 tile is 64 KB of registers: 128 regs/thread at 4 warps, 64 at 8, 32 at 16. Register use,
measured on CPU by compiling this kernel's TTIR (captured at jax's lowering) with pip Triton 3.8 + its ptxas for
sm_90 (XLA's own Triton and ptxas may allocate differently), full Ling shapes, prefetch 2:
    T = 6,  8 warps: 128 regs + 2.6 KB stack (255 regs + 1.8 KB when ptxas is given .maxnreg 255)
    T = 6, 16 warps:  64 regs + 1.5 KB stack (128 regs + 1.0 KB with .maxnreg 128)
    T = 17, 8 warps: 128 regs + 2.7 KB stack (all loads first instead of prefetch: 6.6 KB)
    (kda_verify bv32w4 for comparison: T = 6 128 regs, T = 17 255 regs, no stack)
So the kernel spills. The cause, read from the TTGIR: Triton lays the state out with V across the 32 lanes and K
across the warps, and places the loads of the q/k conv weights, window and raw rows directly in the state's
K-slice layout (16 values per thread at 8 warps, replicated across lanes) to avoid layout conversions; the ~30
such [K] rows cost ~8-16 registers each. The same layout makes each S^T k / S^T q a cross-warp reduction through
shared memory (107 bar.sync at T = 6, as many as kda_verify). Next levers, in order: keep the position-parallel
q/k math in a compact layout (e.g. the W conv rows as one [W, K] tile reduced over W), or store the state as
[B, H, V, K] so that lanes run along K and both reductions become warp shuffles (a model-wide layout change).
Every load is issued before the first store that could alias it (a load after a store may alias, so the compiler
would put a global round trip on the serial chain; see kda_verify.py): row t + prefetch is loaded at step t, the
rest at the top. Only 32 programs run at B = 1 (32 of 132 SMs): each step is ~4 flops on each of 16384 state
elements per SM, against kda_verify's 128 programs of [K, 32] tiles (7.5 us at T = 6). Whether the removed
kernels (kda_output's XLA kernels, the commit) pay for 4x fewer SMs is the bench's question
(python3 -m bench.kernels_kda_chain).

Backend: Triton (Pallas `plt`), not Mosaic GPU. The chain is a serial recurrence of elementwise ops and reductions
over K on a register tile, with nothing for TMA or wgmma to do (T <= 17 rows is below a 64-row wgmma tile; the
chunked tensor-core form measured 2-3x slower, bench/KERNEL_NOTES.md). In Mosaic GPU (jax 0.11.2) the same code
needs a warpgroup array layout in which both the K reduction and the broadcasts of [K] and [V] vectors along both
axes lower, and splitting the 64 KB tile over several warpgroups needs a hand-written shared-memory reduction for
the V norm; Triton picks those layouts itself, and kda_verify's serial kernel of the same structure runs on the
H200 today. Cost: Pallas Triton has no PDL hook (no griddepcontrol), so this kernel cannot overlap its state load
with the previous kernel's tail; the producer-independent loads (state, weights, window) are simply issued first.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda_verify import L2_EPS, KdaCommitInputs, _round, _sigmoid


@dataclasses.dataclass(frozen=True)
class KdaChainConfig:
  """Attributes:
    num_warps: Triton warps of the one program per (b, h); 8 keeps the [K, V] state at 64 registers per thread.
    prefetch: new rows whose loads run ahead of the serial step (>= T: every load before the first step).
    interpret: run in the Pallas interpreter (CPU tests).
  """
  num_warps: int = 8
  prefetch: int = 2
  interpret: bool = False

  def __post_init__(self):
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
    if self.prefetch < 1:
      raise ValueError(f"prefetch={self.prefetch}: new rows loaded ahead of the serial step, >= 1")


class KdaChainOut(NamedTuple):
  """Attributes:
    o: [B, T, H*V] act, the gated, normed output rows (o_proj's input).
    commit: KdaCommitInputs of the T new rows (k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], f32): the next
      step's pending rows (with proj[:, :, :3] as their qkv_raw), or kda_commit's inputs.
    rec_state: [B, H, K, V] f32 written in place of the input state: after the pending replay (folded) or after the
      new rows (advance); None when the kernel writes no state (plain verify).
    conv_window: [B, W-1, 3, C] written in place, at the same point as rec_state; None with it.
  """
  o: jax.Array
  commit: KdaCommitInputs
  rec_state: jax.Array | None
  conv_window: jax.Array | None


# ----------------------------------------------------------------------------- kernel helpers


def _delta_step(s, k, v, e, beta):
  """diag(e) S, then S + (beta k)(v - S^T k)^T, the model's kda_recurrent step. s [K, V], k, e [K], v [V]."""
  s = s * e[:, None]
  pred = jnp.sum(s * k[:, None], axis=0)                               # S^T k  [V]
  return s + (beta * k)[:, None] * (v - pred)[None, :]


def _committed_window(win_ref, pq_ref, b, n, cols, width, tp_len, act):
  """Rows n .. n+W-2 of xcat = concat(window, pending raw), per stream: 3 lists of W-1 rows [K] act."""
  rows = []
  for st in range(3):
    stream = []
    for i in range(width - 1):
      r = n + i
      from_win = win_ref[b, jnp.clip(r, 0, width - 2), st, cols].astype(act)
      from_raw = pq_ref[b, jnp.clip(r - (width - 1), 0, tp_len - 1), st, cols].astype(act)
      stream.append(jnp.where(r < width - 1, from_win, from_raw))
    rows.append(stream)
  return rows


def _store_window(wo_ref, b, cols, window):
  for st, rows in enumerate(window):
    for i, row in enumerate(rows):
      wo_ref[b, i, st, cols] = row.astype(wo_ref.dtype)


class _Row(NamedTuple):
  """One new row after conv, norms and gates (f32): qn, kn, e = exp(g), g [K]; v [V]; beta scalar; gate [V]."""
  qn: jax.Array
  kn: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array
  gate: jax.Array


def _prepare_row(xq, xk, xv, f, gate, braw, w, a, dtb, kd, lower_bound, act):
  """Conv + SiLU (xq|xk|xv: the W rows xcat_t .. xcat_{t+W-1} [K] act), l2norms, gate and beta of one row."""
  f32 = jnp.float32

  def conv(xs, ws):                                                    # R(silu(sum_j w_j xcat_{t+j}))
    y = ws[0] * xs[0].astype(f32)
    for j in range(1, len(ws)):
      y = y + ws[j] * xs[j].astype(f32)
    return _round(y * _sigmoid(y), act)

  q, k, v = conv(xq, w[0]), conv(xk, w[1]), conv(xv, w[2])
  qn = _round(q * lax.rsqrt(jnp.sum(q * q) + L2_EPS), act) * kd ** -0.5
  kn = _round(k * lax.rsqrt(jnp.sum(k * k) + L2_EPS), act)
  g = lower_bound * _sigmoid(a * (f.astype(f32) + dtb))
  return _Row(qn, kn, v, g, _sigmoid(braw.astype(f32)), gate.astype(f32))


def _chain_kernel(*refs, t_len, tp_len, width, kd, lower_bound, eps, folded, advance, act, prefetch):
  n_in = 8 + (6 if folded else 0)
  proj_ref, b_ref, alog_ref, dtb_ref, cw_ref, onorm_ref, win_ref, s_ref = refs[:8]
  pq_ref, pk_ref, pv_ref, pg_ref, pb_ref, n_ref = refs[8:n_in] if folded else (None,) * 6
  o_ref, ko_ref, vo_ref, go_ref, bo_ref = refs[n_in:n_in + 5]
  so_ref, wo_ref = refs[n_in + 5:] if (folded or advance) else (None, None)
  b, h = pl.program_id(0), pl.program_id(1)
  f32 = jnp.float32
  cols = pl.ds(h * kd, kd)
  # Loads issued before any store cannot alias it: the producer-independent ones (state, weights, window), the
  # pending rows and the first `prefetch` new rows come first; row t + prefetch is loaded at step t, before that
  # step's stores, so its latency hides behind `prefetch` steps and only ~prefetch rows stay live.
  s = s_ref[b, h, :, :]                                                # [K, V] f32
  w = [[cw_ref[st, cols, 0, j].astype(f32) for j in range(width)] for st in range(3)]
  a = jnp.exp(alog_ref[h].astype(f32))
  dtb = dtb_ref[cols].astype(f32)
  w_norm = onorm_ref[:].astype(f32)
  load_row = lambda t: ([proj_ref[b, t, st, cols] for st in range(5)], b_ref[b, t, h])
  rows = {t: load_row(t) for t in range(min(prefetch, t_len))}
  if folded:                                   # the folded commit: replay tp < n_prev (no-op mask past n_prev)
    n = n_ref[b]
    window = _committed_window(win_ref, pq_ref, b, n, cols, width, tp_len, act)
    pend = [(pk_ref[b, t, h, :], pv_ref[b, t, h, :], pg_ref[b, t, h, :], pb_ref[b, t, h]) for t in range(tp_len)]
    for t, (kp, vp, gp, bp) in enumerate(pend):
      live = t < n
      s = _delta_step(s, kp, vp, jnp.where(live, jnp.exp(gp), 1.0), jnp.where(live, bp, 0.0))
    if not advance:                                                    # the new base, written once
      so_ref[b, h, :, :] = s
      _store_window(wo_ref, b, cols, window)
  else:
    window = [[win_ref[b, i, st, cols].astype(act) for i in range(width - 1)] for st in range(3)]
  xcat = [list(rows_) for rows_ in window]                             # per stream: window rows, then raw rows
  for t in range(t_len):
    if t + prefetch < t_len:
      rows[t + prefetch] = load_row(t + prefetch)
    raw, braw = rows.pop(t)
    for st in range(3):
      xcat[st].append(raw[st].astype(act))
    r = _prepare_row(*(x[t:t + width] for x in xcat), raw[3], raw[4], braw, w, a, dtb, kd, lower_bound, act)
    s = _delta_step(s, r.kn, r.v, jnp.exp(r.g), r.beta)
    o = _round(jnp.sum(s * r.qn[:, None], axis=0), act)                # R(S^T qn)  [V]
    o = o * lax.rsqrt(jnp.sum(o * o) / kd + eps)                       # RMSNorm over V, o_norm, sigmoid(gate)
    o_ref[b, t, cols] = (o * w_norm * _sigmoid(r.gate)).astype(o_ref.dtype)
    ko_ref[b, t, h, :] = r.kn
    vo_ref[b, t, h, :] = r.v
    go_ref[b, t, h, :] = r.g
    bo_ref[b, t, h] = r.beta
  if advance:
    so_ref[b, h, :, :] = s
    _store_window(wo_ref, b, cols, [x[-(width - 1):] for x in xcat])


# ----------------------------------------------------------------------------- entry point


def _check(proj, b_raw, A_log, dt_bias, conv_w, o_norm, conv_window, rec_state, pending, n_prev):
  bsz, t, n_streams, c = proj.shape
  h = b_raw.shape[-1]
  kd = c // h
  width = conv_w.shape[-1]
  want = dict(proj=(bsz, t, 5, c), b_raw=(bsz, t, h), A_log=(h,), dt_bias=(c,), conv_w=(3, c, 1, width),
              o_norm=(kd,), conv_window=(bsz, width - 1, 3, c), rec_state=(bsz, h, kd, kd))
  got = dict(proj=proj.shape, b_raw=b_raw.shape, A_log=A_log.shape, dt_bias=dt_bias.shape, conv_w=conv_w.shape,
             o_norm=o_norm.shape, conv_window=conv_window.shape, rec_state=rec_state.shape)
  bad = {name: (got[name], shape) for name, shape in want.items() if got[name] != shape}
  if bad or c % h:
    raise ValueError(f"kda_chain shapes (got, want; K = V = C/H = {c}/{h}): {bad}")
  if rec_state.dtype != jnp.float32:
    raise ValueError(f"rec_state dtype {rec_state.dtype}: the recurrence state is fp32")
  if (pending is None) != (n_prev is None):
    raise ValueError("pending and n_prev come together (the folded commit) or not at all")
  if pending is not None:
    tp = pending.k.shape[1]
    pwant = dict(qkv_raw=(bsz, tp, c), k=(bsz, tp, h, kd), v=(bsz, tp, h, kd), g=(bsz, tp, h, kd),
                 beta=(bsz, tp, h))
    pgot = dict(qkv_raw=(pending.qkv_raw.shape[0], pending.qkv_raw.shape[1], pending.qkv_raw.shape[-1]),
                k=pending.k.shape, v=pending.v.shape, g=pending.g.shape, beta=pending.beta.shape)
    pbad = {name: (pgot[name], shape) for name, shape in pwant.items() if pgot[name] != shape}
    if pbad or pending.qkv_raw.ndim != 4 or pending.qkv_raw.shape[2] < 3 or n_prev.shape != (bsz,):
      raise ValueError(f"kda_chain pending (got, want): {pbad}; qkv_raw {pending.qkv_raw.shape} must be "
                       f"[B, Tp, >=3, C]; n_prev {n_prev.shape} must be [B]")


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "advance", "config"))
def kda_chain(proj, b_raw, A_log, dt_bias, conv_w, o_norm, conv_window, rec_state, *, lower_bound, eps,
              pending=None, n_prev=None, advance=False, config=None) -> KdaChainOut:
  """The KDA chain of one layer: conv, norms, gates, delta rule and output epilogue in one Triton kernel.

  Args:
    proj: [B, T, 5, C] act, the q, k, v, f, g streams of one projection (the model's `w_qkvfg` einsum).
    b_raw: [B, T, H] act (x @ b_proj^T); A_log [H] and dt_bias [C] f32; conv_w [3, C, 1, W]; o_norm [V].
    conv_window: [B, W-1, 3, C] the committed conv inputs; rec_state [B, H, K, V] f32 the committed state
      (donate both when the kernel writes them: the outputs alias them).
    lower_bound, eps: the gate's lower bound and the output RMSNorm's eps (cfg.kda_lower_bound, rms_norm_eps).
    pending: the previous verify's rows (ling_jax.layers.kda.KdaPending: qkv_raw [B, Tp, >=3, C] (proj works:
      streams 0..2 are read), k, g [B, Tp, H, K], v [B, Tp, H, V], beta [B, Tp, H] f32), with n_prev [B] int32
      the accepted count: rows tp < n_prev[b] are committed first (the folded commit).
    advance: also commit the T new rows (plain decode): the state and window are written after them.
  Returns:
    KdaChainOut(o, commit, rec_state, conv_window); rec_state and conv_window are None unless pending or advance.
  """
  cfg = config or KdaChainConfig()
  _check(proj, b_raw, A_log, dt_bias, conv_w, o_norm, conv_window, rec_state, pending, n_prev)
  bsz, t, _, c = proj.shape
  h = b_raw.shape[-1]
  kd = c // h
  width = conv_w.shape[-1]
  folded = pending is not None
  writes = folded or advance
  f32 = jnp.float32
  args = [proj, b_raw, A_log, dt_bias, conv_w, o_norm, conv_window, rec_state]
  tp = 0
  if folded:
    tp = pending.k.shape[1]
    args += [pending.qkv_raw, pending.k.astype(f32), pending.v.astype(f32), pending.g.astype(f32),
             pending.beta.astype(f32), n_prev.astype(jnp.int32)]
  out_shape = [jax.ShapeDtypeStruct((bsz, t, c), proj.dtype),
               jax.ShapeDtypeStruct((bsz, t, h, kd), f32), jax.ShapeDtypeStruct((bsz, t, h, kd), f32),
               jax.ShapeDtypeStruct((bsz, t, h, kd), f32), jax.ShapeDtypeStruct((bsz, t, h), f32)]
  if writes:
    out_shape += [jax.ShapeDtypeStruct(rec_state.shape, f32), jax.ShapeDtypeStruct(conv_window.shape,
                                                                                    conv_window.dtype)]
  kern = functools.partial(_chain_kernel, t_len=t, tp_len=tp, width=width, kd=kd, lower_bound=float(lower_bound),
                           eps=float(eps), folded=folded, advance=advance, act=proj.dtype,
                           prefetch=cfg.prefetch)
  outs = pl.pallas_call(
      kern, grid=(bsz, h), out_shape=tuple(out_shape),
      input_output_aliases={7: 5, 6: 6} if writes else {},
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_chain",
  )(*args)
  o, ko, vo, go, bo = outs[:5]
  state, window = outs[5:] if writes else (None, None)
  return KdaChainOut(o, KdaCommitInputs(ko, vo, go, bo), state, window)
