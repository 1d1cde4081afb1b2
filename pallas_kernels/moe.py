"""Routed + shared MoE: Pallas (Triton) kernels that read only the activated experts.

Shape legend: T tokens, D hidden, A experts per token, E experts, I expert width,
P = T*A (token, expert) pairs, S = P (+1 slot for the shared expert) segment slots,
R = P (+T rows for the shared expert) sorted rows, M rows per block inside one segment,
T' = T padded to a power of 2, BD / BDC output tiles over D.

Math (per token t, chosen experts e_a with weights w_a, clamp L > 0 only when on):
  g = x @ w_gate[e].T ; u = x @ w_up[e].T                  (fp32 accumulate)
  h = min(silu(g), L) * clip(u, -L, L)     (routed, limit L; the shared expert: its own limit Ls)
      (the limit after the SiLU, as SGLang deploys Ling-3.0; = ling_jax.layers.moe.swiglu)
  out[t] = sum_a w_a * (h_a @ w_down[e_a].T) + shared(x_t)  (fp32, returned in x.dtype)

Kernel plan (no host sync, no limit on E):
  1. align: sort the P pairs by expert id (key expert * P + pair); each run of equal ids is a
     segment (start, length, expert), slots in ascending expert order, empty slots last.
     `device_align`: one single-program Pallas kernel `moe_align` (rank by counting, O(P^2)
     compares in [P, C] chunks, no scatter); else XLA (sort + nonzero + gathers).
     Row r of the sorted order belongs to token tok[r] with routing weight w[r].
  2. `moe_up_swiglu`, grid (S, I/BI): each program gathers its segment's x rows (x[tok]),
     reads the [BI, D] gate and up tiles of ITS expert once, writes h = SwiGLU(+clamp) [M, BI].
  3. `fuse_combine`: `moe_down_combine`, grid (D/BDC): each program runs over every segment in
     slot order (ascending expert, shared last), out_acc[T', BDC] += onehot(tok) . (w * h @ wd.T)
     in registers, and writes out[T, BDC] once. Options: `combine_split` > 1 gives each of
     `split` programs per tile the slots of one expert-id range and its own fp32 partial
     (out = fixed-order sum of the partials in XLA); `prefetch` loads the next slot's down tile
     before the current slot's math. Else (v1) `moe_down`, grid (S, D/BD), writes
     y[order[r]] = w[r] * h[r] @ wd.T (fp32): y in pair order t*A + a, so the combine is the sum over
     A of y.reshape(T, A, D) (an XLA reduce that fuses into its consumer, no gather).
`moe` aligns the ids itself (step 1); `moe_segments` takes the tables from the router's own launch
(pallas_kernels/router_segments.py): router -> up -> down.

The shared expert rides as one extra segment (all T tokens, weight 1) when Is == I. A shared expert of width
Is = n I (n > 1, the v2 demo's 192 = 3 x 64) rides as n chunks of that segment: the tables still carry ONE
shared slot P (rows P + t), and the up / down grids have n - 1 more programs (slots P + c) that read the slot's
rows but the columns [c I, (c + 1) I) of the shared gate / up (and of the shared down's reduction axis) and keep
their h / y rows at P + c T + t (SwiGLU is per column of Is, so the n chunks' down products sum to the whole
expert's: out[t] += sum_c y[P + c T + t] in fp32, chunk order). No XLA dot is left for the shared expert. The
fused combine walks the n chunks after the routed slots (h rows P + c T + t, the slot's tok / w rows).
Empty segment slots load nothing.

The residual add in the down launch (`moe_segments(..., residual=r)`, decode / verify rows T <=
RESIDUAL_MAX_TOKENS; KernelCalls.moe_residual_epilogue), `moe_down_residual`:
  out[t] = round(f32(r[t]) + f32(round(moe[t], x.dtype)), r.dtype)
the model's `x + moe_layer(x)` with its two rounding points (moe_layer rounds the fp32 MoE sum to the activation
dtype, then the residual stream's add rounds again). Every output element must have ONE writer, so that the
residual is added exactly once. v1's `moe_down` has A + n writers per output row (one program per slot the token
is in, each writing its own y row), so the add cannot ride there without a second pass over y; that pass is the
XLA `loop_add_fusion` after it (the sum over A, the chunks' adds, the round, the residual add: one launch per
MoE pass). So the residual path runs the fused combine at split 1 (grid D / BDC): program j owns the columns
[j BDC, (j + 1) BDC) of ALL T rows, walks every active slot in order (ascending expert, then the shared chunks
0 .. n - 1) into its fp32 accumulator [T', BDC], rounds it, adds the residual's tile and stores the tile, once.
The launch after the MoE goes and so does the y buffer. (Folding the add into the next layer's norm_linear_small
prologue instead would keep v1's grid, but every one of that kernel's programs re-norms the whole rows, so each
would read all (P + n T) fp32 y rows, 54 KB at the demo's T = 6 and ~550 KB at Ling's; and the last MoE layer
feeds the final norm, which is XLA's.)
Row blocks: a segment has at most T rows where each token's experts are distinct (the router's top-k, the only
producer of these tables), so the path runs ceil(T / M) static row blocks per slot and unrolls the K loop over I:
the loop over the slots is the innermost loop, which Triton's pipeliner can overlap (the general fused combine
nests a dynamic row-block loop in it; measured at Ling's dims it walked the slots one HBM round trip at a time,
bench/KERNEL_NOTES.md).
Bytes (the v2 demo at T = 6, bf16: 24 pairs on <= 16 experts + 3 shared chunks, D 320, I 64): each active
expert's down weight once (D I 2 = 40 KB, as v1) and the shared [D, 192] once; the h rows (P + n T) I 2 = 5.4 KB
per program from L2 (20 programs at BDC 16: 107 KB; v1: ~27 KB); the residual and the output T D 2 = 3.8 KB once
each. Removed: v1's fp32 y rows (P + n T) D 4 = 54 KB, written by moe_down and read back by the XLA fusion.
Cost: the slot walk is serial in each program (D / BDC programs where v1 has S x D / BD), hence off by default
until timed (bench_step --moe-residual-epilogue --baseline-set moe_residual_epilogue=0).
Numerics: the same fp32 products w * (h @ wd.T) as v1, summed in the fused combine's order (ascending expert id,
then the chunks) where v1 sums y over A in pick order in XLA: on vs off differ by fp32 rounding before the bf16
round (in bf16, an ulp where a sum lands near a rounding tie). The order depends on the token's own experts only
(batch invariant, below).

Batch invariance of the fused combine: token t's accumulator gets exact zeros from rows of
other tokens and its own A products in ascending expert-id order, then the shared product (its chunks in order);
that order depends on t's own expert set only. Each row's GEMM (tl.dot over a fixed K loop)
depends on that row only. So a token's output is bitwise the same alone or in any batch
(when its A experts are distinct, as top-k gives; a token that picks one expert twice gets
its two products summed in a row-block order that can depend on other tokens).
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
  """Tiling and path choices for the Triton MoE kernels.

  Attributes:
    block_m: rows (pairs of one expert) per block; >= 16 for tl.dot.
    block_i: expert-width tile of the up kernel (output columns of gate/up).
    block_k: reduction tile over D in the up kernel.
    block_d: output tile over D in the unfused (v1) down kernel.
    block_kd: reduction tile over I in the down kernels.
    block_dc: output tile over D of the fused down+combine kernel (grid = D / block_dc).
    combine_split: the fused kernel's grid is (D / block_dc, combine_split); program j runs the
      slots whose expert id is in [j E / split, (j+1) E / split) (the shared slot in the last)
      into its own fp32 partial, and out = ((p_0 + p_1) + ...) in XLA (an elementwise add that
      fuses into the residual add of the caller). 1: one launch, no partials.
    prefetch: the fused kernel loads the next slot's [BDC, I] down tile (I/BK register tiles)
      before computing the current one, so HBM loads stay in flight across slots.
    num_warps, num_stages: Triton launch parameters.
    fuse_combine: combine in the down kernel (one launch) instead of the v1 XLA sum over A.
    device_align: segments from the one-launch Pallas `moe_align` kernel instead of XLA's
      sort + nonzero + gathers (used when P <= align_max_pairs; XLA above that).
    align_max_pairs: the align kernel is O(P^2); larger P (prefill) uses the XLA sort.
    interpret: run the kernels in the Pallas interpreter (CPU tests).
  """
  block_m: int = 16
  block_i: int = 32
  block_k: int = 256
  block_d: int = 64
  block_kd: int = 256
  block_dc: int = 16
  combine_split: int = 1
  prefetch: bool = False
  num_warps: int = 4
  num_stages: int = 4
  fuse_combine: bool = False      # default stays v1 until the fused path is measured on GPU
  device_align: bool = False
  align_max_pairs: int = 1024
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_m", "block_i", "block_k", "block_d", "block_kd", "block_dc"):
      v = getattr(self, name)
      if v <= 0 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a positive power of 2")
    if self.combine_split < 1:
      raise ValueError(f"combine_split={self.combine_split} must be >= 1")
    if self.block_m < 16 or self.block_dc < 16:
      raise ValueError(f"block_m={self.block_m}, block_dc={self.block_dc} must be >= 16 "
                       "(tl.dot minimum)")

  def check(self, d: int, i: int):
    for name, blk, dim in (("block_i", self.block_i, i), ("block_k", self.block_k, d),
                           ("block_d", self.block_d, d), ("block_kd", self.block_kd, i),
                           ("block_dc", self.block_dc, d)):
      if dim % blk:
        raise ValueError(f"{name}={blk} must divide {dim}")


# The residual path's largest T: it unrolls ceil(T / block_m) row blocks per slot (router_segments.MAX_TOKENS, the
# tables' producer, sends at most 32 rows).
RESIDUAL_MAX_TOKENS = 32


# ----------------------------------------------------------------------------- epilogue


def _swiglu(g, u, limit):
  """The up kernels' epilogue: g, u fp32 -> h = min(silu(g), L) * clip(u, -L, L) fp32 (no clamp when limit <= 0);
  routed and shared alike. The model's form (ling_jax.layers.linear.swiglu) rounds g, u and silu(g) to the
  activation dtype first; these kernels keep them in fp32 (a bf16 rounding apart, within the tests' 1e-2)."""
  if limit > 0:
    return jnp.minimum(jax.nn.silu(g), limit) * jnp.clip(u, -limit, limit)
  return jax.nn.silu(g) * u


# ----------------------------------------------------------------------------- align

_BIG = 1 << 30            # expert id of padding lanes: never < or == a real id


def _pow2(n):
  return 1 << max(0, (n - 1).bit_length())


def _align_kernel(ids_ref, w_ref, order_ref, seg_ref, tok_ref, wrow_ref, *, p, pp, a, t,
                  has_shared, chunk):
  """Counting sort of the P (expert, pair) keys in one program; no scatter, no atomics.

  Per pair p (a [PP, 1] column), over q in chunks of C ([1, C] rows):
    start_p = #{q: e_q < e_p}   len_p = #{q: e_q == e_p}   rank_p = start_p + #{q < p: e_q == e_p}
    first_p = (rank_p == start_p)   slot_p = #{q: e_q < e_p, first_q}   (distinct ids below e_p)
  Then per sorted row / slot r (chunks of C): order[r] = the p with rank_p == r, tok = order // A,
  w = w[order]; seg[:, r] = (start, len, e) of the first pair with slot_p == r, else (P, 0, max e).
  """
  lane = lax.broadcasted_iota(jnp.int32, (pp, 1), 0)                  # [PP, 1] pair p
  valid = lane < p
  e_p = plt.load(ids_ref.at[pl.ds(0, pp)], mask=valid[:, 0], other=_BIG)[:, None]
  w_p = plt.load(w_ref.at[pl.ds(0, pp)], mask=valid[:, 0], other=0.0)[:, None]
  csum = lambda m, ax: jnp.sum(m.astype(jnp.int32), axis=ax)

  def count(c, carry):
    lt, eq, eqb, slot = carry
    q = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)      # [1, C]
    e_q = plt.load(ids_ref.at[pl.ds(c * chunk, chunk)], mask=q[0] < p, other=_BIG)[None, :]
    less, same = e_q < e_p, e_q == e_p                                  # [PP, C]
    first_q = csum(same & (lane < q), 0)[None, :] == 0                  # [1, C]
    return (lt + csum(less, 1)[:, None], eq + csum(same, 1)[:, None],
            eqb + csum(same & (q < lane), 1)[:, None],
            slot + csum(less & first_q, 1)[:, None])

  zero = jnp.zeros((pp, 1), jnp.int32)
  start, length, before, slot = lax.fori_loop(0, pl.cdiv(pp, chunk), count, (zero,) * 4)
  rank = start + before                                                 # [PP, 1]
  first = valid & (before == 0)
  n_distinct = jnp.sum(first[:, 0].astype(jnp.int32))
  e_max = jnp.max(jnp.where(valid, e_p, -1)[:, 0])
  n_rows = p + t if has_shared else p
  n_slots = p + 1 if has_shared else p

  def gather(c, carry):
    r = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)      # [1, C] row / slot
    rr = r[0]
    hit = valid & (rank == r)                                           # [PP, C]
    pair = jnp.sum(jnp.where(hit, lane, 0), axis=0)                     # [C]
    wr = jnp.sum(jnp.where(hit, w_p, 0.0), axis=0)
    plt.store(order_ref.at[pl.ds(c * chunk, chunk)], pair, mask=rr < p)
    plt.store(tok_ref.at[pl.ds(c * chunk, chunk)], jnp.where(rr < p, pair // a, rr - p),
              mask=rr < n_rows)
    plt.store(wrow_ref.at[pl.ds(c * chunk, chunk)], jnp.where(rr < p, wr, 1.0),
              mask=rr < n_rows)
    sel = first & (slot == r)                                           # [PP, C]
    empty = rr >= n_distinct
    st = jnp.where(empty, p, jnp.sum(jnp.where(sel, start, 0), axis=0))
    ln = jnp.where(empty, 0, jnp.sum(jnp.where(sel, length, 0), axis=0))
    ex = jnp.where(empty, e_max, jnp.sum(jnp.where(sel, e_p, 0), axis=0))
    if has_shared:                                                      # slot P: shared expert
      st, ln, ex = (jnp.where(rr == p, v, z) for v, z in ((p, st), (t, ln), (0, ex)))
    for k, v in enumerate((st, ln, ex)):
      plt.store(seg_ref.at[pl.ds(k, 1), pl.ds(c * chunk, chunk)], v[None, :],
                mask=r < n_slots)
    return carry

  lax.fori_loop(0, pl.cdiv(n_rows, chunk), gather, 0)


def _align(topk_ids, topk_weights, *, has_shared, interpret=False, num_warps=4):
  """One-launch align: (order [P], seg [3, S], tok [R], w_rows [R] f32); see _align_kernel."""
  t, a = topk_ids.shape
  p = t * a
  pp = _pow2(p)
  chunk = max(1, min(pp, 4096 // pp, 64))
  n_rows, n_slots = (p + t, p + 1) if has_shared else (p, p)
  kern = functools.partial(_align_kernel, p=p, pp=pp, a=a, t=t, has_shared=has_shared,
                           chunk=chunk)
  i32 = jnp.int32
  return pl.pallas_call(
      kern, grid=(1,),
      out_shape=(jax.ShapeDtypeStruct((p,), i32), jax.ShapeDtypeStruct((3, n_slots), i32),
                 jax.ShapeDtypeStruct((n_rows,), i32),
                 jax.ShapeDtypeStruct((n_rows,), jnp.float32)),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="moe_align",
  )(topk_ids.reshape(p).astype(i32), topk_weights.reshape(p).astype(jnp.float32))


def _segments_xla(topk_ids, topk_weights):
  """XLA align: sort + nonzero + gathers (several launches)."""
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


def _segments(topk_ids, topk_weights, *, use_pallas=None, interpret=False):
  """Sort the P pairs by expert; return (order, seg [3, P] = start/len/expert, w_sorted).

  use_pallas: the one-launch `moe_align` kernel (None: when the default backend is a GPU and
  P <= 1024); else XLA. Both give identical outputs.
  """
  p = topk_ids.shape[0] * topk_ids.shape[1]
  if use_pallas is None:
    use_pallas = jax.default_backend() == "gpu" and p <= MoeConfig.align_max_pairs
  if not use_pallas:
    return _segments_xla(topk_ids, topk_weights)
  order, seg, _, w_rows = _align(topk_ids, topk_weights, has_shared=False, interpret=interpret)
  return order, seg, w_rows


# ----------------------------------------------------------------------------- kernels


def _dot_t(a, b):
  """a [M, K] @ b[N, K].T -> [M, N] fp32 (IEEE for fp32 operands)."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plt.dot(a, b, trans_b=True, precision=prec)


def _up_body(x_ref, tok_ref, wg, wu, h_ref, start, length, col0, *, cfg, d, limit, h_off=0):
  """h[h_off + start:h_off + start+length, col0:col0+BI] = SwiGLU(x[tok] @ wg.T, x[tok] @ wu.T), tok the table's
  rows [start, start + length) (h_off: a shared chunk's rows past the tables', see the module docstring).

  wg, wu: callables kb -> [BI, BK] weight tiles of this segment's expert.
  """
  bm, bk = cfg.block_m, cfg.block_k
  rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
  kcols = lax.broadcasted_iota(jnp.int32, (1, bk), 1)

  def m_block(mb, carry):
    r0 = start + mb * bm
    mask = rows + mb * bm < length                                     # [M, 1]
    tok = plt.load(tok_ref.at[pl.ds(r0, bm)], mask=mask[:, 0], other=0)[:, None]   # [M, 1]
    xmask = jnp.broadcast_to(mask, (bm, bk))

    def k_step(kb, acc):
      ag, au = acc
      xb = plt.load(x_ref.at[tok, kcols + kb * bk], mask=xmask, other=0.0)   # gather [M, BK]
      return ag + _dot_t(xb, wg(kb)), au + _dot_t(xb, wu(kb))

    zero = jnp.zeros((bm, cfg.block_i), jnp.float32)
    g, u = lax.fori_loop(0, d // bk, k_step, (zero, zero))
    h = _swiglu(g, u, limit).astype(h_ref.dtype)
    plt.store(h_ref.at[pl.ds(r0 + h_off, bm), pl.ds(col0, cfg.block_i)], h,
              mask=jnp.broadcast_to(mask, h.shape))
    return carry

  lax.fori_loop(0, pl.cdiv(length, bm), m_block, 0)


def _up_kernel(seg_ref, tok_ref, x_ref, wg_ref, wu_ref, *rest, cfg, d, limit, shared_limit,
               n_routed_slots, has_shared, i=0):
  if has_shared:
    swg_ref, swu_ref, h_ref = rest
  else:
    (h_ref,) = rest
  s, ib = pl.program_id(0), pl.program_id(1)
  st = jnp.minimum(s, n_routed_slots) if has_shared else s   # a shared chunk's program reads slot P's entries
  start, length, e = seg_ref[0, st], seg_ref[1, st], seg_ref[2, st]
  col0 = ib * cfg.block_i
  cols, bk = pl.ds(col0, cfg.block_i), cfg.block_k
  body = functools.partial(_up_body, x_ref, tok_ref, cfg=cfg, d=d)

  @pl.when((s < n_routed_slots) & (length > 0))
  def _routed():
    body(lambda kb: wg_ref[e, cols, pl.ds(kb * bk, bk)],
         lambda kb: wu_ref[e, cols, pl.ds(kb * bk, bk)],
         h_ref, start, length, col0, limit=limit)

  if has_shared:
    @pl.when(s >= n_routed_slots)
    def _shared():
      c = s - n_routed_slots                                           # chunk c: columns [c I, (c + 1) I)
      scols = pl.ds(c * i + col0, cfg.block_i)
      body(lambda kb: swg_ref[scols, pl.ds(kb * bk, bk)],
           lambda kb: swu_ref[scols, pl.ds(kb * bk, bk)],
           h_ref, start, length, col0, limit=shared_limit, h_off=c * length)


def _down_rows(h_ref, wd, r0, mask, *, bn, bk, i, unroll=False):
  """[M, BN] fp32 = h[r0:r0+M] @ wd.T over I in BK steps (masked rows read as 0).

  wd: a callable kb -> [BN, BK] tile (a loop over kb; unroll: a Python loop, so no scf.for is left
  inside the caller's loop), or a tuple of the I/BK tiles already loaded (prefetched; the loop is
  unrolled). Either way the K steps are added in order 0, BK, 2 BK, ...
  """
  bm = mask.shape[0]

  def k_step(kb, acc):
    hb = plt.load(h_ref.at[pl.ds(r0, bm), pl.ds(kb * bk, bk)],
                  mask=jnp.broadcast_to(mask, (bm, bk)), other=0.0)
    return acc + _dot_t(hb, wd[kb] if isinstance(wd, tuple) else wd(kb))

  acc = jnp.zeros((bm, bn), jnp.float32)
  if isinstance(wd, tuple) or unroll:
    for kb in range(len(wd) if isinstance(wd, tuple) else i // bk):
      acc = k_step(kb, acc)
    return acc
  return lax.fori_loop(0, i // bk, k_step, acc)


def _down_body(h_ref, wd, w_ref, y_ref, start, length, col0, *, cfg, i, order_ref=None, h_off=0):
  """v1: y[dst, col0:col0+BD] = w[row] * (h[rows] @ wd.T) for one segment; dst = order[row] (the pair's row:
  y comes out in pair order t*A + a) or, order_ref None (the shared expert's rows), the row itself; a shared
  chunk's h and y rows are h_off past the table's (w: the table's row)."""
  bm = cfg.block_m
  rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
  cols = lax.broadcasted_iota(jnp.int32, (1, cfg.block_d), 1) + col0

  def m_block(mb, carry):
    r0 = start + mb * bm
    mask = rows + mb * bm < length
    acc = _down_rows(h_ref, wd, r0 + h_off, mask, bn=cfg.block_d, bk=cfg.block_kd, i=i)
    w = plt.load(w_ref.at[pl.ds(r0, bm)], mask=mask[:, 0], other=0.0)   # [M]
    if order_ref is None:
      dst = y_ref.at[pl.ds(r0 + h_off, bm), pl.ds(col0, cfg.block_d)]
    else:
      pair = plt.load(order_ref.at[pl.ds(r0, bm)], mask=mask[:, 0], other=0)[:, None]   # [M, 1]
      # masked lanes store nothing on the GPU; the interpreter writes their old values back, so each gets its
      # own row of the pad past R (never read) instead of one row of real output
      spare = y_ref.shape[0] - bm + rows
      dst = y_ref.at[jnp.where(mask, pair, spare), cols]
    plt.store(dst, acc * w[:, None], mask=jnp.broadcast_to(mask, acc.shape))
    return carry

  lax.fori_loop(0, pl.cdiv(length, bm), m_block, 0)


def _down_kernel(seg_ref, order_ref, h_ref, w_ref, wd_ref, *rest, cfg, i, n_routed_slots, has_shared):
  if has_shared:
    swd_ref, y_ref = rest
  else:
    (y_ref,) = rest
  s, db = pl.program_id(0), pl.program_id(1)
  st = jnp.minimum(s, n_routed_slots) if has_shared else s   # a shared chunk's program reads slot P's entries
  start, length, e = seg_ref[0, st], seg_ref[1, st], seg_ref[2, st]
  col0 = db * cfg.block_d
  cols, bk = pl.ds(col0, cfg.block_d), cfg.block_kd
  body = functools.partial(_down_body, h_ref, cfg=cfg, i=i)

  @pl.when((s < n_routed_slots) & (length > 0))
  def _routed():
    body(lambda kb: wd_ref[e, cols, pl.ds(kb * bk, bk)], w_ref, y_ref, start, length, col0, order_ref=order_ref)

  if has_shared:
    @pl.when(s >= n_routed_slots)
    def _shared():
      c = s - n_routed_slots                                           # chunk c: reduction columns [c I, (c + 1) I)
      body(lambda kb: swd_ref[cols, pl.ds(c * i + kb * bk, bk)], w_ref, y_ref, start, length, col0,
           h_off=c * length)


def _combine_segment(h_ref, w_ref, tok_ref, wd, acc, start, length, *, cfg, i, h_off=0, max_rows=None):
  """acc[T', BDC] += sum over the segment's rows m of onehot(tok[m]) * w[m] * (h[h_off + m] @ wd.T).

  Rows of other tokens contribute exact zeros (a select, not a multiply: no 0 * inf). h_off: a
  shared chunk's h rows past the table's (its tok / w rows are the table's). max_rows: a static
  bound on the segment's length (the residual path: T), so its row blocks and the K loop are
  unrolled (no loop inside the caller's slot loop); None: any length (a loop over row blocks).
  """
  bm, tp = cfg.block_m, acc.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
  tids = lax.broadcasted_iota(jnp.int32, (tp, 1, 1), 0)

  def m_block(mb, acc):
    r0 = start + mb * bm
    mask = rows + mb * bm < length                                      # [M, 1]
    y = _down_rows(h_ref, wd, r0 + h_off, mask, bn=cfg.block_dc, bk=cfg.block_kd, i=i,
                   unroll=max_rows is not None)                         # [M, BDC]
    w = plt.load(w_ref.at[pl.ds(r0, bm)], mask=mask[:, 0], other=0.0)    # [M]
    tok = plt.load(tok_ref.at[pl.ds(r0, bm)], mask=mask[:, 0], other=-1)   # [M]
    hit = tids == tok[None, :, None]                                    # [T', M, 1]
    return acc + jnp.sum(jnp.where(hit, (y * w[:, None])[None], 0.0), axis=1)

  if max_rows is None:
    return lax.fori_loop(0, pl.cdiv(length, bm), m_block, acc)
  for mb in range(pl.cdiv(max_rows, bm)):
    acc = m_block(mb, acc)
  return acc


def _down_combine_kernel(seg_ref, tok_ref, h_ref, w_ref, wd_ref, *rest, cfg, i, t, tp, e,
                         n_routed_slots, has_shared, n_chunks=1, moe_dtype=None, with_residual=False):
  """Grid (D/BDC, split): out[j, :, cols] = sum over program j's slots in order (ascending
  expert, the shared slot last in the last split: its n_chunks chunks in order).
  with_residual (split 1): out[:, cols] = round(f32(residual) + f32(round(acc, moe_dtype))), each
  element written by this one program, so the residual is added once; the slots' rows are then
  at most T (each token's experts distinct) and unrolled (see `_combine_segment`)."""
  rest = list(rest)
  swd_ref = rest.pop(0) if has_shared else None
  res_ref = rest.pop(0) if with_residual else None
  (out_ref,) = rest
  db, j = pl.program_id(0), pl.program_id(1)
  split = cfg.combine_split
  col0 = db * cfg.block_dc
  cols, bk = pl.ds(col0, cfg.block_dc), cfg.block_kd
  seg_body = functools.partial(_combine_segment, h_ref, w_ref, tok_ref, cfg=cfg, i=i,
                               max_rows=t if with_residual else None)
  # Slots are sorted by expert, empty ones last: this program's slots are [s_lo, s_hi).
  pp = _pow2(n_routed_slots)
  lane = lax.broadcasted_iota(jnp.int32, (1, pp), 1) < n_routed_slots
  lens = plt.load(seg_ref.at[pl.ds(1, 1), pl.ds(0, pp)], mask=lane, other=0)    # [1, PP]
  exps = plt.load(seg_ref.at[pl.ds(2, 1), pl.ds(0, pp)], mask=lane, other=0)
  below = lambda lim: jnp.sum(((lens > 0) & (exps < lim)).astype(jnp.int32)[0])
  s_lo = below(j * e // split) if split > 1 else 0
  s_hi = below((j + 1) * e // split) if split > 1 else jnp.sum((lens > 0).astype(jnp.int32)[0])

  acc = jnp.zeros((tp, cfg.block_dc), jnp.float32)
  if cfg.prefetch:   # slot s computes on tiles loaded during slot s-1 (loads in flight across slots)
    last = jnp.maximum(s_hi - 1, 0)
    tiles = lambda s: tuple(wd_ref[seg_ref[2, s], cols, pl.ds(kb * bk, bk)]
                            for kb in range(i // bk))

    def slot_pf(s, carry):
      acc, cur = carry
      nxt = tiles(jnp.minimum(s + 1, last))
      return seg_body(cur, acc, seg_ref[0, s], seg_ref[1, s]), nxt

    acc, _ = lax.fori_loop(s_lo, s_hi, slot_pf, (acc, tiles(jnp.minimum(s_lo, last))))
  else:
    def slot(s, acc):
      start, length, ex = seg_ref[0, s], seg_ref[1, s], seg_ref[2, s]
      return seg_body(lambda kb: wd_ref[ex, cols, pl.ds(kb * bk, bk)], acc, start, length)

    acc = lax.fori_loop(s_lo, s_hi, slot, acc)
  if has_shared:
    s = n_routed_slots
    length = seg_ref[1, s] if split == 1 else jnp.where(j == split - 1, seg_ref[1, s], 0)
    for c in range(n_chunks):   # chunk c: the reduction columns [c I, (c + 1) I), its h rows c T past the slot's
      acc = seg_body(lambda kb, c=c: swd_ref[cols, pl.ds(c * i + kb * bk, bk)], acc, seg_ref[0, s], length,
                     h_off=c * t)
  rows = lax.broadcasted_iota(jnp.int32, (tp, 1), 0)
  live = jnp.broadcast_to(rows < t, acc.shape)
  dst = out_ref.at[pl.ds(0, tp), cols] if split == 1 else out_ref.at[j, pl.ds(0, tp), cols]
  if with_residual:   # the model's rounding points: the MoE sum to the activation dtype, then the stream's add
    res = plt.load(res_ref.at[pl.ds(0, tp), cols], mask=live, other=0.0)
    out = res.astype(jnp.float32) + acc.astype(moe_dtype).astype(jnp.float32)
  else:
    out = acc
  plt.store(dst, out.astype(out_ref.dtype), mask=live)


# ----------------------------------------------------------------------------- wrapper


def _rows(topk_ids, topk_weights, cfg, has_shared):
  """(order [P], seg [3, S], tok [R], w_rows [R]) from the Pallas or the XLA align."""
  t, a = topk_ids.shape
  p = t * a
  if cfg.device_align and p <= cfg.align_max_pairs:
    return _align(topk_ids, topk_weights, has_shared=has_shared, interpret=cfg.interpret)
  order, seg, w_rows = _segments_xla(topk_ids, topk_weights)
  tok = order // a
  if has_shared:
    tok = jnp.concatenate([tok, jnp.arange(t, dtype=jnp.int32)])
    w_rows = jnp.concatenate([w_rows, jnp.ones((t,), jnp.float32)])
    seg = jnp.concatenate([seg, jnp.array([[p], [t], [0]], jnp.int32)], axis=1)
  return order, seg, tok, w_rows


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "config"))
def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, limit=0.0, shared=None,
        shared_limit=0.0, config=None):
  """Pallas (Triton) MoE: x [T, D], topk_ids / topk_weights [T, A], experts [E, I, D] / [E, D, I], shared (gate
  [Is, D], up [Is, D], down [D, Is], Is a multiple of I: n chunks, see the module docstring) or None -> [T, D] in x.dtype; the reference is the model's ling_jax.layers.moe.moe_experts,
  rounded to x.dtype."""
  cfg = config or MoeConfig()
  order, seg, tok, w_rows = _rows(topk_ids, topk_weights, cfg, shared is not None)
  return _moe_rows(x, order, seg, tok, w_rows, w_gate, w_up, w_down, limit=limit, shared=shared,
                   shared_limit=shared_limit, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "config"))
def moe_segments(x, order, seg, tok, w_rows, w_gate, w_up, w_down, *, limit=0.0, shared=None, shared_limit=0.0,
                 residual=None, config=None):
  """`moe` on tables a caller built (pallas_kernels.router_segments.route_segments: the router's own launch), in
  _align's layout: order [P], seg [3, S], tok [R], w_rows [R] (S = P + 1 and R = P + T with the shared expert)
  -> [T, D] in x.dtype. Nothing runs between the router and the up kernel.
  residual [T, D] or None: return residual + the MoE (rounded to x.dtype first, then the add, in residual's
  dtype: the model's `x + moe_layer(x)`) from the down launch's epilogue (the fused combine, split 1; T <=
  RESIDUAL_MAX_TOKENS; see the module docstring). The tables must come from a top-k (each token's experts
  distinct, so no segment has more than T rows), as route_segments builds them."""
  return _moe_rows(x, order, seg, tok, w_rows, w_gate, w_up, w_down, limit=limit, shared=shared,
                   shared_limit=shared_limit, cfg=config or MoeConfig(), residual=residual)


def _moe_rows(x, order, seg, tok, w_rows, w_gate, w_up, w_down, *, limit, shared, shared_limit, cfg, residual=None):
  """The up and down launches (and the combine; with residual, the add too) on the alignment tables."""
  t, d = x.shape
  e, i, d2 = w_gate.shape
  p = order.shape[0]
  a = p // t
  assert d2 == d and w_up.shape == w_gate.shape and w_down.shape == (e, d, i) and p == t * a, (
      x.shape, w_gate.shape, w_up.shape, w_down.shape, order.shape)
  cfg.check(d, i)
  n_chunks = 0 if shared is None else shared[0].shape[0] // i
  if shared is not None and (shared[0].shape[0] % i or shared[0].shape[1:] != (d,) or shared[1].shape != shared[0].shape
                             or shared[2].shape != (d, shared[0].shape[0])):
    raise ValueError(f"shared expert {shared[0].shape} / {shared[2].shape}: the kernels run it as segments of the "
                     f"routed width I={i}, so its width must be a multiple of I (ling_jax.kernel_calls runs another "
                     f"width through the model)")
  if residual is not None:
    if residual.shape != (t, d):
      raise ValueError(f"residual {residual.shape} must be [T, D] = {(t, d)}")
    if t > RESIDUAL_MAX_TOKENS:
      raise ValueError(f"residual with T={t} rows > {RESIDUAL_MAX_TOKENS}: the residual path unrolls T rows per "
                       "slot (decode / verify rows); add the residual to the MoE's output instead")
    if cfg.combine_split != 1:
      raise ValueError(f"residual with combine_split={cfg.combine_split}: the partials are summed after the kernel, "
                       "so no program could add the residual once; use combine_split=1")

  has_shared = shared is not None
  # a shared expert of n chunks: n - 1 more programs (slots P + 1 ..) and their h / y rows past the tables'
  extra_slots = max(n_chunks - 1, 0)
  n_slots, rows = seg.shape[1] + extra_slots, tok.shape[0] + extra_slots * t
  pad = cfg.block_m              # h rows: every masked [M, *] block stays inside the buffer
  params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)

  up = functools.partial(_up_kernel, cfg=cfg, d=d, limit=float(limit),
                         shared_limit=float(shared_limit), n_routed_slots=p,
                         has_shared=has_shared, i=i)
  extra_up = (shared[0], shared[1]) if has_shared else ()
  h = pl.pallas_call(
      up, grid=(n_slots, i // cfg.block_i),
      out_shape=jax.ShapeDtypeStruct((rows + pad, i), x.dtype),
      compiler_params=params, interpret=cfg.interpret, name="moe_up_swiglu",
  )(seg, tok, x, w_gate, w_up, *extra_up)

  extra_down = (shared[2],) if has_shared else ()
  if cfg.fuse_combine or residual is not None:
    split = cfg.combine_split
    with_residual = residual is not None
    down = functools.partial(_down_combine_kernel, cfg=cfg, i=i, t=t, tp=_pow2(t), e=e,
                             n_routed_slots=p, has_shared=has_shared, n_chunks=max(n_chunks, 1),
                             moe_dtype=x.dtype, with_residual=with_residual)
    out_dtype = residual.dtype if with_residual else x.dtype if split == 1 else jnp.float32
    out = pl.pallas_call(
        down, grid=(d // cfg.block_dc, split),
        out_shape=jax.ShapeDtypeStruct((t, d) if split == 1 else (split, t, d), out_dtype),
        compiler_params=params, interpret=cfg.interpret,
        name="moe_down_residual" if with_residual else "moe_down_combine",
    )(seg, tok, h, w_rows, w_down, *extra_down, *((residual,) if with_residual else ()))
    if split == 1:
      return out
    return functools.reduce(lambda acc, q: acc + q, list(out)).astype(x.dtype)  # fixed order

  down = functools.partial(_down_kernel, cfg=cfg, i=i, n_routed_slots=p,
                           has_shared=has_shared)
  y = pl.pallas_call(
      down, grid=(n_slots, d // cfg.block_d),
      out_shape=jax.ShapeDtypeStruct((rows + pad, d), jnp.float32),
      compiler_params=params, interpret=cfg.interpret, name="moe_down",
  )(seg, order, h, w_rows, w_down, *extra_down)

  # Combine: pair t*A + a sits at row t*A + a (the down kernel stored it there), the shared expert's chunk c at
  # P + c T + t (one chunk where Is == I), added in chunk order.
  out = y[:p].reshape(t, a, d).sum(axis=1)                            # [T, D] fp32
  for c in range(n_chunks):
    out = out + y[p + c * t:p + (c + 1) * t]
  return out.astype(x.dtype)
