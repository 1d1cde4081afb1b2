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
The 128 x 128 fp32 tile is 64 KB of registers: 128 regs/thread at 4 warps (spills), 64 at 8, 32 at 16. ptxas
(Triton 3.8, sm_90, `python3 -m bench.kernels_kda_chain --ptxas`) reports for the default 8 warps: see RESOURCES
below. Every load is issued before the first store (a load after a store may alias it, so the compiler would put a
global round trip on the serial chain; see kda_verify.py). Only 32 programs run at B = 1 (32 of 132 SMs): each
step is ~4 flops on each of 16384 state elements per SM, ~0.3 us per row at one FMA pipe per SM, against
kda_verify's 128 programs of [K, 32] tiles (7.5 us at T = 6). Whether the removed kernels (kda_output's XLA
kernels, the commit kernel) pay for the 4x fewer SMs is the bench's question (bench/kernels_kda_chain.py).

Backend: Triton (Pallas `plt`), not Mosaic GPU. The chain is a serial recurrence of elementwise ops and reductions
over K on a register tile, with nothing for TMA or wgmma to do (T <= 17 rows is below a 64-row wgmma tile; the
chunked tensor-core form measured 2-3x slower, bench/KERNEL_NOTES.md). In Mosaic GPU (jax 0.11.2) the same code
needs a warpgroup array layout in which both the K reduction and the broadcasts of [K] and [V] vectors along both
axes lower, and splitting the 64 KB tile over several warpgroups needs a hand-written shared-memory reduction for
the V norm; Triton picks those layouts itself and the serial kernel it makes is validated on the H200. Cost: Pallas
Triton has no PDL hook (no griddepcontrol), so this kernel cannot overlap its state load with the previous kernel's
tail; the producer-independent loads (state, weights, window) are simply issued first.
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

from pallas_kernels.kda_verify import KdaCommitInputs, _sigmoid

L2_EPS = 1e-6  # ling_jax.layers.norms.l2_normalize's eps (KDA's q and k)


@dataclasses.dataclass(frozen=True)
class KdaChainConfig:
  """Attributes:
    num_warps: Triton warps of the one program per (b, h); 8 keeps the [K, V] state at 64 registers per thread.
    interpret: run in the Pallas interpreter (CPU tests).
  """
  num_warps: int = 8
  interpret: bool = False

  def __post_init__(self):
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")


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


def _round(x, act):
  """R(x): the model's hand-over in the activation dtype."""
  return x.astype(act).astype(jnp.float32)


def _conv_silu_rows(xcat, w, t_len, act):
  """R(silu(sum_j w_j xcat_{t+j})) for t < T: xcat is W-1 + T rows [K] f32, w is W rows [K]."""
  out = []
  for t in range(t_len):
    y = w[0] * xcat[t]
    for j in range(1, len(w)):
      y = y + w[j] * xcat[t + j]
    out.append(_round(y * _sigmoid(y), act))
  return out


def _delta_step(s, k, v, e, beta):
  """diag(e) S, then S + (beta k)(v - S^T k)^T, the model's kda_recurrent step. s [K, V], k, e [K], v [V]."""
  s = s * e[:, None]
  pred = jnp.sum(s * k[:, None], axis=0)                               # S^T k  [V]
  return s + (beta * k)[:, None] * (v - pred)[None, :]


def _committed_window(win_ref, pq_ref, b, n, c0, kd, width, tp_len, act):
  """The W-1 rows of concat(window, pending raw) starting at row n, per stream (3 lists of W-1 rows [K] act)."""
  rows = []
  for s in range(3):
    cols = pl.ds(c0, kd)
    stream = []
    for i in range(width - 1):
      r = n + i                                                        # row of xcat = [window (W-1), raw (Tp)]
      from_win = win_ref[b, jnp.clip(r, 0, width - 2), s, cols].astype(act)
      from_raw = pq_ref[b, jnp.clip(r - (width - 1), 0, tp_len - 1), s, cols].astype(act)
      stream.append(jnp.where(r < width - 1, from_win, from_raw))
    rows.append(stream)
  return rows


def _chain_kernel(*refs, t_len, tp_len, width, kd, lower_bound, eps, folded, advance, act):
  n_in = 8 + (6 if folded else 0)
  proj_ref, b_ref, alog_ref, dtb_ref, cw_ref, onorm_ref, win_ref, s_ref = refs[:8]
  pq_ref, pk_ref, pv_ref, pg_ref, pb_ref, n_ref = refs[8:n_in] if folded else (None,) * 6
  o_ref, ko_ref, vo_ref, go_ref, bo_ref = refs[n_in:n_in + 5]
  so_ref, wo_ref = refs[n_in + 5:] if (folded or advance) else (None, None)
  b, h = pl.program_id(0), pl.program_id(1)
  f32 = jnp.float32
  c0, cols = h * kd, pl.ds(h * kd, kd)
  # ---- every load first (producer-independent ones at the top: state, weights, window)
  s = s_ref[b, h, :, :]                                                # [K, V] f32
  w = [[cw_ref[st, cols, 0, j].astype(f32) for j in range(width)] for st in range(3)]
  a = jnp.exp(alog_ref[h].astype(f32))
  dtb = dtb_ref[cols].astype(f32)
  w_norm = onorm_ref[:].astype(f32)
  if folded:
    n = n_ref[b]
    window = _committed_window(win_ref, pq_ref, b, n, c0, kd, width, tp_len, act)
    pend = [(pk_ref[b, t, h, :], pv_ref[b, t, h, :], pg_ref[b, t, h, :], pb_ref[b, t, h]) for t in range(tp_len)]
  else:
    window = [[win_ref[b, i, st, cols].astype(act) for i in range(width - 1)] for st in range(3)]
  raw = [[proj_ref[b, t, st, cols] for t in range(t_len)] for st in range(5)]   # q, k, v, f, gate streams
  braw = [b_ref[b, t, h].astype(f32) for t in range(t_len)]
  # ---- the folded commit: replay rows tp < n_prev from the base state (no-op mask past n_prev)
  if folded:
    for t, (kp, vp, gp, bp) in enumerate(pend):
      live = t < n
      s = _delta_step(s, kp, vp, jnp.where(live, jnp.exp(gp), 1.0), jnp.where(live, bp, 0.0))
  # ---- the new rows: conv + norms + gates (position-parallel), then the serial delta rule
  q, k, v = (_conv_silu_rows([x.astype(f32) for x in window[st]] + [r.astype(f32) for r in raw[st]], w[st],
                             t_len, act) for st in range(3))
  qn = [_round(x * lax.rsqrt(jnp.sum(x * x) + L2_EPS), act) * kd ** -0.5 for x in q]
  kn = [_round(x * lax.rsqrt(jnp.sum(x * x) + L2_EPS), act) for x in k]
  g = [lower_bound * _sigmoid(a * (f.astype(f32) + dtb)) for f in raw[3]]
  beta = [_sigmoid(x) for x in braw]
  if folded and not advance:                                           # the new base, once
    so_ref[b, h, :, :] = s
    _store_window(wo_ref, b, cols, window, width)
  outs = []
  for t in range(t_len):
    s = _delta_step(s, kn[t], v[t], jnp.exp(g[t]), beta[t])
    outs.append(jnp.sum(s * qn[t][:, None], axis=0))                   # o_t = S^T qn_t  [V]
  if advance:
    so_ref[b, h, :, :] = s
    _store_window(wo_ref, b, cols, [(window[st] + raw[st])[-(width - 1):] for st in range(3)], width)
  # ---- epilogue: RMSNorm over V, o_norm, sigmoid(gate); the commit inputs of the new rows
  for t in range(t_len):
    o = _round(outs[t], act)
    o = o * lax.rsqrt(jnp.sum(o * o) / kd + eps)
    o = o * w_norm * _sigmoid(raw[4][t].astype(f32))
    o_ref[b, t, cols] = o.astype(o_ref.dtype)
    ko_ref[b, t, h, :] = kn[t]
    vo_ref[b, t, h, :] = v[t]
    go_ref[b, t, h, :] = g[t]
    bo_ref[b, t, h] = beta[t]


def _store_window(wo_ref, b, cols, window, width):
  for st in range(3):
    for i in range(width - 1):
      wo_ref[b, i, st, cols] = window[st][i].astype(wo_ref.dtype)


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
                           eps=float(eps), folded=folded, advance=advance, act=proj.dtype)
  outs = pl.pallas_call(
      kern, grid=(bsz, h), out_shape=tuple(out_shape),
      input_output_aliases={7: 5, 6: 6} if writes else {},
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_chain",
  )(*args)
  o, ko, vo, go, bo = outs[:5]
  state, window = outs[5:] if writes else (None, None)
  return KdaChainOut(o, KdaCommitInputs(ko, vo, go, bo), state, window)
