"""KDA (Kimi Delta Attention) verify + commit: fused conv1d + gates + delta rule, state never written by verify.

Shape legend: B batch, T positions (<= ~17), H heads, Dk = Dv head dims, HD = H*Dk,
W conv kernel (4), BV value tile of one program.

Per position t, per head (fp32; R(.) = round to the activation dtype, the raw streams', and back):
  y_t[c] = R(silu(sum_j w[c, 0, j] * xcat_{t+j}[c]))     xcat = concat(conv_state, raw) along time
  q, k   = R(y rsqrt(sum y^2 + 1e-6));  q *= Dk^-0.5
  g      = lower_bound * sigmoid(exp(A_log[h]) * (f_raw + dt_bias))     [Dk]
  beta   = sigmoid(b_raw[h])
  S      = diag(exp(g)) S                                  S [Dk, Dv], decay on the K rows
  S      = S + beta k (v - S^T k)^T
  o_t    = S^T q
Verify returns o and the per-position (k, v, g, beta) the commit needs; commit replays the
accepted prefix t < n_accept[b] from the pre-verify state (reads S once, writes S once).
Reference: the model's own jnp, ling_jax/layers/kda.py (kda_inputs + kda_recurrent for verify, kda_replay for
commit, with its rounding points R above); tests/kernel_oracles.py calls it with these layouts.

Kernels (Triton): grid (B, H, Dv/BV). Each program loads its head's q/k conv window (full Dk,
recomputed by the Dv/BV programs of a head: only raw rows, tiny) and its [Dk, BV] state tile.
  algorithm="serial" (v2, default): the T steps unrolled on the register tile, two reductions
    over Dk each.
  algorithm="chunk": the UT / WY form over all T positions at once (see the comment above
    `_chunk_solve`): [Tp, Dk] tiles, tl.dot for every state product, a [Tp, Tp] triangular
    inverse; Tp = max(16, 2^ceil(log2 T)). Slower on H200 as written (Triton), kept to compare.
The fused T = 1 decode (verify + commit + conv window in one kernel) is in kda_decode.py.
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

L2_EPS = 1e-6  # ling_jax.layers.norms.l2_normalize's eps (KDA's q and k)


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
    algorithm: "serial" (v2: T unrolled register steps; the default, fastest measured on H200:
      verify 7.5 / 39 us at T = 6 / 17 with bv32w4) or "chunk" (UT form: the T steps as
      [Tp, Dk] @ [Dk, BV] dots and a [Tp, Tp] triangular inverse, Tp = max(16, 2^ceil(log2 T));
      measured 24.5 / 80 us, see bench/results/kernels-kda-h200-2026-11-30.json).
    precision: fp32 dot algorithm of the chunk kernels: "tf32x3" (tensor cores, ~fp32) or "ieee".
  """
  block_v: int = 32
  num_warps: int = 4
  interpret: bool = False
  algorithm: str = "serial"
  precision: str = "tf32x3"

  def __post_init__(self):
    if self.block_v <= 0 or self.block_v & (self.block_v - 1):
      raise ValueError(f"block_v={self.block_v} must be a positive power of 2")
    if self.algorithm not in ("chunk", "serial"):
      raise ValueError(f"algorithm={self.algorithm!r}: 'chunk' (UT form, dots) or 'serial' (v2)")
    if self.precision not in ("tf32x3", "ieee"):
      raise ValueError(f"precision={self.precision!r}: 'tf32x3' or 'ieee' (fp32 dots)")


# ----------------------------------------------------------------------------- kernels


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _round(x, act):
  """R(x): the model's hand-over in the activation dtype (ling_jax.layers.kda.kda_inputs): round, back to fp32."""
  return x.astype(act).astype(jnp.float32)


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
    out.append(_round(y * _sigmoid(y), raw_ref.dtype))
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
  scale, act = dk ** -0.5, q_ref.dtype
  qn, kn, gs, betas, outs = [], [], [], [], []
  for t in range(t_len):                                               # position-parallel part
    qn.append(_round(qs[t] * lax.rsqrt(jnp.sum(qs[t] * qs[t]) + L2_EPS), act) * scale)
    kn.append(_round(ks[t] * lax.rsqrt(jnp.sum(ks[t] * ks[t]) + L2_EPS), act))
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


# ----------------------------------------------------------------------------- chunked (UT) kernels
#
# Per head, with G_t = sum_{i<=t} g_i (cumulative log decay, [Tp, Dk]) and u_t the delta-rule write
# (S_t = diag(e^g_t) S_{t-1} + k_t u_t^T):
#   u_t  = beta_t (v_t - S_0^T (e^G_t k_t) - sum_{i<t} A_ti u_i),   A_ti = k_t . (e^(G_t - G_i) k_i)
#     <=> (I + diag(beta) A) U = diag(beta) (V - (e^G k) S_0)      a unit lower-triangular [Tp, Tp] solve
#   o_t  = S_0^T (e^G_t q_t) + sum_{i<=t} M_ti u_i,                M_ti = q_t . (e^(G_t - G_i) k_i)
#   S_n  = diag(e^G_{n-1}) S_0 + sum_{i<n} (e^(G_{n-1} - G_i) k_i) u_i^T
# Every product with the state is a [Tp, Dk] @ [Dk, BV] dot; the only serial part is the triangular
# inverse, done by recursive block doubling (log2 Tp levels of two [Tp, Tp] dots, each level inverting
# 2b-blocks from the b-block inverses: X <- X - X Off X), which is as stable as forward substitution.
# Rows t >= T are padding: k = q = v = g = beta = 0 there, so they add nothing.


def _pad_t(t):
  """Tp: rows of the chunk tiles (a power of 2, >= 16 for tl.dot)."""
  return max(16, 1 << (t - 1).bit_length())


def _dot_precision(cfg):
  if cfg.interpret:                       # the CPU interpreter knows no TF32 algorithm
    return lax.Precision.HIGHEST
  return {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
          "ieee": lax.DotAlgorithmPreset.F32_F32_F32}[cfg.precision]


def _mm(a, b, prec, ta=False, tb=False):
  """a @ b (a^T if ta, b^T if tb), fp32."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _iota2(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _conv_tile(raw_ref, cs_ref, w_ref, b, c0, n, cs_off, t_len, tp, width):
  """silu(causal conv) of channels [c0, c0+n) for rows t < Tp (rows >= T are garbage): [Tp, n] f32.

  Row t needs xcat rows t..t+W-1, xcat = [conv window (W-1 rows), raw (T rows)]: each shift j is
  one gather of clipped rows from the window and one from raw, then a select."""
  r, c = _iota2((tp, n), 0), _iota2((tp, n), 1) + c0
  y = None
  for j in range(width):
    src = r + j
    xs = cs_ref[b, jnp.clip(src, 0, width - 2), c + cs_off].astype(jnp.float32)
    xr = raw_ref[b, jnp.clip(src - (width - 1), 0, t_len - 1), c].astype(jnp.float32)
    wj = w_ref[pl.ds(c0, n), 0, j].astype(jnp.float32)
    term = wj[None, :] * jnp.where(src < width - 1, xs, xr)
    y = term if y is None else y + term
  return _round(y * _sigmoid(y), raw_ref.dtype)


def _chunk_prepare(k_ref, v_ref, f_ref, b_ref, alog_ref, dtb_ref, kw_ref, vw_ref, cs_ref, *,
                   b, h, c0, v0, t_len, tp, width, hd, dk, bv, lower_bound):
  """k [Tp, Dk] (l2-normed), v [Tp, BV], g [Tp, Dk], beta [Tp] f32; zero on padding rows."""
  valid = _iota2((tp, 1), 0) < t_len
  k = _conv_tile(k_ref, cs_ref, kw_ref, b, c0, dk, hd, t_len, tp, width)
  v = _conv_tile(v_ref, cs_ref, vw_ref, b, v0, bv, 2 * hd, t_len, tp, width)
  rows = jnp.clip(_iota2((tp, dk), 0), 0, t_len - 1)
  f = f_ref[b, rows, _iota2((tp, dk), 1) + c0].astype(jnp.float32)
  rows1 = jnp.clip(lax.broadcasted_iota(jnp.int32, (tp,), 0), 0, t_len - 1)
  braw = b_ref[b, rows1, h].astype(jnp.float32)
  a = jnp.exp(alog_ref[h].astype(jnp.float32))
  dtb = dtb_ref[pl.ds(c0, dk)].astype(jnp.float32)
  k = jnp.where(valid, _round(k * lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + L2_EPS), k_ref.dtype), 0.0)
  v = jnp.where(valid, v, 0.0)
  g = jnp.where(valid, lower_bound * _sigmoid(a * (f + dtb[None, :])), 0.0)
  beta = jnp.where(valid[:, 0], _sigmoid(braw), 0.0)
  return k, v, g, beta


def _chunk_solve(k, v, g, beta, s0, prec, t_len, tp):
  """U [Tp, BV] (delta-rule writes), G [Tp, Dk] (cumulative log decay), e^G, e^(G - G_m),
  e^(G_m - G) k."""
  r, c = _iota2((tp, tp), 0), _iota2((tp, tp), 1)
  big_g = jnp.cumsum(g, axis=0)                                        # G_t
  # e^(G_t - G_i) = e^(G_t - G_m) e^(G_m - G_i) around the middle row m: no factor leaves
  # e^(+-|lower_bound| T / 2), far from fp32 over/underflow (e^(+-85) would not be).
  g_mid = jnp.sum(jnp.where(_iota2((tp, 1), 0) == (t_len - 1) // 2, big_g, 0.0), axis=0)
  eg_mid = jnp.exp(big_g - g_mid[None, :])
  kinv = k * jnp.exp(g_mid[None, :] - big_g)                           # e^(G_m - G_i) k_i
  n = jnp.where(r > c, beta[:, None] * _mm(k * eg_mid, kinv, prec, tb=True), 0.0)  # diag(b) A
  x = (r == c).astype(jnp.float32)                                     # (I + N)^-1, 1-blocks
  blk = 1
  while blk < t_len:                        # b-blocks -> 2b-blocks; once blk >= T one block holds
                                            # every nonzero of N (rows >= T are zero): done
    off = jnp.where((r // (2 * blk) == c // (2 * blk)) & (r // blk != c // blk), n, 0.0)
    x = x - _mm(_mm(x, off, prec), x, prec)
    blk *= 2
  eg = jnp.exp(big_g)
  rhs = beta[:, None] * (v - _mm(k * eg, s0, prec))                    # diag(beta)(V - e^G k S_0)
  return _mm(x, rhs, prec), big_g, eg, eg_mid, kinv


def _verify_chunk_kernel(q_ref, k_ref, v_ref, f_ref, b_ref, alog_ref, dtb_ref, qw_ref, kw_ref,
                         vw_ref, cs_ref, s_ref, o_ref, ko_ref, vo_ref, go_ref, bo_ref, *, t_len,
                         tp, width, h_n, dk, bv, lower_bound, prec):
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hd = h_n * dk
  c0, v0 = h * dk, h * dk + vb * bv
  s0 = s_ref[b, h, :, pl.ds(vb * bv, bv)]                              # [Dk, BV] f32, issued first
  k, v, g, beta = _chunk_prepare(k_ref, v_ref, f_ref, b_ref, alog_ref, dtb_ref, kw_ref, vw_ref,
                                 cs_ref, b=b, h=h, c0=c0, v0=v0, t_len=t_len, tp=tp, width=width,
                                 hd=hd, dk=dk, bv=bv, lower_bound=lower_bound)
  q = _conv_tile(q_ref, cs_ref, qw_ref, b, c0, dk, 0, t_len, tp, width)
  q = _round(q * lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + L2_EPS), q_ref.dtype) * dk ** -0.5
  q = jnp.where(_iota2((tp, 1), 0) < t_len, q, 0.0)
  u, _, eg, eg_mid, kinv = _chunk_solve(k, v, g, beta, s0, prec, t_len, tp)
  r, c = _iota2((tp, tp), 0), _iota2((tp, tp), 1)
  m = jnp.where(r >= c, _mm(q * eg_mid, kinv, prec, tb=True), 0.0)     # M_ti, i <= t
  o = _mm(q * eg, s0, prec) + _mm(m, u, prec)                          # [Tp, BV]
  rv, cv = _iota2((tp, bv), 0), _iota2((tp, bv), 1) + vb * bv
  plt.store(o_ref.at[b, rv, h, cv], o, mask=rv < t_len)
  plt.store(vo_ref.at[b, rv, h, cv], v, mask=rv < t_len)

  @pl.when(vb == 0)
  def _():
    rk, ck = _iota2((tp, dk), 0), _iota2((tp, dk), 1)
    plt.store(ko_ref.at[b, rk, h, ck], k, mask=rk < t_len)
    plt.store(go_ref.at[b, rk, h, ck], g, mask=rk < t_len)
    r1 = lax.broadcasted_iota(jnp.int32, (tp,), 0)
    plt.store(bo_ref.at[b, r1, h], beta, mask=r1 < t_len)


def _commit_chunk_kernel(s_ref, n_ref, k_ref, v_ref, g_ref, beta_ref, out_ref, *, t_len, tp, dk,
                         bv, prec):
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(vb * bv, bv)
  n = n_ref[b]
  s0 = s_ref[b, h, :, cols]                                            # [Dk, BV]
  rk = _iota2((tp, dk), 0)
  rows = jnp.clip(rk, 0, t_len - 1)
  valid = rk < t_len
  k = jnp.where(valid, k_ref[b, rows, h, _iota2((tp, dk), 1)], 0.0)
  g = jnp.where(valid, g_ref[b, rows, h, _iota2((tp, dk), 1)], 0.0)
  rv = _iota2((tp, bv), 0)
  v = jnp.where(rv < t_len, v_ref[b, jnp.clip(rv, 0, t_len - 1), h, _iota2((tp, bv), 1) + vb * bv],
                0.0)
  r1 = lax.broadcasted_iota(jnp.int32, (tp,), 0)
  beta = jnp.where(r1 < t_len, beta_ref[b, jnp.clip(r1, 0, t_len - 1), h], 0.0)
  u, big_g, _, _, _ = _chunk_solve(k, v, g, beta, s0, prec, t_len, tp)
  g_n = jnp.sum(jnp.where(rk < n, g, 0.0), axis=0)                     # G_{n-1}  [Dk]
  kdec = jnp.where(rk < n, k * jnp.exp(g_n[None, :] - big_g), 0.0)     # e^(G_{n-1} - G_i) k_i
  out_ref[b, h, :, cols] = jnp.exp(g_n)[:, None] * s0 + _mm(kdec, u, prec, ta=True)


@functools.partial(jax.jit, static_argnames=("lower_bound", "config"))
def kda_verify(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
               conv_state, rec_state, *, lower_bound=-5.0, config=None):
  """Pallas (Triton) verify: q/k/v/f raw [B,T,HD], b_raw [B,T,H], A_log [H], dt_bias [HD], conv weights
  [HD,1,W], conv_state [B,W-1,3HD], rec_state [B,H,Dk,Dv] f32 -> (o [B,T,H,Dv] f32, KdaCommitInputs), the
  model's kda_inputs + kda_recurrent (its verify path) on these streams."""
  cfg = config or KdaConfig()
  bsz, t, hd = q_raw.shape
  h = b_raw.shape[-1]
  dk = hd // h
  dv = rec_state.shape[-1]
  width = q_conv_w.shape[-1]
  assert rec_state.shape == (bsz, h, dk, dv) and conv_state.shape == (bsz, width - 1, 3 * hd)
  assert dv % cfg.block_v == 0, (dv, cfg.block_v)
  f32 = jnp.float32
  if cfg.algorithm == "serial":
    kern = functools.partial(_verify_kernel, t_len=t, width=width, h_n=h, dk=dk, bv=cfg.block_v,
                             lower_bound=float(lower_bound))
  else:
    kern = functools.partial(_verify_chunk_kernel, t_len=t, tp=_pad_t(t), width=width, h_n=h,
                             dk=dk, bv=cfg.block_v, lower_bound=float(lower_bound),
                             prec=_dot_precision(cfg))
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
  """Pallas (Triton) commit: the state after the first n_accept[b] positions (the model's kda_replay).
  The output aliases rec_state (donate it to update in place)."""
  cfg = config or KdaConfig()
  bsz, h, dk, dv = rec_state.shape
  t = commit_inputs.k.shape[1]
  if cfg.algorithm == "serial":
    kern = functools.partial(_commit_kernel, t_len=t, bv=cfg.block_v)
  else:
    kern = functools.partial(_commit_chunk_kernel, t_len=t, tp=_pad_t(t), dk=dk, bv=cfg.block_v,
                             prec=_dot_precision(cfg))
  return pl.pallas_call(
      kern, grid=(bsz, h, dv // cfg.block_v),
      out_shape=jax.ShapeDtypeStruct(rec_state.shape, rec_state.dtype),
      input_output_aliases={0: 0},
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_commit",
  )(rec_state, n_accept.astype(jnp.int32), *commit_inputs)
