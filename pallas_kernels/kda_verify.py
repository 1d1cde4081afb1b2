"""KDA (Kimi Delta Attention) verify + commit: fused conv1d + gates + delta rule, state never written by verify.

Shape legend: B batch, T positions (<= ~17), H heads, Dk = Dv head dims, HD = H*Dk,
W conv kernel (4), BV value tile of one program.

Per position t, per head (all fp32):
  y_t[c] = silu(sum_j w[c, 0, j] * xcat_{t+j}[c])        xcat = concat(conv_state, raw) along time
  q, k   = y / sqrt(sum y^2 + 1e-6);  q *= Dk^-0.5
  g      = lower_bound * sigmoid(exp(A_log[h]) * (f_raw + dt_bias))     [Dk]
  beta   = sigmoid(b_raw[h])
  S      = diag(exp(g)) S                                  S [Dk, Dv], decay on the K rows
  S      = S + beta k (v - S^T k)^T
  o_t    = S^T q
Verify returns o and the per-position (k, v, g, beta) the commit needs; commit replays the
accepted prefix t < n_accept[b] from the pre-verify state (reads S once, writes S once).

Kernels (Triton): grid (B, H, Dv/BV). Each program loads its head's q/k conv window (full Dk,
recomputed by the Dv/BV programs of a head: only raw rows, tiny) and its [Dk, BV] state tile
into registers, then runs the T steps unrolled.
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


class KdaCommitInputs(NamedTuple):
  """What commit needs from verify (fp32).

  Attributes:
    k: [B, T, H, Dk] l2-normalised keys.
    v: [B, T, H, Dv] values (after conv + silu).
    g: [B, T, H, Dk] log-decay (lower_bound * sigmoid(...)), in (lower_bound, 0).
    beta: [B, T, H] write strengths.
  """
  k: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array


@dataclasses.dataclass(frozen=True)
class KdaConfig:
  """Tiling for the Triton KDA kernels.

  Attributes:
    block_v: value columns per program (power of 2 dividing Dv).
    num_warps: Triton warps per program.
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_v: int = 32
  num_warps: int = 4
  interpret: bool = False

  def __post_init__(self):
    if self.block_v <= 0 or self.block_v & (self.block_v - 1):
      raise ValueError(f"block_v={self.block_v} must be a positive power of 2")


# ----------------------------------------------------------------------------- reference


def _conv_silu(raw, state, w):
  """raw [B, T, C], state [B, W-1, C], w [C, 1, W] -> silu(causal depthwise conv) [B, T, C] f32."""
  t = raw.shape[1]
  width = w.shape[-1]
  xcat = jnp.concatenate([state, raw], axis=1).astype(jnp.float32)     # [B, W-1+T, C]
  wf = w[:, 0, :].astype(jnp.float32)                                  # [C, W]
  y = sum(wf[:, j] * xcat[:, j:j + t] for j in range(width))
  return jax.nn.silu(y)


def _l2norm(x):
  return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def kda_prepare(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w,
                v_conv_w, conv_state, *, lower_bound=-5.0):
  """Conv + norms + gates (jnp). Returns q [B,T,H,Dk] (scaled), k, v, g, beta (fp32)."""
  bsz, t, hd = q_raw.shape
  h = b_raw.shape[-1]
  dk = hd // h
  cs_q, cs_k, cs_v = jnp.split(conv_state, 3, axis=-1)
  q = _conv_silu(q_raw, cs_q, q_conv_w).reshape(bsz, t, h, dk)
  k = _conv_silu(k_raw, cs_k, k_conv_w).reshape(bsz, t, h, dk)
  v = _conv_silu(v_raw, cs_v, v_conv_w).reshape(bsz, t, h, -1)
  q = _l2norm(q) * dk ** -0.5
  k = _l2norm(k)
  f = f_raw.astype(jnp.float32).reshape(bsz, t, h, dk) + dt_bias.reshape(h, dk)
  g = lower_bound * jax.nn.sigmoid(jnp.exp(A_log.astype(jnp.float32))[:, None] * f)
  beta = jax.nn.sigmoid(b_raw.astype(jnp.float32))
  return q, k, v, g, beta


def _delta_step(s, k, v, g, beta):
  """s [B,H,Dk,Dv]; k,g [B,H,Dk]; v [B,H,Dv]; beta [B,H] -> new s."""
  s = s * jnp.exp(g)[..., None]                                        # diag(e^g) S
  kv = jnp.einsum("bhkv,bhk->bhv", s, k)                               # S^T k
  return s + jnp.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - kv))


def kda_verify_reference(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w,
                         k_conv_w, v_conv_w, conv_state, rec_state, *, lower_bound=-5.0,
                         config=None):
  """Pure-jnp verify. Inputs: *_raw [B,T,HD] (b_raw [B,T,H]), A_log [H], dt_bias [HD],
  conv weights [HD,1,W], conv_state [B,W-1,3HD], rec_state [B,H,Dk,Dv] f32.
  Returns (o [B,T,H,Dv] f32, KdaCommitInputs)."""
  del config
  q, k, v, g, beta = kda_prepare(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias,
                                 q_conv_w, k_conv_w, v_conv_w, conv_state,
                                 lower_bound=lower_bound)

  def step(s, xs):
    qt, kt, vt, gt, bt = xs
    s = _delta_step(s, kt, vt, gt, bt)
    return s, jnp.einsum("bhkv,bhk->bhv", s, qt)                      # o_t = S^T q

  tm = lambda a: jnp.moveaxis(a, 1, 0)
  _, o = lax.scan(step, rec_state, (tm(q), tm(k), tm(v), tm(g), tm(beta)))
  return jnp.moveaxis(o, 0, 1), KdaCommitInputs(k, v, g, beta)


def kda_commit_reference(rec_state, commit_inputs, n_accept, *, config=None):
  """Replay positions t < n_accept[b] from rec_state [B,H,Dk,Dv]; returns the new state."""
  del config
  k, v, g, beta = commit_inputs

  def step(s, xs):
    t, kt, vt, gt, bt = xs
    keep = (t < n_accept)[:, None, None, None]
    return jnp.where(keep, _delta_step(s, kt, vt, gt, bt), s), None

  tm = lambda a: jnp.moveaxis(a, 1, 0)
  steps = jnp.arange(k.shape[1], dtype=jnp.int32)
  s, _ = lax.scan(step, rec_state, (steps, tm(k), tm(v), tm(g), tm(beta)))
  return s


def conv_window_commit(conv_state, qkv_raw, n_accept):
  """conv_state [B,W-1,C], qkv_raw [B,T,C], n_accept [B] -> last W-1 rows of concat(state, raw[:n])."""
  wm1 = conv_state.shape[1]
  xcat = jnp.concatenate([conv_state, qkv_raw.astype(conv_state.dtype)], axis=1)
  take = lambda xc, n: lax.dynamic_slice_in_dim(xc, n, wm1, axis=0)
  return jax.vmap(take)(xcat, n_accept.astype(jnp.int32))


# ----------------------------------------------------------------------------- kernels


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _conv_rows(raw_ref, cs_ref, w_ref, b, c0, n, cs_off, t_len, width):
  """silu(conv) rows for channels [c0, c0+n) of one stream: list of T arrays [n] f32."""
  cols = pl.ds(c0, n)
  xcat = [cs_ref[b, i, pl.ds(cs_off + c0, n)].astype(jnp.float32) for i in range(width - 1)]
  xcat += [raw_ref[b, t, cols].astype(jnp.float32) for t in range(t_len)]
  w = [w_ref[cols, 0, j].astype(jnp.float32) for j in range(width)]
  out = []
  for t in range(t_len):
    y = w[0] * xcat[t]
    for j in range(1, width):
      y = y + w[j] * xcat[t + j]
    out.append(y * _sigmoid(y))
  return out


def _verify_kernel(q_ref, k_ref, v_ref, f_ref, b_ref, alog_ref, dtb_ref, qw_ref, kw_ref, vw_ref,
                   cs_ref, s_ref, o_ref, ko_ref, vo_ref, go_ref, bo_ref, *, t_len, width, h_n,
                   dk, bv, lower_bound):
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hd = h_n * dk
  c0, v0 = h * dk, h * dk + vb * bv
  qs = _conv_rows(q_ref, cs_ref, qw_ref, b, c0, dk, 0, t_len, width)
  ks = _conv_rows(k_ref, cs_ref, kw_ref, b, c0, dk, hd, t_len, width)
  vs = _conv_rows(v_ref, cs_ref, vw_ref, b, v0, bv, 2 * hd, t_len, width)
  a = jnp.exp(alog_ref[h].astype(jnp.float32))
  dtb = dtb_ref[pl.ds(c0, dk)].astype(jnp.float32)
  # Every load is issued before the recurrence and every store after it: a load placed after a
  # store may alias it (the compiler cannot tell), which would put one global round trip on
  # each of the T serial steps.
  fs = [f_ref[b, t, pl.ds(c0, dk)].astype(jnp.float32) for t in range(t_len)]
  bs = [b_ref[b, t, h].astype(jnp.float32) for t in range(t_len)]
  s = s_ref[b, h, :, pl.ds(vb * bv, bv)]                               # [Dk, BV] f32
  scale = dk ** -0.5
  qn, kn, gs, betas, outs = [], [], [], [], []
  for t in range(t_len):                                               # position-parallel part
    qn.append(qs[t] * lax.rsqrt(jnp.sum(qs[t] * qs[t]) + 1e-6) * scale)
    kn.append(ks[t] * lax.rsqrt(jnp.sum(ks[t] * ks[t]) + 1e-6))
    gs.append(lower_bound * _sigmoid(a * (fs[t] + dtb)))
    betas.append(_sigmoid(bs[t]))
  for t in range(t_len):                                               # the serial recurrence
    k = kn[t]
    s = s * jnp.exp(gs[t])[:, None]                                    # diag(e^g) S
    kv = jnp.sum(s * k[:, None], axis=0)                               # S^T k  [BV]
    s = s + k[:, None] * (betas[t] * (vs[t] - kv))[None, :]
    outs.append(jnp.sum(s * qn[t][:, None], axis=0))                   # o_t = S^T q
  for t in range(t_len):
    o_ref[b, t, h, pl.ds(vb * bv, bv)] = outs[t]
    vo_ref[b, t, h, pl.ds(vb * bv, bv)] = vs[t]

  @pl.when(vb == 0)
  def _():
    for t in range(t_len):
      ko_ref[b, t, h, :] = kn[t]
      go_ref[b, t, h, :] = gs[t]
      bo_ref[b, t, h] = betas[t]


def _commit_kernel(s_ref, n_ref, k_ref, v_ref, g_ref, beta_ref, out_ref, *, t_len, bv):
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(vb * bv, bv)
  s = s_ref[b, h, :, cols]                                             # [Dk, BV]
  n = n_ref[b]
  ks = [k_ref[b, t, h, :] for t in range(t_len)]                       # all loads first
  es = [jnp.exp(g_ref[b, t, h, :]) for t in range(t_len)]
  vs = [v_ref[b, t, h, cols] for t in range(t_len)]
  betas = [beta_ref[b, t, h] for t in range(t_len)]
  for t in range(t_len):
    s_new = s * es[t][:, None]
    kv = jnp.sum(s_new * ks[t][:, None], axis=0)
    s_new = s_new + ks[t][:, None] * (betas[t] * (vs[t] - kv))[None, :]
    s = jnp.where(t < n, s_new, s)
  out_ref[b, h, :, cols] = s


@functools.partial(jax.jit, static_argnames=("lower_bound", "config"))
def kda_verify(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
               conv_state, rec_state, *, lower_bound=-5.0, config=None):
  """Pallas (Triton) verify; same signature and results as `kda_verify_reference`."""
  cfg = config or KdaConfig()
  bsz, t, hd = q_raw.shape
  h = b_raw.shape[-1]
  dk = hd // h
  dv = rec_state.shape[-1]
  width = q_conv_w.shape[-1]
  assert rec_state.shape == (bsz, h, dk, dv) and conv_state.shape == (bsz, width - 1, 3 * hd)
  assert dv % cfg.block_v == 0, (dv, cfg.block_v)
  f32 = jnp.float32
  kern = functools.partial(_verify_kernel, t_len=t, width=width, h_n=h, dk=dk, bv=cfg.block_v,
                           lower_bound=float(lower_bound))
  o, k, v, g, beta = pl.pallas_call(
      kern, grid=(bsz, h, dv // cfg.block_v),
      out_shape=(jax.ShapeDtypeStruct((bsz, t, h, dv), f32),
                 jax.ShapeDtypeStruct((bsz, t, h, dk), f32),
                 jax.ShapeDtypeStruct((bsz, t, h, dv), f32),
                 jax.ShapeDtypeStruct((bsz, t, h, dk), f32),
                 jax.ShapeDtypeStruct((bsz, t, h), f32)),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_verify",
  )(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
    conv_state, rec_state)
  return o, KdaCommitInputs(k, v, g, beta)


@functools.partial(jax.jit, static_argnames=("config",))
def kda_commit(rec_state, commit_inputs, n_accept, *, config=None):
  """Pallas (Triton) commit; same signature and result as `kda_commit_reference`.
  The output aliases rec_state (donate it to update in place)."""
  cfg = config or KdaConfig()
  bsz, h, dk, dv = rec_state.shape
  t = commit_inputs.k.shape[1]
  kern = functools.partial(_commit_kernel, t_len=t, bv=cfg.block_v)
  return pl.pallas_call(
      kern, grid=(bsz, h, dv // cfg.block_v),
      out_shape=jax.ShapeDtypeStruct(rec_state.shape, rec_state.dtype),
      input_output_aliases={0: 0},
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_commit",
  )(rec_state, n_accept.astype(jnp.int32), *commit_inputs)
