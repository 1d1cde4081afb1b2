"""The MTP layer's input for a few rows on Triton: embedding gather, both RMSNorms and eh_proj in ONE launch.

Shape legend: T rows (batch folded in; KernelCalls sends T <= MAX_ROWS = 17), D hidden (both inputs' width), V
vocabulary (the embedding [V, D]), N eh_proj's output rows (its weight [N, 2D]), BT x BN the output tile of one
program, BK the K step.

Why: every NEXTN draft pass and the extend start with x = eh_proj([enorm(embed(tok)) | hnorm(h)]); XLA runs it as a
reduce kernel per norm (the gather fused into the first) and a dot fusion (the norms' multiplies and the concatenate
fused into its input): 3 launches a draft pass at the v2 demo's sizes, 4 in the extend (the gather on its own), each
~1.5-2 us. This is one launch: the token ids are read in the kernel and the embedding rows gathered by pointer,
no [T, 2D] concatenate exists anywhere. It is norm_linear_triton.norm_linear_small with two normed inputs and the
first one gathered; same tiles and rules.

Math (the model's functions are the reference: ling_jax.nextn.mtp_forward's input, i.e. layers.linear.norm_projections
over the two-input Normed: rms_norm of each, concatenated, then the einsum; tests compare with it):
  e    [T, D]  = embed[tok]                                   (jnp.take; ids must lie in [0, V), as every step's
                                                               do: past V jnp.take gives NaN rows, the kernel zeros)
  r_e, r_h [T] = rsqrt(sum_d e^2 / D + eps), the same over h   fp32 squares; each sum in this kernel's order
  xn   [T, 2D] = [enorm * round(e r_e) | hnorm * round(h r_h)] rms_norm's rounding points, in act (nw * x's dtype)
  y    [T, N]  = round(xn @ W^T, act)                         fp32 accumulation over the 2D columns in order (the
                                                               e half's K steps, then h's), rounded once (einsum)
Bytes: eh_proj once (N 2D 2 B: 410 KB at the demo's size), T embedding rows, h once per program (L2), the outputs.
Batch invariance: row t's result uses only row t; tiles and orders are fixed by the config, never by T.
Limits: any T, D, N (masks); T <= MAX_ROWS is what KernelCalls sends.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.norm_linear_triton import MAX_ROWS, NormLinearConfig, tiles_for

__all__ = ["MAX_ROWS", "NormLinearConfig", "mtp_input_small"]


def _kernel(tok_ref, emb_ref, h_ref, enorm_ref, hnorm_ref, w_ref, out_ref, *, t, d, v, n, eps, cfg, act_dtype):
  """Program (j, i): rows [i BT, (i + 1) BT), output columns [j BN, (j + 1) BN)."""
  bt, bn, bk = cfg.block_t, cfg.block_n, cfg.block_k
  col0, row0 = pl.program_id(0) * bn, pl.program_id(1) * bt
  rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, bk), 0)
  cols = lax.broadcasted_iota(jnp.int32, (bt, bk), 1)
  n_k = pl.cdiv(d, bk)
  tok_ok = row0 + lax.broadcasted_iota(jnp.int32, (bt,), 0) < t
  tok = plt.load(tok_ref.at[pl.ds(row0, bt)], mask=tok_ok, other=0)
  live_tok = (rows < t) & (tok[:, None] >= 0) & (tok[:, None] < v)

  def e_tile(kb):  # [BT, BK] of the gathered embedding rows, zero past T rows / D columns / bad ids
    return plt.load(emb_ref.at[tok[:, None], cols + kb * bk], mask=live_tok & (cols + kb * bk < d), other=0.0)

  def h_tile(kb):
    return plt.load(h_ref.at[pl.ds(row0, bt), pl.ds(kb * bk, bk)], mask=(rows < t) & (cols + kb * bk < d),
                    other=0.0)

  def inv_rms(tile):  # rsqrt(mean(x^2) + eps) of the rows: squares per column slot over the K steps, one row sum
    def sq_step(kb, ss):
      xf = tile(kb).astype(jnp.float32)
      return ss + xf * xf

    ss = lax.fori_loop(0, n_k, sq_step, jnp.zeros((bt, bk), jnp.float32))
    return lax.rsqrt(jnp.sum(ss, axis=1, keepdims=True) / np.float32(d) + eps)   # [BT, 1] (a division: jnp.mean)

  r_e, r_h = inv_rms(e_tile), inv_rms(h_tile)
  prec = lax.Precision.HIGHEST if act_dtype == jnp.float32 else None
  w_rows = col0 + lax.broadcasted_iota(jnp.int32, (bn, bk), 0)
  w_cols = lax.broadcasted_iota(jnp.int32, (bn, bk), 1)

  def half(tile, r, nw_ref, x_dtype, w_col0):
    """acc += (nw * round(x r)) @ W[:, w_col0 + k]^T over this input's K steps."""
    def k_step(kb, acc):
      normed = (tile(kb).astype(jnp.float32) * r).astype(x_dtype)
      k_ok = lax.broadcasted_iota(jnp.int32, (bk,), 0) + kb * bk < d
      nw = plt.load(nw_ref.at[pl.ds(kb * bk, bk)], mask=k_ok, other=0.0)
      xn = nw.astype(act_dtype)[None, :] * normed.astype(act_dtype)
      wb = plt.load(w_ref.at[pl.ds(col0, bn), pl.ds(w_col0 + kb * bk, bk)],
                    mask=(w_rows < n) & (w_cols + kb * bk < d), other=0.0)
      return acc + plt.dot(xn, wb.astype(act_dtype), trans_b=True, precision=prec)
    return k_step

  acc = jnp.zeros((bt, bn), jnp.float32)
  acc = lax.fori_loop(0, n_k, half(e_tile, r_e, enorm_ref, emb_ref.dtype, 0), acc)
  acc = lax.fori_loop(0, n_k, half(h_tile, r_h, hnorm_ref, h_ref.dtype, d), acc)
  o_rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, bn), 0)
  o_cols = col0 + lax.broadcasted_iota(jnp.int32, (bt, bn), 1)
  plt.store(out_ref.at[pl.ds(row0, bt), pl.ds(col0, bn)], acc.astype(out_ref.dtype),
            mask=(o_rows < t) & (o_cols < n))


@functools.partial(jax.jit, static_argnames=("eps", "config"))
def mtp_input_small(tokens, embed, hidden, enorm, hnorm, w, *, eps, config=None):
  """eh_proj([rms_norm(embed[tokens], enorm) | rms_norm(hidden, hnorm)]), one launch.

  tokens int32[T] (ids in [0, V)), embed [V, D], hidden [T, D], enorm / hnorm [D], w [N, 2D] (read per tile in act,
  the dtype of the normed rows) -> y [T, N] in act (the einsum's output)."""
  (t,), (v, d) = tokens.shape, embed.shape
  n = w.shape[0]
  # norm_linear_triton's rule over eh_proj's shape: each half is a K loop over D (the e half's, then h's), so the
  # tiles are picked for K = D; the config's splits are not used here (one accumulator per program)
  cfg = tiles_for((n,), d, 1, config)
  act = jnp.result_type(enorm, embed)
  if hidden.shape != (t, d) or enorm.shape != (d,) or hnorm.shape != (d,) or w.shape != (n, 2 * d):
    raise ValueError(f"tokens {tokens.shape}, embed {embed.shape}, hidden {hidden.shape}, enorm {enorm.shape}, "
                     f"hnorm {hnorm.shape}, w {w.shape}: expected [T], [V, D], [T, D], [D], [D], [N, 2D]")
  if jnp.result_type(hnorm, hidden) != act:
    raise ValueError(f"both normed halves must be one dtype: {act} and {jnp.result_type(hnorm, hidden)}")
  kern = functools.partial(_kernel, t=t, d=d, v=v, n=n, eps=float(eps), cfg=cfg, act_dtype=act)
  return pl.pallas_call(
      kern, grid=(pl.cdiv(n, cfg.block_n), pl.cdiv(t, cfg.block_t)),
      out_shape=jax.ShapeDtypeStruct((t, n), act),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="mtp_input_small",
  )(tokens.astype(jnp.int32), embed, hidden, enorm, hnorm, w)
