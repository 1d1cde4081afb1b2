"""Fused KDA decode (T = 1): conv1d + gates + beta + l2norm + delta rule + state update in place.

Shape legend: B batch, H heads, Dk = Dv head dims, HD = H*Dk, W conv kernel (4), BV value tile.

One kernel per layer and token: `kda_verify` + `kda_commit(n_accept=1)` + the conv window slide
in one launch, reading the state once and writing it once (in place: the state output aliases
rec_state, donate it). Per head (fp32), with e = exp(g):
  u = beta (v - S^T (e k))                                       the delta-rule write
  S' = diag(e) S + k u^T                                         state update
  o = S'^T q = S^T (e q) + u (k . q)                             both state reductions independent
Grid (B, H, Dv/BV). Program (b, h, vb) owns state columns [vb*BV, (vb+1)*BV) of head h and
writes the new conv window for the BV channels h*Dk + vb*BV + [0, BV) of each of q, k and v
(disjoint across programs; the window is a fresh output, not aliased, because every program of a
head reads its whole q/k window).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda_verify import L2_EPS, KdaConfig, _conv_rows, _round, _sigmoid


def _decode_kernel(q_ref, k_ref, v_ref, f_ref, b_ref, alog_ref, dtb_ref, qw_ref, kw_ref, vw_ref,
                   cs_ref, s_ref, o_ref, so_ref, cso_ref, *, width, h_n, dk, bv, lower_bound):
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hd = h_n * dk
  c0, v0 = h * dk, h * dk + vb * bv
  cols = pl.ds(vb * bv, bv)

  def conv(raw_ref, w_ref, c, n, cs_off):  # R(silu(conv)) of channels [c, c+n) of one stream: [n] f32
    xcat = [cs_ref[b, i, pl.ds(cs_off + c, n)] for i in range(width - 1)] + [raw_ref[b, 0, pl.ds(c, n)]]
    (y,) = _conv_rows(xcat, [w_ref[pl.ds(c, n), 0, j].astype(jnp.float32) for j in range(width)], raw_ref.dtype)
    return y

  q, k = conv(q_ref, qw_ref, c0, dk, 0), conv(k_ref, kw_ref, c0, dk, hd)   # [Dk]
  v = conv(v_ref, vw_ref, v0, bv, 2 * hd)                                # [BV]
  f = f_ref[b, 0, pl.ds(c0, dk)].astype(jnp.float32)
  braw = b_ref[b, 0, h].astype(jnp.float32)
  a = jnp.exp(alog_ref[h].astype(jnp.float32))
  dtb = dtb_ref[pl.ds(c0, dk)].astype(jnp.float32)
  s = s_ref[b, h, :, cols]                                             # [Dk, BV] f32
  # the new conv window rows of this program's channels (loaded before any store)
  win = []
  for off, raw_ref in ((0, q_ref), (hd, k_ref), (2 * hd, v_ref)):
    ch = pl.ds(off + c0 + vb * bv, bv)
    rows = [cs_ref[b, i, ch] for i in range(1, width - 1)]
    rows.append(raw_ref[b, 0, pl.ds(c0 + vb * bv, bv)].astype(cs_ref.dtype))
    win.append((ch, rows))
  act = q_ref.dtype                                                    # the model's rounding points
  q = _round(q * lax.rsqrt(jnp.sum(q * q) + L2_EPS), act) * dk ** -0.5
  k = _round(k * lax.rsqrt(jnp.sum(k * k) + L2_EPS), act)
  e = jnp.exp(lower_bound * _sigmoid(a * (f + dtb)))                   # e^g  [Dk]
  beta = _sigmoid(braw)
  s = s * e[:, None]                                                   # diag(e^g) S
  kv = jnp.sum(s * k[:, None], axis=0)                                 # S^T (e k)  [BV]
  sq = jnp.sum(s * q[:, None], axis=0)                                 # S^T (e q)  [BV]
  u = beta * (v - kv)
  o_ref[b, 0, h, cols] = sq + u * jnp.sum(k * q)
  so_ref[b, h, :, cols] = s + k[:, None] * u[None, :]
  for ch, rows in win:
    for i, row in enumerate(rows):
      cso_ref[b, i, ch] = row


@functools.partial(jax.jit, static_argnames=("lower_bound", "config"))
def kda_decode(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
               conv_state, rec_state, *, lower_bound=-5.0, config=None):
  """Pallas (Triton) fused decode: kda_verify's arguments with T = 1 -> (o [B,1,H,Dv] f32, rec_state, conv_state
  [B,W-1,3HD]); the reference is the model's decode step (kda_inputs, kda_recurrent, slide_window).
  The state output aliases rec_state (donate it to update in place). config: KdaConfig
  (block_v, num_warps, interpret)."""
  cfg = config or KdaConfig()
  bsz, t, hd = q_raw.shape
  h = b_raw.shape[-1]
  dk = hd // h
  dv = rec_state.shape[-1]
  width = q_conv_w.shape[-1]
  assert t == 1, f"kda_decode is T = 1; got T = {t} (use kda_verify + kda_commit)"
  assert rec_state.shape == (bsz, h, dk, dv) and conv_state.shape == (bsz, width - 1, 3 * hd)
  assert dv % cfg.block_v == 0 and dk == dv, (dk, dv, cfg.block_v)
  kern = functools.partial(_decode_kernel, width=width, h_n=h, dk=dk, bv=cfg.block_v,
                           lower_bound=float(lower_bound))
  return pl.pallas_call(
      kern, grid=(bsz, h, dv // cfg.block_v),
      out_shape=(jax.ShapeDtypeStruct((bsz, 1, h, dv), jnp.float32),
                 jax.ShapeDtypeStruct(rec_state.shape, rec_state.dtype),
                 jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)),
      input_output_aliases={11: 1},
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=cfg.interpret, name="kda_decode",
  )(q_raw, k_raw, v_raw, f_raw, b_raw, A_log, dt_bias, q_conv_w, k_conv_w, v_conv_w,
    conv_state, rec_state)
