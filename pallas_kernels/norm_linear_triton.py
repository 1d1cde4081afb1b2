"""Norm + projections, and projection + residual, for a few rows on Triton: each ONE launch with no XLA around it.

Shape legend: T rows (batch folded in; KernelCalls sends T <= MAX_ROWS = 17), D reduction width (the normed
input's), N_s output rows of projection s (its weight [N_s, D]: a [*N, D] weight flattened by the caller, a free
reshape), BT x BN output tile of one program, BK the K step.

Why: at the v2 demo's sizes (D = 320, b_proj N = 4-5, w_qkvfg 5 x 320, kv_a 160) every kernel of a layer pass is
~1.5-2 us, so the launch count is the step time. XLA runs the norm as a reduce kernel plus one matvec fusion per
projection (the norm's multiply fused into them); this is one launch for all of them, and no XLA pad or slice
around it (masked loads and stores take the odd widths 5, 160, 480). It complements fused_linear.py's Mosaic
kernel (wgmma + TMA, whose stores need N_s <= 64 in multiples of 8 or a multiple of 64, hence XLA pads).

Math (the model's functions are the reference: ling_jax.layers.linear.norm_projections / project over
ling_jax.layers.norms.rms_norm; tests compare with them):
  r   [T]     = rsqrt(sum_d x^2 * (1/D) + eps)             fp32 squares; the sum in this kernel's fixed order
  xn  [T, D]  = nw * round(x * r, x.dtype)                 rms_norm's two rounding points (nw * normed in the
                                                            dtype of nw * x)
  acc [T, N_s] = xn @ W_s^T                                 fp32 accumulation, K steps in order 0, BK, 2 BK, ...
Epilogues (fused_linear.Proj kinds), the model's rounding points:
  "linear"   y = round(acc, Proj.out)                      (einsum output)
  "sigmoid"  y = sigmoid(f32(round(acc, Proj.logit)))      (KDA beta, MLA gate), f32
  "swiglu"   g, u = round(acc_g), round(acc_u); a = round(silu(g)); L > 0: a = min(a, L), u = clip(u, -L, L);
             y = round(a * u)                               (layers.linear.swiglu); round = to xn's dtype (the
                                                             activation dtype: Proj's bfloat16 in a bf16 model)

linear_residual_small (the output projections: KDA o_proj, MLA dense, the dense down_proj):
  out [T, N] = residual + round(o @ W^T, o.dtype)           (ling_jax.layers.linear.linear with a residual: the
                                                            projection rounded first, then the add, rounded to
                                                            the stream's dtype); grid (ceil(N / BN), ceil(T / BT)),
                                                            the K loop and masks as below, no norm.

Kernel plan (norm_linear_small): grid (F, ceil(T / BT)), F = sum_s ceil(N_s / BN) output tiles numbered in
projection order; program (f, i) finds its projection s statically (one pl.when branch per projection: separate
weight refs, no concat of the weights in HBM per step), then
  1. the norm's prologue, recomputed in EVERY program: the BT rows of x in BK steps (masked: rows >= T and
     columns >= D read 0), squares summed into a [BT, BK] f32 carry, one row sum at the end -> r. Cheap at small
     T (x is T D 2 bytes from L2, 640 B a row at the demo's D); it removes the reduce kernel before the matvecs;
  2. the K loop: x tile [BT, BK] -> xn tile (the norm weight's tile alongside), W tile [BN, BK] (rows >= N_s and
     columns >= D read 0; swiglu: gate and up tiles), acc += xn @ W^T (tl.dot, fp32);
  3. the epilogue in registers, stored masked (rows < T, columns < N_s) to out_s [T, N_s] in its dtype.
Bytes: every weight once (the whole cost at small T), x once per program (L2), the outputs.
Batch invariance: row t's result uses only row t; BT, BN, BK and the K order are fixed by the config, never by T
(T only sets the row-block count and the masks), so row 0 alone or among 17 rows gets the same bits.
Limits: any T, D, N_s (masks); the [BT, BK] tiles and the [BT, BN] accumulators live in registers, so BT stays
small: T <= MAX_ROWS is what KernelCalls sends (prefill's long T goes to XLA's GEMMs).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fused_linear import Proj

MAX_ROWS = 17  # the rows KernelCalls sends here: decode (B) and verify (B (1 + NEXTN drafts)) calls


@dataclasses.dataclass(frozen=True)
class NormLinearConfig:
  """Tiles and launch of norm_linear_small (none of it depends on T: batch invariant).

  Attributes:
    block_t: rows of one program (tl.dot: >= 16); T > block_t adds row blocks (the norm and the weights re-read).
      32 covers every T <= MAX_ROWS in one block, so the weights are read once.
    block_n: output columns of one program (>= 16).
    block_k: the K step (>= 16); D need not be a multiple (masked).
    num_warps, num_stages: the Triton launch (num_stages pipelines the K loop's loads).
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_t: int = 32
  block_n: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_t", "block_n", "block_k"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of 2 >= 16 (tl.dot tiles)")
    if self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
      raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4 or 8 and num_stages={self.num_stages} >= 1")


def _sigmoid(z):
  """1 / (1 + exp(-z)): Triton has no logistic."""
  return 1.0 / (1.0 + jnp.exp(-z))


def _rounded(a, dtype):
  """fp32 -> dtype -> fp32: the model's rounding point (no-op in fp32)."""
  return a.astype(dtype).astype(jnp.float32)


def _epilogue(accs, proj: Proj, act_dtype):
  """The projection's epilogue on its fp32 accumulators (one, or swiglu's (gate, up)) -> the output tile."""
  if proj.kind == "linear":
    return accs[0].astype(proj.out_dtype)
  if proj.kind == "sigmoid":
    return _sigmoid(_rounded(accs[0], jnp.dtype(proj.logit)))
  g, u = (_rounded(a, act_dtype) for a in accs)
  act = _rounded(g * _sigmoid(g), act_dtype)                       # silu, rounded as the model's act_fn output
  if proj.limit > 0:
    act, u = jnp.minimum(act, proj.limit), jnp.clip(u, -proj.limit, proj.limit)
  return (act * u).astype(act_dtype)


def _kernel(*refs, t, d, n_rows, projs, eps, cfg, act_dtype):
  """refs = (x [T, D], nw [D], the weights in projection order (swiglu: gate, up), out_s [T, N_s] ...)."""
  bt, bn, bk = cfg.block_t, cfg.block_n, cfg.block_k
  n_w = [p.n_weights for p in projs]
  x_ref, nw_ref = refs[:2]
  w_refs, out_refs = refs[2:2 + sum(n_w)], refs[2 + sum(n_w):]
  f, rb = pl.program_id(0), pl.program_id(1)
  row0 = rb * bt
  rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, bk), 0)
  cols = lax.broadcasted_iota(jnp.int32, (bt, bk), 1)
  n_k = pl.cdiv(d, bk)
  x_dtype = x_ref.dtype

  def x_tile(kb):  # [BT, BK] of x, zero past T rows / D columns
    return plt.load(x_ref.at[pl.ds(row0, bt), pl.ds(kb * bk, bk)], mask=(rows < t) & (cols + kb * bk < d),
                    other=0.0)

  # 1. r = rsqrt(mean(x^2) + eps): squares summed per column slot over the K steps, then one row sum
  def sq_step(kb, ss):
    xf = x_tile(kb).astype(jnp.float32)
    return ss + xf * xf

  ss = lax.fori_loop(0, n_k, sq_step, jnp.zeros((bt, bk), jnp.float32))
  r = lax.rsqrt(jnp.sum(ss, axis=1, keepdims=True) * (np.float32(1) / np.float32(d)) + eps)   # [BT, 1]

  prec = lax.Precision.HIGHEST if act_dtype == jnp.float32 else None
  w_first = np.cumsum([0] + n_w)
  tile0 = np.cumsum([0] + [pl.cdiv(n, bn) for n in n_rows])
  for s, (proj, n) in enumerate(zip(projs, n_rows)):
    ws = w_refs[w_first[s]:w_first[s + 1]]

    @pl.when((f >= tile0[s]) & (f < tile0[s + 1]))
    def _(s=s, proj=proj, n=n, ws=ws):
      col0 = (f - tile0[s]) * bn
      w_rows = col0 + lax.broadcasted_iota(jnp.int32, (bn, bk), 0)
      w_cols = lax.broadcasted_iota(jnp.int32, (bn, bk), 1)

      # 2. the K loop: xn tile (rms_norm's roundings) against each weight's [BN, BK] tile
      def k_step(kb, accs):
        normed = (x_tile(kb).astype(jnp.float32) * r).astype(x_dtype)
        k_ok = lax.broadcasted_iota(jnp.int32, (bk,), 0) + kb * bk < d
        nw = plt.load(nw_ref.at[pl.ds(kb * bk, bk)], mask=k_ok, other=0.0)
        xn = nw.astype(act_dtype)[None, :] * normed.astype(act_dtype)
        w_ok = (w_rows < n) & (w_cols + kb * bk < d)
        out = []
        for w_ref, acc in zip(ws, accs):
          wb = plt.load(w_ref.at[pl.ds(col0, bn), pl.ds(kb * bk, bk)], mask=w_ok, other=0.0)
          out.append(acc + plt.dot(xn, wb.astype(act_dtype), trans_b=True, precision=prec))
        return tuple(out)

      accs = lax.fori_loop(0, n_k, k_step, tuple(jnp.zeros((bt, bn), jnp.float32) for _ in ws))
      # 3. the epilogue, stored masked
      y = _epilogue(accs, proj, act_dtype)
      o_rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, bn), 0)
      o_cols = col0 + lax.broadcasted_iota(jnp.int32, (bt, bn), 1)
      plt.store(out_refs[s].at[pl.ds(row0, bt), pl.ds(col0, bn)], y.astype(out_refs[s].dtype),
                mask=(o_rows < t) & (o_cols < n))


def out_dtype(proj: Proj, act_dtype):
  """The output dtype of a projection (swiglu: the activation dtype; see the module docstring)."""
  return jnp.dtype(act_dtype) if proj.kind == "swiglu" else proj.out_dtype


@functools.partial(jax.jit, static_argnames=("projs", "eps", "config"))
def norm_linear_small(x, norm_weight, weights, *, projs, eps, config=None):
  """epilogue_s(rms_norm(x, norm_weight, eps) @ W_s^T) for every projection, one launch.

  x [T, D], norm_weight [D], weights: per projection its [N_s, D] weight (swiglu: the (gate, up) pair),
  projs: a fused_linear.Proj per projection -> (y_s [T, N_s], ...) in out_dtype(proj, act) (act: the dtype of
  norm_weight * x, rms_norm's output). Weights of another dtype than act are read and converted per tile."""
  cfg = config or NormLinearConfig()
  t, d = x.shape
  act = jnp.result_type(norm_weight, x)
  if norm_weight.shape != (d,):
    raise ValueError(f"norm_weight {norm_weight.shape} must be [D={d}]")
  if len(weights) != len(projs):
    raise ValueError(f"{len(weights)} weights for {len(projs)} projections")
  flat, n_rows = [], []
  for w, p in zip(weights, projs):
    ws = tuple(w) if p.kind == "swiglu" else (w,)
    if len(ws) != p.n_weights or any(a.ndim != 2 or a.shape != ws[0].shape or a.shape[1] != d for a in ws):
      raise ValueError(f"{p.kind} weights {[a.shape for a in ws]} must be {p.n_weights} x [N, D={d}]")
    flat.extend(ws)
    n_rows.append(ws[0].shape[0])
  n_tiles = sum(pl.cdiv(n, cfg.block_n) for n in n_rows)
  kern = functools.partial(_kernel, t=t, d=d, n_rows=tuple(n_rows), projs=tuple(projs), eps=float(eps), cfg=cfg,
                           act_dtype=act)
  return tuple(pl.pallas_call(
      kern, grid=(n_tiles, pl.cdiv(t, cfg.block_t)),
      out_shape=tuple(jax.ShapeDtypeStruct((t, n), out_dtype(p, act)) for n, p in zip(n_rows, projs)),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="norm_linear_small",
  )(x, norm_weight, *flat))


def _residual_kernel(o_ref, w_ref, res_ref, out_ref, *, t, k, n, cfg):
  """out tile [BT, BN] = residual + round(o @ W^T): the K loop of _kernel without the norm."""
  bt, bn, bk = cfg.block_t, cfg.block_n, cfg.block_k
  row0, col0 = pl.program_id(1) * bt, pl.program_id(0) * bn
  o_rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, bk), 0)
  o_cols = lax.broadcasted_iota(jnp.int32, (bt, bk), 1)
  w_rows = col0 + lax.broadcasted_iota(jnp.int32, (bn, bk), 0)
  w_cols = lax.broadcasted_iota(jnp.int32, (bn, bk), 1)
  prec = lax.Precision.HIGHEST if o_ref.dtype == jnp.float32 else None

  def k_step(kb, acc):
    ob = plt.load(o_ref.at[pl.ds(row0, bt), pl.ds(kb * bk, bk)], mask=(o_rows < t) & (o_cols + kb * bk < k),
                  other=0.0)
    wb = plt.load(w_ref.at[pl.ds(col0, bn), pl.ds(kb * bk, bk)], mask=(w_rows < n) & (w_cols + kb * bk < k),
                  other=0.0)
    return acc + plt.dot(ob, wb.astype(o_ref.dtype), trans_b=True, precision=prec)

  acc = lax.fori_loop(0, pl.cdiv(k, bk), k_step, jnp.zeros((bt, bn), jnp.float32))
  rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, bn), 0)
  cols = col0 + lax.broadcasted_iota(jnp.int32, (bt, bn), 1)
  live = (rows < t) & (cols < n)
  res = plt.load(res_ref.at[pl.ds(row0, bt), pl.ds(col0, bn)], mask=live, other=0.0)
  y = _rounded(acc, o_ref.dtype)                                    # the projection in o's dtype, then the add
  plt.store(out_ref.at[pl.ds(row0, bt), pl.ds(col0, bn)], (res.astype(jnp.float32) + y).astype(out_ref.dtype),
            mask=live)


@functools.partial(jax.jit, static_argnames=("config",))
def linear_residual_small(o, w, residual, *, config=None):
  """residual + o @ w^T, one launch: o [T, K], w [N, K] (read in o's dtype per tile), residual [T, N] -> [T, N]
  in residual's dtype (the model's `residual + y` with y = einsum(o, w) in o's dtype)."""
  cfg = config or NormLinearConfig()
  t, k = o.shape
  n = w.shape[0]
  if w.shape != (n, k) or residual.shape != (t, n):
    raise ValueError(f"o {o.shape}, w {w.shape}, residual {residual.shape}: expected [T, K], [N, K], [T, N]")
  out_dtype = jnp.result_type(residual, o)
  kern = functools.partial(_residual_kernel, t=t, k=k, n=n, cfg=cfg)
  return pl.pallas_call(
      kern, grid=(pl.cdiv(n, cfg.block_n), pl.cdiv(t, cfg.block_t)),
      out_shape=jax.ShapeDtypeStruct((t, n), out_dtype),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="linear_residual_small",
  )(o, w, residual)
