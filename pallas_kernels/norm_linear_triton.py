"""Norm + projections, and projection + residual, for a few rows on Triton: each ONE launch with no XLA around it.

Shape legend: T rows (batch folded in; KernelCalls sends T <= MAX_ROWS = 17), D reduction width (the normed
input's), N_s output rows of projection s (its weight [N_s, D]: a [*N, D] weight flattened by the caller, a free
reshape), BT x BN output tile of one program, BK the K step (a tile's width along D / K).

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
  acc [T, N_s] = xn @ W_s^T                                 fp32: S = splits accumulators, acc_j over the
                                                            columns kb BK + j BK / S .. (+ BK / S) for the K
                                                            steps kb = 0, 1, ... in order, then acc_0 + acc_1
                                                            + ... in order (plan 4. below)
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
                                                            the K steps and masks as below, no norm.

Kernel plan (norm_linear_small): grid (F, ceil(T / BT)), F = sum_s ceil(N_s / BN) output tiles numbered in
projection order; program (f, i) finds its projection s statically (one pl.when branch per projection: separate
weight refs, no concat of the weights in HBM per step), computes the norm's r of its BT rows itself (x is T D 2
bytes from L2; this removes the reduce kernel before the matvecs), runs the K loop acc += xn @ W^T (tl.dot, fp32)
and the epilogue in registers, stored masked (rows < T, columns < N_s). Masks take rows >= T, columns >= D and rows
>= N_s (they read 0 with no memory traffic), so there is no XLA pad or slice; a tile known to be full loads
unmasked.

Why this shape (at T <= 17 the demo's projections are bound by latency, Ling's by bytes; H100 2026-12-07 with the
previous plan, a K loop of 3-stage BN 32-64 steps after an unpipelined norm loop: ~0.4-0.7 us per K step, the
614 KB down_proj 5.6 us against XLA's 2.7):
  1. the K loop is a fori_loop that Triton software-pipelines (cp.async into shared memory); num_stages = (K
     steps) + 1 where shared memory allows, so the pipeline's prologue issues EVERY load of the program at the
     start and the program waits one memory round trip, not one per step. (Tiles loaded into registers do not do
     this: Triton converts each to the dot layout through shared memory right after its load, a barrier each, so
     the next load waits: checked in the SASS.)
  2. the norm's r is computed in the loop's first iteration (a lax.cond on kb == 0: every x tile loaded at once,
     one round trip), i.e. after the pipeline prologue has issued the weight loads: the x and W round trips
     overlap instead of adding up.
  3. BN = 16 (tl.dot's minimum) where one program per SM is not reached otherwise: 20 programs for a 320-wide
     output instead of 5-10, so more SMs fetch at once;
  4. each step's K width BK is split into `splits` dots of BK / splits, each into its own fp32 accumulator: a
     [BT, BN] = [32, 16] tile is one m16n8 MMA tile per warp, so a single accumulator is one dependent MMA chain
     of K / 16 (~30 cycles each: ~1 us at K = 960, ~5 us at Ling's 4096); `splits` chains interleave. The
     accumulators are summed in order 0, 1, ... at the end: a fixed order, as is everything here.
The rule that picks the tiles per weight shape is tiles_for (written here, never timed at run time).
Bytes: every weight once (the whole cost at small T), x from L2 twice per program (the norm, the K loop), the
outputs.
Batch invariance: row t's result uses only row t; BT, BN, BK, splits and the K order are fixed by the weight shapes
(tiles_for never sees T; T only sets the row-block count and the masks), so row 0 alone or among 17 rows gets the
same bits. Deterministic: no atomics. (Split-K across programs was not taken: a deterministic reduction between
programs needs a counter zeroed per call, a memset or a second launch: the kind of launch this kernel removes.)
Limits: any T, D, N_s (masks); the tiles and the accumulators live in registers, so BT stays small: T <= MAX_ROWS
is what KernelCalls sends (prefill's long T goes to XLA's GEMMs).
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
# The weight bytes of one call KernelCalls sends here at most. Measured on one H100 (bench/results/
# kernels-norm-linear-triton-nvidia-h100-80gb-hbm3-2026-12-07-rule.json): at the demo's <= 1.2 MB weights the kernel
# beats XLA (0.41-0.93x its time for the input projections), at Ling's 105 MB KDA w_qkvfg it reaches 34 % of the
# HBM floor against XLA's 84 % (101 vs 41 us). Ling's smallest projection (o_proj, 21 MB) is past this bound too,
# so on Ling every projection goes to XLA until the rule has tiles that stream large weights.
MAX_WEIGHT_BYTES = 8 << 20
ONE_WAVE = 132  # SMs of an H100 / H200 SXM: the programs that run at once, one per SM
CHAINS = 4  # independent MMA accumulator chains per warp (module docstring, 4.): [BT, BN] gives BN / 16 at 4 warps
W_STAGE_BYTES = 16 * 1024  # weight bytes per pipeline stage at most (sets BK where the program count is high)
SMEM_ONE_PER_SM = 200 * 1024  # pipeline stages' shared memory: one program per SM (Hopper: 227 KB a block)
SMEM_TWO_PER_SM = 100 * 1024  # ... where there are more programs than SMs: two per SM


@dataclasses.dataclass(frozen=True)
class NormLinearConfig:
  """Tiles and launch (none of it depends on T: batch invariant). A None field is filled by tiles_for, the rule
  over the weight shapes; a set field is kept (the bench's sweeps, the tests' forced configs).

  Attributes:
    block_t: rows of one program (tl.dot: >= 16); T > block_t adds row blocks (the norm and the weights re-read).
      32 covers every T <= MAX_ROWS in one block, so the weights are read once.
    block_n: output columns of one program (>= 16).
    block_k: the K width of one loop step (one pipeline stage); D need not be a multiple (masked).
    splits: the step's K split into this many dots of block_k / splits (>= 16) with an accumulator each.
    num_warps, num_stages: the Triton launch (num_stages: the K loop's loads in flight, stages - 1 steps ahead).
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_t: int = 32
  block_n: int | None = None
  block_k: int | None = None
  splits: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_t", "block_n", "block_k"):
      v = getattr(self, name)
      if v is not None and (v < 16 or v & (v - 1)):
        raise ValueError(f"{name}={v} must be a power of 2 >= 16 (tl.dot tiles)")
    if self.splits is not None and (self.splits < 1 or self.splits & (self.splits - 1)
                                    or (self.block_k is not None and self.block_k // self.splits < 16)):
      raise ValueError(f"splits={self.splits} must be a power of 2 with block_k / splits >= 16 "
                       f"(block_k={self.block_k})")
    if self.num_warps not in (None, 1, 2, 4, 8) or (self.num_stages is not None and self.num_stages < 1):
      raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4 or 8 and num_stages={self.num_stages} >= 1")


def tiles_for(n_rows, k: int, n_weights: int, config: NormLinearConfig | None = None) -> NormLinearConfig:
  """The config a call runs: config's set fields, the others by the rule over the weight shapes (never T).

  n_rows: N_s per projection (one entry for linear_residual_small); k: the reduction width (D or K); n_weights:
  weights per program (2: swiglu's gate and up, else 1). The rule:
    BN = the largest of 64, 32 that still gives >= ONE_WAVE programs, else 16 (the most programs);
    BK = the largest of 256, 128 whose weight stage (n_weights BN BK bf16) fits W_STAGE_BYTES and whose padding
      of K past a multiple is <= K / 8, else 64;
    splits = 64 / BN (CHAINS per warp), each dot >= 32 wide (64 B rows per load);
    num_stages = K steps + 1 (every load issued up front) where the stages' x, W and norm-weight tiles fit
      SMEM_ONE_PER_SM (<= ONE_WAVE programs) or SMEM_TWO_PER_SM (more), else as many as fit (>= 2); 4 warps.
  The demo (D = 320, 960): BN = 16, BK = 64 (320) / 256 (960), all K in flight. Ling (2560, 4096, 6144): BN = 64
  (w_qkvfg), 32 (MLA q | kv_a | g, gate | up), 16 (the 2560-wide outputs), 2-4 stages."""
  cfg = config or NormLinearConfig()
  bt = cfg.block_t
  count = lambda bn: sum(pl.cdiv(n, bn) for n in n_rows)
  bn = cfg.block_n or next((b for b in (64, 32) if count(b) >= ONE_WAVE), 16)
  fits = lambda b: n_weights * bn * b * 2 <= W_STAGE_BYTES and pl.cdiv(k, b) * b - k <= k / 8
  bk = cfg.block_k or next((b for b in (256, 128) if fits(b)), 64)
  splits = cfg.splits or max(1, min(bk // 32, CHAINS * 16 // bn))
  stage_bytes = 2 * bk * (bt + n_weights * bn + 1)
  budget = SMEM_ONE_PER_SM if count(bn) <= ONE_WAVE else SMEM_TWO_PER_SM
  stages = cfg.num_stages or max(2, min(pl.cdiv(k, bk) + 1, budget // stage_bytes))
  return dataclasses.replace(cfg, block_n=bn, block_k=bk, splits=splits, num_warps=cfg.num_warps or 4,
                             num_stages=stages)


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


def _mask(row0, rows, n_rows, rows_full, col0, cols, n_cols, cols_full):
  """[rows, cols] of (row0 + i < n_rows) & (col0 + j < n_cols), leaving out a side known to be in bounds
  (rows_full / cols_full); None when both are."""
  parts = []
  if not rows_full:
    parts.append(row0 + lax.broadcasted_iota(jnp.int32, (rows, cols), 0) < n_rows)
  if not cols_full:
    parts.append(col0 + lax.broadcasted_iota(jnp.int32, (rows, cols), 1) < n_cols)
  return functools.reduce(jnp.logical_and, parts) if parts else None


def _load(ref, row0, rows, col0, cols, n_rows, rows_full, n_cols, cols_full):
  """ref[row0 : row0 + rows, col0 : col0 + cols], zero past n_rows / n_cols."""
  mask = _mask(row0, rows, n_rows, rows_full, col0, cols, n_cols, cols_full)
  return plt.load(ref.at[pl.ds(row0, rows), pl.ds(col0, cols)], mask=mask, other=None if mask is None else 0.0)


def _sum_in_order(accs):
  """accs[0] + accs[1] + ... (the split accumulators, a fixed order)."""
  return functools.reduce(lambda a, b: a + b, accs)


def _kernel(*refs, t, d, n_rows, projs, eps, cfg, act_dtype):
  """refs = (x [T, D], nw [D], the weights in projection order (swiglu: gate, up), out_s [T, N_s] ...)."""
  bt, bn, bk, splits = cfg.block_t, cfg.block_n, cfg.block_k, cfg.splits
  sub = bk // splits                                                # one dot's K width
  n_w = [p.n_weights for p in projs]
  x_ref, nw_ref = refs[:2]
  w_refs, out_refs = refs[2:2 + sum(n_w)], refs[2 + sum(n_w):]
  f, rb = pl.program_id(0), pl.program_id(1)
  row0 = rb * bt
  # a width-`sub` tile at any multiple of sub is in bounds iff D is a multiple of the whole step
  k_full = d % bk == 0
  x_dtype = x_ref.dtype
  prec = lax.Precision.HIGHEST if act_dtype == jnp.float32 else None

  def x_at(col, width):  # [BT, width] of x from column col, zero past T rows / D columns
    return _load(x_ref, row0, bt, col, width, t, t % bt == 0, d, k_full)

  def nw_at(col):  # [sub] of the norm weight
    cols = col + lax.broadcasted_iota(jnp.int32, (sub,), 0)
    return plt.load(nw_ref.at[pl.ds(col, sub)], mask=None if k_full else cols < d, other=None if k_full else 0.0)

  def norm_r(kb):
    """r [BT, 1] = rsqrt(mean(x^2) + eps), from every x tile at once; squares summed per column slot in tile
    order, then one row sum. kb is 0 (the loop's first step): kb * BK + c is c, traced (a static slice must lie in
    bounds, and the last tile may run past D) and a known multiple of BK (vector loads)."""
    ss = jnp.zeros((bt, bk), jnp.float32)
    for c in range(0, d, bk):
      xf = x_at(kb * bk + c, bk).astype(jnp.float32)
      ss = ss + xf * xf
    return lax.rsqrt(jnp.sum(ss, axis=1, keepdims=True) * (np.float32(1) / np.float32(d)) + eps)

  def normed(xt, nwt, r):  # xn tile: rms_norm's two roundings
    return nwt.astype(act_dtype)[None, :] * (xt.astype(jnp.float32) * r).astype(x_dtype).astype(act_dtype)

  def dot(acc, xn, wt):
    return acc + plt.dot(xn, wt.astype(act_dtype), trans_b=True, precision=prec)

  w_first = np.cumsum([0] + n_w)
  tile0 = np.cumsum([0] + [pl.cdiv(n, bn) for n in n_rows])
  for s, (proj, n) in enumerate(zip(projs, n_rows)):
    ws = w_refs[w_first[s]:w_first[s + 1]]

    @pl.when((f >= tile0[s]) & (f < tile0[s + 1]))
    def _(proj=proj, n=n, ws=ws, first_tile=tile0[s]):
      col0 = (f - first_tile) * bn
      w_at = lambda w, c: _load(w, col0, bn, c, sub, n, n % bn == 0, d, k_full)

      def k_step(kb, carry):  # accs: per weight, per split, [BT, BN] fp32
        accs, r = carry
        r = lax.cond(kb == 0, lambda k, r_: norm_r(k), lambda k, r_: r_, kb, r)   # step 0: the norm
        cols = [kb * bk + j * sub for j in range(splits)]
        xns = [normed(x_at(c, sub), nw_at(c), r) for c in cols]
        return tuple(tuple(dot(a, xn, w_at(w, c)) for a, xn, c in zip(acc_w, xns, cols))
                     for acc_w, w in zip(accs, ws)), r

      zeros = tuple(tuple(jnp.zeros((bt, bn), jnp.float32) for _ in range(splits)) for _ in ws)
      accs, _ = lax.fori_loop(0, pl.cdiv(d, bk), k_step, (zeros, jnp.zeros((bt, 1), jnp.float32)))
      y = _epilogue(tuple(_sum_in_order(a) for a in accs), proj, act_dtype)
      plt.store(out_refs[s].at[pl.ds(row0, bt), pl.ds(col0, bn)], y.astype(out_refs[s].dtype),
                mask=_mask(row0, bt, t, t % bt == 0, col0, bn, n, n % bn == 0))


def out_dtype(proj: Proj, act_dtype):
  """The output dtype of a projection (swiglu: the activation dtype; see the module docstring)."""
  return jnp.dtype(act_dtype) if proj.kind == "swiglu" else proj.out_dtype


@functools.partial(jax.jit, static_argnames=("projs", "eps", "config"))
def norm_linear_small(x, norm_weight, weights, *, projs, eps, config=None):
  """epilogue_s(rms_norm(x, norm_weight, eps) @ W_s^T) for every projection, one launch.

  x [T, D], norm_weight [D], weights: per projection its [N_s, D] weight (swiglu: the (gate, up) pair),
  projs: a fused_linear.Proj per projection -> (y_s [T, N_s], ...) in out_dtype(proj, act) (act: the dtype of
  norm_weight * x, rms_norm's output). Weights of another dtype than act are read and converted per tile.
  config: its None fields by tiles_for over the weight shapes."""
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
  cfg = tiles_for(tuple(n_rows), d, max(p.n_weights for p in projs), config)
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
  """out tile [BT, BN] = residual + round(o @ W^T): _kernel's K loop without the norm."""
  bt, bn, bk, splits = cfg.block_t, cfg.block_n, cfg.block_k, cfg.splits
  sub = bk // splits
  row0, col0 = pl.program_id(1) * bt, pl.program_id(0) * bn
  k_full, rows_full, cols_full = k % bk == 0, t % bt == 0, n % bn == 0
  prec = lax.Precision.HIGHEST if o_ref.dtype == jnp.float32 else None
  res = _load(res_ref, row0, bt, col0, bn, t, rows_full, n, cols_full)   # before the loop: in flight with it

  def k_step(kb, accs):
    cols = [kb * bk + j * sub for j in range(splits)]
    return tuple(acc + plt.dot(_load(o_ref, row0, bt, c, sub, t, rows_full, k, k_full),
                               _load(w_ref, col0, bn, c, sub, n, cols_full, k, k_full).astype(o_ref.dtype),
                               trans_b=True, precision=prec) for acc, c in zip(accs, cols))

  zeros = tuple(jnp.zeros((bt, bn), jnp.float32) for _ in range(splits))
  acc = _sum_in_order(lax.fori_loop(0, pl.cdiv(k, bk), k_step, zeros))
  y = _rounded(acc, o_ref.dtype)                                    # the projection in o's dtype, then the add
  plt.store(out_ref.at[pl.ds(row0, bt), pl.ds(col0, bn)], (res.astype(jnp.float32) + y).astype(out_ref.dtype),
            mask=_mask(row0, bt, t, rows_full, col0, bn, n, cols_full))


@functools.partial(jax.jit, static_argnames=("config",))
def linear_residual_small(o, w, residual, *, config=None):
  """residual + o @ w^T, one launch: o [T, K], w [N, K] (read in o's dtype per tile), residual [T, N] -> [T, N]
  in residual's dtype (the model's `residual + y` with y = einsum(o, w) in o's dtype). config: its None fields
  by tiles_for over w's shape."""
  t, k = o.shape
  n = w.shape[0]
  if w.shape != (n, k) or residual.shape != (t, n):
    raise ValueError(f"o {o.shape}, w {w.shape}, residual {residual.shape}: expected [T, K], [N, K], [T, N]")
  cfg = tiles_for((n,), k, 1, config)
  out_dtype = jnp.result_type(residual, o)
  kern = functools.partial(_residual_kernel, t=t, k=k, n=n, cfg=cfg)
  return pl.pallas_call(
      kern, grid=(pl.cdiv(n, cfg.block_n), pl.cdiv(t, cfg.block_t)),
      out_shape=jax.ShapeDtypeStruct((t, n), out_dtype),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="linear_residual_small",
  )(o, w, residual)
