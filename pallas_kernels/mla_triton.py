"""MLA decode/verify attention over the LIVE cache prefix, absorbed weights: Triton, split-K (flash decoding).

Shape legend: B batch, T query positions (verify rows, <= ~17), H heads, M = T*H query rows (row m = t*H + h,
the free flattening of [B, T, H, *]), Lr latent width (kv_lora_rank), R rope width, F = Lr + R cache row,
S cache slots, BM query rows per attend program, BS slots per block, SB blocks per split (a split = SB*BS
slots), NS = ceil(S / (SB*BS)) splits, BT rows per combine program, P = qk_nope dim, Vh = v head dim,
Lp / Rp / Vp: Lr / R / Vh rounded up to a power of 2 (Triton tiles; the columns past the width are masked).

Math (ling_jax.layers.mla.absorbed_context, then attend_absorbed's W_uv product):
  s[m, j]  = scale * (q_lat[m] . latent[j] + q_rope[m] . k_rope[j])        fp32
  visible: j <= pos[m]   (the cache already holds the T new rows: causal inside the verify rows)
  ctx[m]   = R(sum_j softmax_j(s[m]) latent[j])                             [M, Lr], R = round to the cache dtype
  o[t, h]  = W_uv[h] ctx[t*H + h]                                           [B, T, H, Vh] fp32 (with kv_b)
Two launches, whatever T and the live length live[b] = max_t pos[b, t] + 1:
  1. attend, grid (B, ceil(M / BM), NS): program (b, i, sp) runs the online softmax (fp32) of its BM rows over
     the blocks of split sp below live[b]:  per block  s = q [BM, Lr] @ latent^T + q_rope [BM, R] @ k_rope^T;
       m' = max(m, rowmax s);  p = e^(s - m');  l = l e^(m - m') + rowsum p;  acc = acc e^(m - m') + R(p) @ latent
     and writes acc [BM, Lp], m, l [BM] f32 of the split. The latent and rope columns are two loads of the one
     cache row (no XLA slice or concatenate: q_lat and q_rope come in as the layer made them, the stacked cache
     [L, B, S, F] is read at `layer` in place). A program whose split lies past live[b] exits at once: no loads,
     no writes; so the work is ceil(live / BS) blocks, not S / BS. The last block's slots past live[b] are
     masked out of the loads (read as 0): what a stale, rejected or never-written slot holds (NaN included) cannot
     reach the result through p = 0 times it (0 x NaN = NaN), and the cache's end needs no padding.
  2. combine, grid (B, H, ceil(T / BT)): program (b, h, k) takes the rows t*H + h of one head over the live
     splits:  M = max_sp m_sp;  w_sp = e^(m_sp - M);  ctx = R(sum_sp w_sp acc_sp / sum_sp w_sp l_sp)  (in split
     order, `combine_unroll` splits' loads in flight at a time), then with kv_b the head's output projection
     o = ctx @ W_uv[h]^T ([BT, Lr] x [Lr, Vh], W_uv read in place as rows P.. of the [H, P + Vh, Lr] kv_b_proj)
     and o [B, T, H, Vh] f32 is attend_absorbed's result; with the block's head gate g [B, T, H] f32 the combine
     also applies it, R'(o * g) in the dense projection's input dtype (ling_jax.layers.mla.gated_heads: the same
     f32 multiply and rounding as XLA's, bitwise), so no XLA kernel sits between the attention and o_proj.
Batch invariance: the block and split partition is fixed by the slot index (slot j is in split j // (SB*BS)
whatever T, B or the live length), tile shapes are fixed by the config (BM, BS, BT: not by T), a row's blocks past
its position are exact no-ops (p = 0, rescale e^0 = 1), so are the splits past it in the combine (w = 0) and the
masked groups of the unrolled loop, and both sums run in slot / split order: a row's result does not depend on
T, on its place in the tile or on the other rows (tests/test_kernels_mla_triton.py: bitwise in the interpreter).
Rounding: p is rounded to the cache dtype before P @ latent and the sum is normalised at the end, where the
model rounds the normalised probabilities; ctx is rounded to the cache dtype before W_uv as in the model.
Bytes (bf16): the live prefix of the cache once per row tile (ceil(M / BM) tiles re-read a block from L2),
ceil(live / BS) * BS * F * 2 B from HBM, plus the fp32 partials written and read once
(live splits x M x Lp x 4 B: 32 x 5 x 128 x 4 = 82 KB for the demo at T = 1, live 8192).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32


def _pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class MlaTritonConfig:
  """Tiling of the Triton MLA attention (fixed per call site: the tiles must not depend on T, batch invariance).

  Attributes:
    block_m: query rows per attend program (power of 2 >= 16: the tl.dot M side). Each row tile re-reads the
      live blocks (from L2 after the first), so fewer, larger tiles at many rows; its fp32 accumulator is
      block_m x Lp registers over the program's threads.
    block_s: cache slots per block (power of 2 >= 16).
    split_blocks: blocks per split; the split (block_s x split_blocks slots) is one attend program's share of
      the keys: smaller splits, more programs in flight at short lengths, more partials to combine.
    num_warps / num_stages: the attend program's Triton warps and software-pipeline depth of its block loop.
    combine_rows: rows (positions of one head) per combine program (power of 2 >= 16: the W_uv tl.dot M side).
    combine_unroll: splits whose partials the combine loads at once (their L2 latencies overlap).
    combine_num_warps: the combine program's warps.
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_m: int = 16
  block_s: int = 64
  split_blocks: int = 4
  num_warps: int = 4
  num_stages: int = 3
  combine_rows: int = 16
  combine_unroll: int = 4
  combine_num_warps: int = 4
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_m", "block_s", "combine_rows"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of 2 >= 16 (a tl.dot side)")
    for name in ("split_blocks", "num_stages", "combine_unroll"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    for name in ("num_warps", "combine_num_warps"):
      if getattr(self, name) not in (1, 2, 4, 8, 16):
        raise ValueError(f"{name}={getattr(self, name)} must be one of 1, 2, 4, 8, 16")

  @property
  def split(self) -> int:
    """Cache slots per split."""
    return self.block_s * self.split_blocks


@dataclasses.dataclass(frozen=True)
class _Dims:
  """Static sizes of one call (P: the q_nope width absorbed in the kernel, 0 where q_lat comes in)."""
  t: int
  h: int
  lr: int
  r: int
  s: int
  ns: int
  p: int = 0

  @property
  def m(self) -> int:
    return self.t * self.h

  @property
  def lp(self) -> int:
    return _pow2(self.lr)

  @property
  def rp(self) -> int:
    return _pow2(self.r)


def _dot_t(a, b):
  """a [M, K] @ b [N, K]^T -> [M, N] fp32 (IEEE for fp32 operands)."""
  return plt.dot(a, b, trans_b=True, precision=lax.Precision.HIGHEST if a.dtype == F32 else None)


def _dot(a, b):
  """a [M, K] @ b [K, N] -> [M, N] fp32."""
  return plt.dot(a, b, precision=lax.Precision.HIGHEST if a.dtype == F32 else None)


def _iota(n):
  return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _live_length(pos_ref, b, d: _Dims):
  """max_t pos[b, t] + 1, at most S: the slots any row of batch row b sees."""
  tp = _pow2(d.t)
  pos = plt.load(pos_ref.at[b, pl.ds(0, tp)], mask=_iota(tp) < d.t, other=-1)
  return jnp.minimum(jnp.max(pos) + 1, d.s)


def _span(start: int, size: int, dim: int, zero):
  """pl.ds(start, size) of a dim of `dim` entries. A span that runs past the dim (a width rounded up to a power
  of 2, its tail masked) gets a traced start (start + zero, zero a traced 0 of the program): a ref's static bounds
  check rejects a constant start there, while the masked load reads (and the interpreter pads) only the entries
  inside. Powers of 2 keep the constant."""
  if start == 0 or start + size <= dim:
    return pl.ds(start, size)
  return pl.ds(start + zero, size)


def _col_mask(width: int, padded: int):
  """[1, padded] columns inside the width, or None when the tile is the width (no mask: vector loads)."""
  return None if padded == width else (_iota(padded) < width)[None, :]


def _load(view, row_mask, col_mask):
  """A [rows, cols] tile of `view` (one indexer: the interpreter pads its out-of-bounds slices), zeros where
  a row or column mask is False; a plain load where neither is given."""
  masks = [m for m in (None if row_mask is None else row_mask[:, None], col_mask) if m is not None]
  if not masks:
    return view[...]
  mask = masks[0] if len(masks) == 1 else masks[0] & masks[1]
  return plt.load(view, mask=jnp.broadcast_to(mask, view.shape), other=0)


def _rotated(qr_ref, b, rows, row_pos, d: _Dims, theta: float, col0: int):
  """The rope queries of `rows` (columns [col0, col0 + R) of qr_ref) rotated at their positions
  (ling_jax.layers.rope, same f32 ops: inv_freq_i = theta^(-2i / R), angle pos * inv_freq_i, pairs (2i, 2i+1)):
  q'[j] = q[j] cos + sign_j q[j ^ 1] sin, sign -1 on even j, rounded to q_rope's dtype. [BM, Rp]; the pair
  partner is a second (gathered) load of the same tile."""
  j = _iota(d.rp)
  ok = (rows < d.m)[:, None] & (j < d.r)[None, :]
  at = lambda cols: qr_ref.at[b, jnp.minimum(rows, d.m - 1)[:, None], col0 + jnp.minimum(cols, d.r - 1)[None, :]]
  x = plt.load(at(j), mask=ok, other=0).astype(F32)
  partner = plt.load(at(j + 1 - 2 * (j % 2)), mask=ok, other=0).astype(F32)
  inv_freq = jnp.float32(theta) ** (-(2 * (j // 2)).astype(F32) / d.r)      # [Rp]
  ang = row_pos.astype(F32)[:, None] * inv_freq[None, :]
  sign = jnp.where(j % 2 == 0, -1.0, 1.0)[None, :]
  return (x * jnp.cos(ang) + (sign * partner) * jnp.sin(ang)).astype(qr_ref.dtype)


def _queries(q_ref, qr_ref, kvb_ref, b, rows, row_pos, q_rows, d: _Dims, dtype, *, rope_theta, rope_col0):
  """The attend program's query tiles in the cache dtype: q_lat [BM, Lp] (q_ref's columns [0, Lr), or with P
  the absorbed q_nope @ W_uk of q_ref's columns [0, P), as the model's einsum rounded to q's dtype) and the
  rope queries [BM, Rp] (qr_ref's columns [rope_col0, +R), rotated here with rope_theta)."""
  row_ok = rows < d.m
  q_ok = row_ok if d.m % len(rows) else None                  # len(rows) = BM
  lat_cols = _col_mask(d.lr, d.lp)
  if d.p:
    pp = _pow2(d.p)
    p_cols = _col_mask(d.p, pp)
    q_nope = _load(q_ref.at[b, q_rows, pl.ds(0, pp)], q_ok, p_cols)                 # [BM, Pp]
    p_rows = None if pp == d.p else _iota(pp) < d.p
    head = rows % d.h
    q_lat = jnp.zeros((len(rows), d.lp), F32)
    for hh in range(d.h):                                       # each row takes its own head's W_uk; the
      w_uk = _load(kvb_ref.at[jnp.int32(hh), pl.ds(0, pp), pl.ds(0, d.lp)], p_rows, lat_cols)   # others: exact 0s
      q_lat = q_lat + _dot(jnp.where((head == hh)[:, None], q_nope, 0).astype(w_uk.dtype), w_uk)
    q = q_lat.astype(q_ref.dtype)
  else:
    q = _load(q_ref.at[b, q_rows, pl.ds(0, d.lp)], q_ok, lat_cols)                  # [BM, Lp]
  if rope_theta is not None:
    qr = _rotated(qr_ref, b, rows, row_pos, d, rope_theta, rope_col0)
  else:
    qr = _load(qr_ref.at[b, q_rows, _span(rope_col0, d.rp, qr_ref.shape[-1], b * 0)], q_ok, _col_mask(d.r, d.rp))
  return q.astype(dtype), qr.astype(dtype)


def _attend_kernel(pos_ref, q_ref, qr_ref, cache_ref, *rest, d: _Dims, cfg: MlaTritonConfig, scale: float,
                   layer: int | None, rope_theta: float | None, rope_col0: int):
  """rest: [kv_b [H, P + Vh, Lr] where W_uk is absorbed here (d.p > 0)], then the outputs acc, m, l."""
  acc_ref, m_ref, l_ref = rest[-3:]
  b, tile, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bm, bs = cfg.block_m, cfg.block_s
  first = sp * cfg.split
  live = _live_length(pos_ref, b, d)
  n_blocks = jnp.clip(pl.cdiv(live - first, bs), 0, cfg.split_blocks)

  @pl.when(n_blocks > 0)                                       # past the live prefix: exit, no loads, no writes
  def _live():
    rows = tile * bm + _iota(bm)                               # [BM] query rows t*H + h
    row_pos = plt.load(pos_ref.at[b, rows // d.h], mask=rows < d.m, other=-1)   # [BM]; padding rows see nothing
    q_rows = pl.ds(tile * bm, bm)
    q, qr = _queries(q_ref, qr_ref, rest[0] if d.p else None, b, rows, row_pos, q_rows, d, cache_ref.dtype,
                     rope_theta=rope_theta, rope_col0=rope_col0)
    lat_cols, rope_cols = _col_mask(d.lr, d.lp), _col_mask(d.r, d.rp)
    at = (b,) if layer is None else (jnp.int32(layer), b)      # an array: the interpreter's masked load takes
                                                                # no Python int index (W_uk's head: the same)

    def block(j, carry):
      acc, m, l = carry
      j0 = first + j * bs
      slot = j0 + _iota(bs)                                    # [BS]
      in_live = slot < live                                    # the last block's slots past the live length
      lat = _load(cache_ref.at[(*at, pl.ds(j0, bs), pl.ds(0, d.lp))], in_live, lat_cols)           # [BS, Lp]
      rope = _load(cache_ref.at[(*at, pl.ds(j0, bs), _span(d.lr, d.rp, d.lr + d.r, b * 0))], in_live, rope_cols)
      s = (_dot_t(q, lat) + _dot_t(qr, rope)) * scale          # [BM, BS]
      s = jnp.where(slot[None, :] <= row_pos[:, None], s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)        # a row that sees nothing yet: no NaN
      alpha = jnp.exp(m - m_base)
      p = jnp.exp(s - m_base[:, None])
      l = l * alpha + jnp.sum(p, axis=1)
      acc = acc * alpha[:, None] + _dot(p.astype(lat.dtype), lat)
      return acc, m_new, l

    init = (jnp.zeros((bm, d.lp), F32), jnp.full((bm,), -jnp.inf, F32), jnp.zeros((bm,), F32))
    acc, m, l = lax.fori_loop(0, n_blocks, block, init)
    acc_ref[b, sp, q_rows, :] = acc
    m_ref[b, sp, q_rows] = m
    l_ref[b, sp, q_rows] = l


def _combine_kernel(pos_ref, m_ref, l_ref, acc_ref, *rest, d: _Dims, cfg: MlaTritonConfig, v_rows, ctx_dtype,
                    gated: bool = False):
  """ctx[b, t, h] = R(sum_sp w_sp acc_sp / sum_sp w_sp l_sp), w_sp = e^(m_sp - max m) over the live splits in
  split order; with kv_b (v_rows = (P, Vh)) the head's W_uv product, and with gated (rest: kv_b, gate [B, T, H]
  f32, out) that product times the head's gate, stored in the output's dtype. The partials come in as
  [B, NS, T', H, *] (the attend's rows t*H + h, T' H >= its padded rows): head h's rows are one strided slice."""
  out_ref = rest[-1]
  b, h, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bt, unroll = cfg.combine_rows, cfg.combine_unroll
  t_rows = pl.ds(k * bt, bt)
  t_ok = k * bt + _iota(bt) < d.t                              # [BT]
  n_live = pl.cdiv(_live_length(pos_ref, b, d), cfg.split)
  nsp = _pow2(d.ns)
  live_t = (_iota(nsp) < n_live)[:, None] & t_ok[None, :]      # [NSp, BT]
  m_all = plt.load(m_ref.at[b, pl.ds(0, nsp), t_rows, h], mask=live_t, other=-jnp.inf)
  m_max = jnp.max(m_all, axis=0)                               # [BT]: exact whatever the order
  m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)             # padding rows only (a real row sees slot 0)
  ctx_cols = jnp.broadcast_to(t_ok[:, None], (bt, d.lp))

  def group(g, carry):
    ctx, l_sum = carry
    for u in range(unroll):                                    # loads of `unroll` splits in flight
      sp = g * unroll + u
      ok = t_ok & (sp < n_live)
      w = jnp.exp(plt.load(m_ref.at[b, sp, t_rows, h], mask=ok, other=-jnp.inf) - m_max)   # 0: not live/seen
      part = plt.load(acc_ref.at[b, sp, t_rows, h, :], mask=ctx_cols & ok[:, None], other=0.0)   # [BT, Lp]
      l_sum = l_sum + w * plt.load(l_ref.at[b, sp, t_rows, h], mask=ok, other=0.0)
      ctx = ctx + w[:, None] * part
    return ctx, l_sum

  init = (jnp.zeros((bt, d.lp), F32), jnp.zeros((bt,), F32))
  ctx, l_sum = lax.fori_loop(0, pl.cdiv(n_live, unroll), group, init)
  ctx = (ctx / jnp.where(t_ok, l_sum, 1.0)[:, None]).astype(ctx_dtype)   # the model's ctx in the cache dtype
  lat_cols = _col_mask(d.lr, d.lp)
  if v_rows is None:                                           # ctx [B, T, H, Lr]
    plt.store(out_ref.at[b, t_rows, h, pl.ds(0, d.lp)], ctx,
              mask=ctx_cols if lat_cols is None else ctx_cols & lat_cols)
    return
  p_off, vh = v_rows
  vp = _pow2(vh)
  v_ok = None if vp == vh else _iota(vp) < vh
  w_uv = _load(rest[0].at[h, _span(p_off, vp, p_off + vh, b * 0), pl.ds(0, d.lp)], v_ok, lat_cols)   # W_uv[h] [Vp, Lp]
  o = _dot_t(ctx.astype(w_uv.dtype), w_uv)                     # [BT, Vp] fp32
  if gated:                                                    # o * g in f32, rounded once by the store's cast
    g = plt.load(rest[1].at[b, t_rows, h], mask=t_ok, other=0.0)   # [BT] f32
    o = (o * g[:, None]).astype(out_ref.dtype)
  o_mask = jnp.broadcast_to(t_ok[:, None], (bt, vp))
  plt.store(out_ref.at[b, t_rows, h, pl.ds(0, vp)], o, mask=o_mask if v_ok is None else o_mask & v_ok[None, :])


@functools.partial(jax.jit, static_argnames=("scale", "v_head_dim", "absorb_q", "rope_theta", "rope_offset",
                                             "config", "layer", "out_dtype"))
def mla_triton(q, q_rope, cache, positions, kv_b=None, gate=None, *, scale: float, v_head_dim: int | None = None,
               absorb_q: bool = False, rope_theta: float | None = None, rope_offset: int = 0,
               config: MlaTritonConfig | None = None, layer: int | None = None, out_dtype=None):
  """Absorbed MLA attention over the live prefix (Triton, 2 launches).

  q: q_lat [B, T, H, Lr] (q_nope @ W_uk); or with absorb_q the query heads [B, T, H, >= P] whose columns
    [0, P) are q_nope (P = kv_b's rows per head - v_head_dim): q_lat = q_nope W_uk in the attend prologue, W_uk
    read in place as kv_b[:, :P] (every program reads all H heads' W_uk: for small H * P * Lr).
  q_rope: [B, T, H, >= rope_offset + R], its columns [rope_offset, rope_offset + R) the rope queries (R = the
    cache row's width past Lr): the layer can hand its whole [q_nope | q_pe] heads in, no XLA slice. rope_theta:
    None (they are rotated), or the rope's theta: they are then UNROTATED and rotated in the attend prologue at
    each row's position (interleaved pairs, ling_jax.layers.rope's f32 ops), no XLA kernel for the rotation.
  cache: [B, S, Lr + R] with the T queries' rows already written, or the model's stacked [L, B, S, Lr + R] read
    in place at `layer`. positions: int32 [B, T] (absolute: row t sees slots j <= positions[b, t]).
  scale: qk_head_dim^-0.5.
  kv_b: None -> ctx [B, T, H, Lr] in the cache dtype (absorbed_context's). Or the layer's kv_b_proj as
    [H, P + Vh, Lr] (W_uk | W_uv rows per head, a free reshape of the weight) with v_head_dim = Vh -> the
    attention output W_uv ctx [B, T, H, Vh] f32 (attend_absorbed's), W_uv = kv_b[:, P:] read in the combine.
  gate (with kv_b): the block's head gate [B, T, H] f32 -> (W_uv ctx * gate) [B, T, H, Vh] in out_dtype (the
    dense projection's input dtype; default f32), ling_jax.layers.mla.gated_heads in the combine.
  """
  cfg = config or MlaTritonConfig()
  if layer is not None and (cache.ndim != 4 or not 0 <= layer < cache.shape[0]):
    raise ValueError(f"layer={layer} needs a stacked cache [L, B, S, F] with L > layer, got {cache.shape}")
  b, t, h = q.shape[:3]
  s, f = cache.shape[-2:]
  if absorb_q and kv_b is None:
    raise ValueError("absorb_q needs kv_b (its W_uk rows)")
  lr = q.shape[-1] if kv_b is None else kv_b.shape[2]
  p_dim = kv_b.shape[1] - v_head_dim if absorb_q else 0
  r = f - lr
  if (q_rope.shape[:3] != (b, t, h) or cache.shape[-3] != b or r <= 0 or positions.shape != (b, t)
      or q_rope.shape[-1] < rope_offset + r or cache.ndim != (3 if layer is None else 4)
      or q.shape[-1] < (p_dim if absorb_q else lr)):
    raise ValueError(f"shapes q {q.shape}, q_rope {q_rope.shape}, cache {cache.shape}, positions {positions.shape} "
                     f"(layer {layer}, absorb_q {absorb_q}): want [B,T,H,Lr] (or [B,T,H,>=P]), "
                     f"[B,T,H,>={rope_offset}+R], [(L,) B,S,Lr+R], [B,T]")
  if rope_theta is not None and r % 2:
    raise ValueError(f"rope_theta with an odd rope width R={r}: the rotation pairs columns (2i, 2i+1)")
  if kv_b is not None and (v_head_dim is None or kv_b.ndim != 3 or kv_b.shape[0] != h
                           or not 0 < v_head_dim < kv_b.shape[1] + (0 if absorb_q else 1)):
    raise ValueError(f"kv_b {kv_b.shape} with v_head_dim={v_head_dim}: want [H={h}, P + Vh, Lr] and "
                     f"0 < Vh <= P + Vh (< with absorb_q)")
  if gate is not None and (kv_b is None or gate.shape != (b, t, h)):
    raise ValueError(f"gate {gate.shape} (kv_b given: {kv_b is not None}): want [B, T, H] = {(b, t, h)} with kv_b")
  d = _Dims(t=t, h=h, lr=lr, r=r, s=s, ns=pl.cdiv(s, cfg.split), p=p_dim)
  n_tiles = pl.cdiv(d.m, cfg.block_m)
  t_rows = pl.cdiv(n_tiles * cfg.block_m, h)                  # T': the partials' rows as [T', H] (>= the tiles')
  mp = t_rows * h
  pos = positions.astype(jnp.int32)
  acc, m, l = pl.pallas_call(
      functools.partial(_attend_kernel, d=d, cfg=cfg, scale=float(scale), layer=layer,
                        rope_theta=None if rope_theta is None else float(rope_theta), rope_col0=rope_offset),
      grid=(b, n_tiles, d.ns),
      out_shape=(jax.ShapeDtypeStruct((b, d.ns, mp, d.lp), F32),    # per split: acc, m, l (live splits only)
                 jax.ShapeDtypeStruct((b, d.ns, mp), F32),
                 jax.ShapeDtypeStruct((b, d.ns, mp), F32)),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret, name="mla_triton_attend",
  )(pos, q.reshape(b, d.m, q.shape[-1]), q_rope.reshape(b, d.m, q_rope.shape[-1]), cache,
    *((kv_b,) if absorb_q else ()))
  if kv_b is None:
    v_rows, extra, out = None, (), jax.ShapeDtypeStruct((b, t, h, lr), cache.dtype)
  else:
    vh = v_head_dim
    extra = (kv_b,) if gate is None else (kv_b, gate.astype(F32))
    o_dtype = F32 if gate is None else (out_dtype or F32)     # ungated: attend_absorbed's f32 o
    v_rows, out = (kv_b.shape[1] - vh, vh), jax.ShapeDtypeStruct((b, t, h, vh), o_dtype)
  o = pl.pallas_call(
      functools.partial(_combine_kernel, d=d, cfg=cfg, v_rows=v_rows, ctx_dtype=cache.dtype,
                        gated=gate is not None),
      grid=(b, h, pl.cdiv(t, cfg.combine_rows)),
      out_shape=out,
      compiler_params=plt.CompilerParams(num_warps=cfg.combine_num_warps, num_stages=1),
      interpret=cfg.interpret, name="mla_triton_combine",
  )(pos, m.reshape(b, d.ns, t_rows, h), l.reshape(b, d.ns, t_rows, h), acc.reshape(b, d.ns, t_rows, h, d.lp),
    *extra)
  return o
