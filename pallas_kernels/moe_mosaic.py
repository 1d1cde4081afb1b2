"""Routed + shared MoE for small token counts: Mosaic GPU (Hopper: TMA + wgmma), swap-AB.

Shape legend: T tokens, N token columns (T padded to 64), D hidden, A experts per token,
E experts, I expert width, P = T*A (token, expert) pairs, S = P + 1 expert slots (slot P is
the shared expert), BI/BK up tiles, BD/BKD down tiles, KS the fixed split of I in the down GEMM.

Math (the reference is the model's ling_jax.layers.moe.moe_experts; clamp L > 0 only when on):
  g = W_gate[e] @ x^T ; u = W_up[e] @ x^T                          [I, N] fp32 (wgmma)
  h = min(silu(g), L) * clip(u, -L, L)   (routed, limit L; the shared slot: its own limit Ls; the limit after the SiLU)
  h'[s] = bf16(wc[s] * h)         wc[s, t] = routing weight of token t on slot s's expert (0: not picked)
  out^T = sum_s W_down[e_s] @ h'[s]                                  [D, N] fp32, one accumulator

Kernel plan (the weights are the wgmma M side, the few tokens the N side; no host sync, no limit on E):
  0. align, no sort: each distinct expert id gets a slot s < n_active in ascending expert order
     (an expert picked by several tokens, or twice, is read once); wc [S, N] is a one-hot
     reduction (no scatter, no atomics), in XLA (`_align`, ~6 small kernels + the pad of x; the fp8 kernel's
     operands, these and its scale tables, also in one Triton launch: moe_fp8_tables.py).
  1. `moe_mgpu_up`, grid (S, I/BI): slot s streams its expert's [BI, D] gate and up rows once
     through a TMA pipeline; epilogue SwiGLU(+clamp) * wc -> h' [S, I, N] bf16. Empty slots exit.
  2. `moe_mgpu_down`, grid (D/BD, KS): one accumulator [BD, N] runs over every active slot in
     ascending expert order, then the shared slot: the routing-weighted combine is this sum.
  3. out = sum of the KS partials in a fixed order, transposed to [T, D] (one XLA fusion).
Batch invariance: column t only gets its own experts' products (the others add exact zeros),
in ascending expert order, over a fixed I split; no float atomics anywhere.

Measured (H200, bench/results/kernels-moe-mosaic-h200-2026-11-30.json, bench_kernels.timeit, noisy at
T <= 6): rel err vs reference 2.8e-3 to 2.9e-3 (bf16 h' rounding after the weight fold), token 0
bit-identical alone and in the batch; T=17 ~356 us for 1.42 GB (~4.0 TB/s), Triton 799 us.
fp8 weights: moe_mosaic_fp8 runs these same kernels (`run_kernels`) with fp8 tiles, one scale per tile from a
per-CTA SMEM row; per step either the tile becomes bf16 in registers before a bf16 wgmma (`_weight_tile`: scaled
into the weight, or fp8_scale_on="partial": the step's fp32 partial scaled into the accumulator, `promote`), or
(fp8_activations, w8a8) an e4m3 x e4m3 wgmma reads the TMA'd tiles themselves: x arrives quantised per token
and 128 columns, and the up epilogue writes h8 = e4m3(h / s) token-major [S, N, I] with its scales times wc
[S, I/128, NS] (NS: N padded to 128 bytes, `scale_columns`) (`_store_e4m3_groups`), which the down pipeline streams beside its tiles.
Limits: tokens are padded to N columns (64; 16 or 32 for small T: x and h' tiles cost SMEM/L2
traffic and pipeline slots, not HBM); up and down are two launches (no PDL yet); the split-K
sum is one XLA fusion (it also takes the caller's residual add).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tma
from pallas_kernels.moe import _swiglu


FP8_SCALE_ON = ("weight", "partial")
FP8_CONVERTS = ("cvt", "bits")
ACT_GROUP = 128   # fp8_activations: x and h are quantised per token and ACT_GROUP columns (a weight scale block)
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)   # 448


@dataclasses.dataclass(frozen=True)
class MosaicMoeConfig:
  """Tiling for the Mosaic GPU MoE.

  Attributes:
    block_i: up GEMM: expert rows per CTA (wgmma M; multiple of 64).
    block_k: up GEMM: reduction tile over D per pipeline step (multiple of 64: 128 B swizzle).
    up_stages: up GEMM: TMA pipeline depth (SMEM slots in flight).
    block_d: down GEMM: output rows of D per CTA (wgmma M; multiple of 64).
    block_kd: down GEMM: reduction tile over I per pipeline step (multiple of 64).
    split_k: down GEMM: I is cut into this many fixed chunks (one CTA each; partials summed in
      a fixed order, so the result does not depend on the batch).
    down_stages: down GEMM: TMA pipeline depth.
    n_tokens: token columns N (wgmma N; 16, 32 or a multiple of 64; T <= N). 64 was the only choice
      before (h' rows of 128 B); 16 / 32 lower for CUDA at Ling size and run in the interpreter (not yet measured).
    fp8_operand: fp8 weights (moe_mosaic_fp8): where the dequantised bf16 tile goes before its wgmma, "smem"
      (a scratch tile; what the interpreter runs) or "registers" (skips the SMEM store; GPU only).
    fp8_scale_on: fp8 weights, bf16 wgmma: where a step's block scale s goes. "weight": the tile is dequantised
      bf16(f32(W8) * s) (the model's quant.dequantize weight) and every step accumulates into one accumulator.
      "partial": the tile is only converted (e4m3 -> bf16 is exact), each step's wgmma runs into a fresh fp32
      partial and acc += s * partial (the exact block product; no per-element multiply, one scalar FMA per
      accumulator element and step).
    fp8_convert: fp8 weights, bf16 wgmma: how a tile becomes bf16 in registers. "cvt": Mosaic's astype (this
      toolchain's PTX converts e4m3 only to f16, so e4m3 -> f16 -> f32 (-> * s) -> bf16: 4 conversions per 2
      elements; a Hopper SM converts 16 values a clock, so ~1000 clocks per 8 KB tile, ~0.5 of the HBM ceiling
      over 132 SMs: the fp8 kernel measured 0.41-0.46). "bits": integer ops, the e4m3 sign to bit 15 and its exponent | mantissa to bits 10..4
      of a bf16, which is then the value times 2^-120 for every finite e4m3 (subnormals land on bf16 subnormals),
      times 2^120 (bf16 multiply on "partial": no conversion; on "weight" in f32 with s, one f32 -> bf16
      conversion per 2 elements).
    fp8_activations: fp8 weights: e4m3 x e4m3 wgmma straight from the TMA'd tiles (w8a8, DeepSeek-V3 /
      DeepGEMM's block scheme; no per-element work on the weights). The caller passes x quantised per token and
      128-column group (ling_jax.quant.quantize_activations), the up kernel's epilogue quantises h the same way
      (its scale times the routing weight goes to the down kernel), and each K step's fp32 partial is promoted
      into the accumulator with s_w * s_x[token]. Needs block_i = 128 (one h group per CTA); the bf16-wgmma
      fields (fp8_operand, fp8_scale_on, fp8_convert) keep their defaults.
    interpret: run in the Mosaic GPU interpreter (CPU tests).
  """
  block_i: int = 64
  block_k: int = 128
  up_stages: int = 4
  block_d: int = 64
  block_kd: int = 128
  split_k: int = 3
  down_stages: int = 4
  n_tokens: int = 64
  fp8_operand: str = "smem"
  fp8_scale_on: str = "weight"
  fp8_convert: str = "cvt"
  fp8_activations: bool = False
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_i", "block_k", "block_d", "block_kd"):
      v = getattr(self, name)
      if v <= 0 or v % 64:
        raise ValueError(f"{name}={v} must be a positive multiple of 64")
    if self.n_tokens not in (16, 32) and (self.n_tokens <= 0 or self.n_tokens % 64):
      raise ValueError(f"n_tokens={self.n_tokens} must be 16, 32 or a positive multiple of 64")
    if self.n_tokens > 256:
      raise ValueError(f"n_tokens={self.n_tokens} must be <= 256 (wgmma N)")
    for name in ("up_stages", "down_stages", "split_k"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.fp8_operand not in ("smem", "registers"):
      raise ValueError(f"fp8_operand={self.fp8_operand!r} not in ('smem', 'registers')")
    if self.fp8_operand == "registers" and self.interpret:
      raise ValueError("fp8_operand='registers': the interpreter's wgmma reads operands from SMEM only")
    if self.fp8_scale_on not in FP8_SCALE_ON:
      raise ValueError(f"fp8_scale_on={self.fp8_scale_on!r} not in {FP8_SCALE_ON}")
    if self.fp8_convert not in FP8_CONVERTS:
      raise ValueError(f"fp8_convert={self.fp8_convert!r} not in {FP8_CONVERTS}")
    if self.fp8_activations:
      if self.block_i != ACT_GROUP:
        raise ValueError(f"fp8_activations=True needs block_i={ACT_GROUP} (h is quantised per {ACT_GROUP} rows of I "
                         f"inside one CTA), got {self.block_i}")
      if (self.fp8_operand, self.fp8_scale_on, self.fp8_convert) != ("smem", "weight", "cvt"):
        raise ValueError("fp8_activations=True runs e4m3 wgmma from the TMA'd tiles: fp8_operand, fp8_scale_on "
                         "and fp8_convert (the bf16 wgmma's) must keep their defaults")

  def check(self, t: int, d: int, i: int):
    for name, blk, dim in (("block_i", self.block_i, i), ("block_k", self.block_k, d),
                           ("block_d", self.block_d, d),
                           ("block_kd * split_k", self.block_kd * self.split_k, i)):
      if dim % blk:
        raise ValueError(f"{name}={blk} must divide {dim}")
    if t > self.n_tokens:
      raise ValueError(f"T={t} tokens exceed n_tokens={self.n_tokens}; raise n_tokens (<= 256)")


# ----------------------------------------------------------------------------- alignment


def _align(topk_ids, topk_weights, n, has_shared):
  """Dedupe the P expert ids on device, sort-free (a few broadcast-compare reductions).

  Slot r holds the r-th smallest distinct expert id. Returns meta [1 + P] int32 = (n_active,
  expert of slot 0..P-1; slots >= n_active hold 0) and wc [P + 1, N] f32: wc[r, c] = sum of token
  c's routing weights on slot r's expert; row P is the shared expert (1 for real tokens, else 0).
  """
  t, a = topk_ids.shape
  p = t * a
  flat = topk_ids.reshape(p).astype(jnp.int32)                        # [P] expert of pair
  tok = jnp.arange(p, dtype=jnp.int32) // a                           # [P] token of pair
  w = topk_weights.reshape(p).astype(jnp.float32)                     # [P]
  pair = jnp.arange(p, dtype=jnp.int32)
  # is_first[j]: no earlier pair picked the same expert.
  is_first = ~jnp.any((flat[:, None] == flat[None, :]) & (pair[None, :] < pair[:, None]), axis=1)
  n_active = jnp.sum(is_first.astype(jnp.int32))
  # rank[j] = number of distinct experts smaller than pair j's expert = its slot.
  rank = jnp.sum((is_first[None, :] & (flat[None, :] < flat[:, None])).astype(jnp.int32), axis=1)
  hit = is_first[None, :] & (rank[None, :] == pair[:, None])                   # [slot, P]
  slot_expert = jnp.sum(jnp.where(hit, flat[None, :], 0), axis=1)             # [P]
  # wc[r, c] = sum_j [rank_j == r][tok_j == c] w_j   (exact unless a token repeats an expert)
  sel = (rank[None, None, :] == pair[:, None, None]) & (tok[None, None, :] == jnp.arange(n)[None, :, None])
  wc = jnp.sum(jnp.where(sel, w[None, None, :], 0.0), axis=2)                 # [P, N]
  shared_row = (jnp.arange(n) < t).astype(jnp.float32) * float(has_shared)
  wc = jnp.concatenate([wc, shared_row[None]])                        # [S, N]
  meta = jnp.concatenate([n_active[None], slot_expert]).astype(jnp.int32)
  return meta, wc


# ----------------------------------------------------------------------------- kernels


def _with_row(src_gmem, body, *, kernel, buffer):
  """body(row_smem) with a GMEM row ([L] or [L/W, W]) f32 copied to SMEM (TMA + barrier); None -> body(None).
  kernel, buffer: names for tma's alignment errors."""
  if src_gmem is None:
    return body(None)

  def scope(row_smem, bar):
    tma.copy_gmem_to_smem(src_gmem, row_smem, bar, kernel=kernel, buffer=buffer)
    plgpu.barrier_wait(bar)
    return body(row_smem)
  return pl.run_scoped(scope, plgpu.SMEM(src_gmem.shape, jnp.float32), plgpu.Barrier(num_barriers=1))


def _load_row(src_gmem, kernel):
  """wc row [N] f32 from GMEM via SMEM."""
  return _with_row(src_gmem, lambda row_smem: row_smem[...], kernel=kernel, buffer="routing weights wc")


def _scale(scales, j):
  """Scale j of a CTA's scale row in SMEM, stored [L/W, W] f32 (TMA copies <= 256 elements per axis)."""
  w = scales.shape[-1]
  return scales[j // w, j % w]


BITS_SCALE = 2.0 ** 120   # e4m3 value = the bf16 of _e4m3_bits_as_bf16 times this (bf16 bias 127 - e4m3 bias 7)
_SIGN_EXP_MANT = np.int16(0x87F0 - 0x10000)   # bf16 bit 15 (sign) and bits 10..4 (e4m3 exponent | mantissa)


def _e4m3_bits_as_bf16(w8):
  """fp8_convert="bits": e4m3 -> bf16 in integer ops. The byte sign-extended to 16 bits and shifted left by 4 has
  the sign in bits 15..11 and the exponent | mantissa in bits 10..4; the mask keeps bit 15 and bits 10..4. That
  bf16 is the e4m3 value times 2^-120 for every finite e4m3 (both formats' subnormals are 0.mmm x 2^(1 - bias),
  so e4m3 subnormals land on bf16 subnormals)."""
  b = lax.bitcast_convert_type(w8, jnp.int8).astype(jnp.int16)
  return lax.bitcast_convert_type((b << 4) & _SIGN_EXP_MANT, jnp.bfloat16)


def _bf16_tile(w8, s, convert):
  """An fp8 tile in registers as bf16: bf16(f32(W8) * s) for a scalar scale s, or (s None) W8's exact bf16."""
  if convert == "bits":
    w = _e4m3_bits_as_bf16(w8)
    if s is None:
      return w * jnp.asarray(BITS_SCALE, jnp.bfloat16)                       # a power of two: exact
    return (w.astype(jnp.float32) * BITS_SCALE * s).astype(jnp.bfloat16)     # f32(W8) exactly, then * s
  w = w8.astype(jnp.float32)
  return (w if s is None else w * s).astype(jnp.bfloat16)


def _weight_tile(w_smem, scales, j, scratch, cfg):
  """The wgmma A operand of pipeline step j: the SMEM tile itself (bf16 weights, or e4m3 x e4m3 with
  fp8_activations), or (fp8 weights, bf16 wgmma: `scales` is the CTA's scale row in SMEM, one scale per tile since
  a tile lies in one 128 x 128 block) the fp8 tile in registers as bf16, times scale j where fp8_scale_on="weight"
  (bf16(f32(w8) * s), the model's dequantised weight), stored to the bf16 SMEM `scratch` tile, or kept in
  registers when scratch is None."""
  if scales is None or cfg.fp8_activations:
    return w_smem
  s = _scale(scales, j) if cfg.fp8_scale_on == "weight" else None
  tile = _bf16_tile(w_smem[...], s, cfg.fp8_convert)
  if scratch is None:
    return tile
  scratch[...] = tile
  plgpu.commit_smem()
  return scratch


def _with_scratch(cfg, fp8, shapes, body):
  """body(*scratch): bf16 SMEM tiles for the converted fp8 operands (Nones when unused)."""
  if not fp8 or cfg.fp8_operand == "registers" or cfg.fp8_activations:
    return body(*(None,) * len(shapes))
  return pl.run_scoped(body, *(plgpu.SMEM(shape, jnp.bfloat16) for shape in shapes))


def _await_register_operands(scales):
  """A register A operand must stay untouched until its wgmma has read it (fp8: wait each step)."""
  if scales is not None:
    plgpu.wgmma_wait(0)


def _promotes(cfg, fp8):
  """Whether each K step's wgmma runs into a fresh fp32 partial that is scaled into the accumulator (fp8 weights
  with fp8_scale_on="partial" or fp8_activations) instead of into the accumulator itself."""
  return fp8 and (cfg.fp8_activations or cfg.fp8_scale_on == "partial")


def _partials(shape, *operands):
  """(a_i @ b_i for each (a_i, b_i)) as fresh fp32 accumulators of `shape`; reading them waits for the wgmmas."""
  def mma(*accs):
    for acc, (a, b) in zip(accs, operands):
      plgpu.wgmma(acc, a, b)
    return tuple(acc[...] for acc in accs)
  return pl.run_scoped(mma, *[plgpu.ACC(shape)] * len(operands))


def _pin(acc):
  """An fp32 accumulator carried in registers keeps the wgmma layout."""
  return plgpu.layout_cast(acc, plgpu.Layout.WGMMA)


def scale_columns(n: int) -> int:
  """fp8_activations: columns of the per-token scale tables (x's [D/128, NS], h's [S, I/128, NS]) for N token
  columns: N rounded up to 128 bytes of f32 (NS = 32 for N = 16). Their [1, NS] blocks are TMA'd into the
  pipeline's slots, slot i at i x NS x 4 bytes: [1, 16] blocks (64 B) put every odd slot 64 bytes off the 128-byte
  TMA alignment (CUDA_ERROR_MISALIGNED_ADDRESS, the H200's first w8a8 run). Columns N.. are never read."""
  return tma.pad_to(n, jnp.float32)


def _token_scales(c, row_smem, shape):
  """fp8_activations: scalar weight scale c times the tokens' activation scales (the first N columns of an SMEM
  block [1, NS]), broadcast over the accumulator's rows."""
  return lax.broadcast_in_dim(c * row_smem.at[0, pl.ds(0, shape[1])][...], shape, (1,))


def _store_e4m3_groups(h, wc, h_gmem, hs_gmem):
  """fp8_activations, the up kernel's epilogue: h [BI = 128, N] f32 is one 128-row group of I for each token
  column t, quantised as ling_jax.quant.quantize_activations quantises a row group: s_t = max_r |h[r, t]| / 448,
  h8 = e4m3(h / s_t) (a zero column: s = 0, h8 = 0). h8 goes out token-major ([N, BI] into h8 [S, N, I]: an e4m3
  wgmma takes K-major operands only, and I is the down GEMM's K) and wc_t * s_t (the routing weight on the scale)
  into the scale table."""
  bi, n = h.shape
  s = jnp.max(jnp.abs(h), axis=0) / E4M3_MAX                          # [N]
  safe = jnp.where(s > 0, s, 1.0)
  q = h / lax.broadcast_in_dim(safe, (bi, n), (1,))
  h8 = plgpu.layout_cast(q, plgpu.Layout.WGMMA_TRANSPOSED).astype(jnp.float8_e4m3fn)  # stores transposed

  def store(h_smem, s_smem):
    h_smem.T[...] = h8
    s_smem[...] = wc * s
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_smem, h_gmem)
    plgpu.copy_smem_to_gmem(s_smem, hs_gmem.at[pl.ds(0, n)])        # columns N.. of the table: never read
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, plgpu.SMEM((n, bi), jnp.float8_e4m3fn), plgpu.SMEM((n,), jnp.float32))


def _kernel_name(fp8, cfg, part):
  return f"moe_mosaic{'_fp8' if fp8 else ''} {part}{' (w8a8)' if fp8 and cfg.fp8_activations else ''}"


def _up_slot(wg_gmem, wu_gmem, x_gmem, wc_gmem, h_gmem, ib, *, cfg, d, limit, scales_gmem=None, xs_gmem=None,
             hs_gmem=None):
  """This CTA's rows ib*BI:(ib+1)*BI of h'[s] = wc[s] * SwiGLU(wg_tile @ x^T, wu_tile @ x^T) -> h_gmem [BI, N].
  scales_gmem (fp8 weights): this CTA's row of scales, gate's of K step k at k, up's at d/BK + k.
  fp8_activations: x is e4m3, xs_gmem its scales transposed [D/128, NS] (scale_columns); h_gmem [N, BI] takes
  the e4m3 h and hs_gmem [NS] its scales times wc (_store_e4m3_groups)."""
  bi, bk, n = cfg.block_i, cfg.block_k, cfg.n_tokens
  fp8 = scales_gmem is not None
  name = _kernel_name(fp8, cfg, "up")
  spec = lambda shape, imap: plgpu.BlockSpec(shape, imap, delay_release=1)
  in_specs = [spec((bi, bk), lambda k: (ib, k)), spec((bi, bk), lambda k: (ib, k)), spec((n, bk), lambda k: (0, k))]
  operands = [wg_gmem, wu_gmem, x_gmem]
  blocks = [("gate tiles", (bi, bk), wg_gmem.dtype), ("up tiles", (bi, bk), wu_gmem.dtype),
            ("x tiles", (n, bk), x_gmem.dtype)]
  if xs_gmem is not None:  # step k's x scales: row k BK / 128 of the table
    ns = xs_gmem.shape[-1]
    in_specs.append(spec((1, ns), lambda k: (k * bk // ACT_GROUP, 0)))
    operands.append(xs_gmem)
    blocks.append(("x scales", (1, ns), xs_gmem.dtype))
  tma.check_pipeline(name, blocks, min(cfg.up_stages, d // bk))
  run = lambda step, **kw: plgpu.emit_pipeline(step, grid=(d // bk,), in_specs=in_specs,
                                               max_concurrent_steps=cfg.up_stages, **kw)(*operands)

  def accumulate(scales, g_tmp, u_tmp):
    """Every step's wgmma into one accumulator per GEMM (bf16 weights; fp8 with fp8_scale_on="weight")."""
    def scope(acc_g, acc_u):
      def step(idx, g_smem, u_smem, x_smem):
        (k,) = idx
        plgpu.wgmma(acc_g, _weight_tile(g_smem, scales, k, g_tmp, cfg), x_smem.transpose((1, 0)))  # [BI, BK] @ [BK, N]
        plgpu.wgmma(acc_u, _weight_tile(u_smem, scales, d // bk + k, u_tmp, cfg), x_smem.transpose((1, 0)))
        _await_register_operands(scales)

      run(step)
      return acc_g[...], acc_u[...]
    return pl.run_scoped(scope, plgpu.ACC((bi, n)), plgpu.ACC((bi, n)))

  def promote(scales, g_tmp, u_tmp):
    """Each step's wgmmas into fresh partials, added to the fp32 accumulators (the carry) times their scales."""
    def step(idx, g_smem, u_smem, x_smem, *xs_smem_and_carry):
      (k,) = idx
      *xs_smem, (acc_g, acc_u) = xs_smem_and_carry
      xt = x_smem.transpose((1, 0))
      pg, pu = _partials((bi, n), (_weight_tile(g_smem, scales, k, g_tmp, cfg), xt),
                         (_weight_tile(u_smem, scales, d // bk + k, u_tmp, cfg), xt))
      cg, cu = _scale(scales, k), _scale(scales, d // bk + k)
      if xs_smem:  # fp8_activations: times each token's x scale of this K group
        cg, cu = (_token_scales(c, xs_smem[0], (bi, n)) for c in (cg, cu))
      return _pin(acc_g + cg * pg), _pin(acc_u + cu * pu)

    zeros = _pin(jnp.zeros((bi, n), jnp.float32))
    return run(step, init_carry=(zeros, zeros))

  pipeline = promote if _promotes(cfg, fp8) else accumulate
  g, u = _with_row(scales_gmem, lambda scales: _with_scratch(cfg, fp8, [(bi, bk)] * 2,
                                                              functools.partial(pipeline, scales)),
                   kernel=name, buffer="weight scale row")
  wc = _load_row(wc_gmem, name)                                       # [N]
  if hs_gmem is not None:
    _store_e4m3_groups(_swiglu(g, u, limit), wc, h_gmem, hs_gmem)
    return
  h = _swiglu(g, u, limit) * lax.broadcast_in_dim(wc, (bi, n), (1,))

  def store(h_smem):
    h_smem[...] = h.astype(h_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_smem, h_gmem)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, plgpu.SMEM((bi, n), h_gmem.dtype))


def _up_kernel(meta, x_gmem, *rest, cfg, d, p, limit, shared_limit, has_shared, fp8):
  """rest: ([x scales [D/128, NS] if fp8_activations], wc, [up scales [S, I/128, R, W] if fp8], w_gate, w_up,
  [shared gate, up], h' [S, I, N] (fp8_activations: h8 [S, N, I] e4m3 and its scales [S, I/128, NS]))."""
  w8a8 = fp8 and cfg.fp8_activations
  xs_gmem, rest = (rest[0], rest[1:]) if w8a8 else (None, rest)
  wc_gmem, *rest = rest
  scales, rest = (rest[0], rest[1:]) if fp8 else (None, rest)
  wg_gmem, wu_gmem, *rest = rest
  swg, swu, *outs = rest if has_shared else (None, None, *rest)
  s, ib = lax.axis_index("s"), lax.axis_index("i")
  bi = cfg.block_i
  if w8a8:
    h8_gmem, hs_gmem = outs
    out = dict(h_gmem=h8_gmem.at[s, :, pl.ds(ib * bi, bi)], hs_gmem=hs_gmem.at[s, ib])
  else:
    out = dict(h_gmem=outs[0].at[s, pl.ds(ib * bi, bi), :])
  rows = None if scales is None else scales.at[s, (ib * bi) // 128]
  up = functools.partial(_up_slot, x_gmem=x_gmem, wc_gmem=wc_gmem.at[s], ib=ib, cfg=cfg, d=d, scales_gmem=rows,
                         xs_gmem=xs_gmem, **out)

  @pl.when(s < meta[0])
  def _routed():
    e = meta[1 + s]
    up(wg_gmem.at[e], wu_gmem.at[e], limit=limit)

  if has_shared:
    @pl.when(s == p)
    def _shared():
      up(swg, swu, limit=shared_limit)


def _down_kernel(meta, h_gmem, *rest, cfg, d, i, p, has_shared, fp8):
  """out_part[ks, db*BD:(db+1)*BD, :] = sum_s W_down[e_s][rows, chunk ks] @ h'[s, chunk ks].
  h_gmem: h' [S * I, N], or (fp8_activations) h8 [S * N, I] e4m3 token-major.
  rest: ([h8's scales [S * I/128, NS] if fp8_activations], [down scales [D/128, KS, R, W] if fp8: step j of slot s
  at s * kper + j], w_down, [shared down], out)."""
  w8a8 = fp8 and cfg.fp8_activations
  hs_gmem, rest = (rest[0], rest[1:]) if w8a8 else (None, rest)
  scales, rest = (rest[0], rest[1:]) if fp8 else (None, rest)
  wd_gmem, *rest = rest
  swd, out_gmem = rest if has_shared else (None, rest[0])
  db, ks = lax.axis_index("d"), lax.axis_index("k")
  bd, bkd, n = cfg.block_d, cfg.block_kd, cfg.n_tokens
  name = _kernel_name(fp8, cfg, "down")
  kper = i // (cfg.split_k * bkd)                   # pipeline steps per slot
  k0 = ks * kper                                    # first I block of this CTA's chunk
  spec = lambda shape, imap: plgpu.BlockSpec(shape, imap, delay_release=1)
  row = None if scales is None else scales.at[(db * bd) // 128, ks]

  def specs(slot, iblock, w_rows):
    """Step j reads slot(j)'s h' at I block iblock(j) and the weight rows w_rows(j) there (wd_gmem [E * D, I])."""
    w = spec((bd, bkd), lambda j: (w_rows(j), iblock(j)))
    if not w8a8:                                    # h' [S * I, N]
      return [w, spec((bkd, n), lambda j: (slot(j) * (i // bkd) + iblock(j), 0))]
    groups = i // ACT_GROUP                         # h8 [S * N, I], its scales [S * I/128, NS]
    return [w, spec((n, bkd), lambda j: (slot(j), iblock(j))),
            spec((1, hs_gmem.shape[-1]), lambda j: (slot(j) * groups + iblock(j) * bkd // ACT_GROUP, 0))]

  blocks = [("down tiles", (bd, bkd), wd_gmem.dtype),
            ("h tiles", (n, bkd) if w8a8 else (bkd, n), h_gmem.dtype)]
  if w8a8:
    blocks.append(("h scales", (1, hs_gmem.shape[-1]), hs_gmem.dtype))
  tma.check_pipeline(name, blocks, cfg.down_stages)

  # Routed: step j -> slot j // kper (ascending expert), I block k0 + j % kper; then the shared slot P.
  routed = specs(lambda j: j // kper, lambda j: k0 + j % kper, lambda j: meta[1 + j // kper] * (d // bd) + db)
  shared = specs(lambda j: p, lambda j: k0 + j, lambda j: db)
  h_refs = (h_gmem,) if hs_gmem is None else (h_gmem, hs_gmem)
  run = lambda step, grid, in_specs, w, **kw: plgpu.emit_pipeline(
      step, grid=(grid,), in_specs=in_specs, max_concurrent_steps=cfg.down_stages, **kw)(w, *h_refs)

  def accumulate(scales, w_tmp):
    """Every step's wgmma into one accumulator (bf16 weights; fp8 with fp8_scale_on="weight")."""
    def scope(acc):
      def step(idx, w_smem, h_smem, base=0):
        (j,) = idx
        plgpu.wgmma(acc, _weight_tile(w_smem, scales, base + j, w_tmp, cfg), h_smem)  # [BD, BKD] @ [BKD, N]
        _await_register_operands(scales)

      run(step, meta[0] * kper, routed, wd_gmem)
      if has_shared:
        run(functools.partial(step, base=p * kper), kper, shared, swd)
      return acc[...]
    return pl.run_scoped(scope, plgpu.ACC((bd, n)))

  def promote(scales, w_tmp):
    """Each step's wgmma into a fresh partial, added to the fp32 accumulator (the carry) times its scale."""
    def step(idx, w_smem, h_smem, *hs_smem_and_carry, base=0):
      (j,) = idx
      *hs_smem, acc = hs_smem_and_carry
      b = h_smem.transpose((1, 0)) if w8a8 else h_smem  # h8 tiles are [N, BKD]
      (part,) = _partials((bd, n), (_weight_tile(w_smem, scales, base + j, w_tmp, cfg), b))
      c = _scale(scales, base + j)
      if hs_smem:  # fp8_activations: times each token's h scale (and routing weight) of this slot and group
        c = _token_scales(c, hs_smem[0], (bd, n))
      return _pin(acc + c * part)

    acc = run(step, meta[0] * kper, routed, wd_gmem, init_carry=_pin(jnp.zeros((bd, n), jnp.float32)))
    if has_shared:
      acc = run(functools.partial(step, base=p * kper), kper, shared, swd, init_carry=acc)
    return acc

  pipeline = promote if _promotes(cfg, fp8) else accumulate
  out = _with_row(row, lambda scales: _with_scratch(cfg, fp8, [(bd, bkd)], functools.partial(pipeline, scales)),
                  kernel=name, buffer="weight scale row")

  def store(o_smem):
    o_smem[...] = out
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[ks, pl.ds(db * bd, bd), :])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, plgpu.SMEM((bd, n), jnp.float32))


# ----------------------------------------------------------------------------- wrapper


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "config"))
def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, limit=0.0, shared=None,
        shared_limit=0.0, config=None):
  """Mosaic GPU MoE; same signature and result as pallas_kernels.moe.moe (bf16 / f16 operands)."""
  cfg = config or MosaicMoeConfig()
  t, d = x.shape
  e, i, d2 = w_gate.shape
  a = topk_ids.shape[1]
  assert d2 == d and w_up.shape == w_gate.shape and w_down.shape == (e, d, i), (
      x.shape, w_gate.shape, w_up.shape, w_down.shape)
  if x.dtype not in (jnp.bfloat16, jnp.float16) or w_gate.dtype != x.dtype:
    raise ValueError(f"x {x.dtype} / weights {w_gate.dtype}: the wgmma path takes bf16 or f16 "
                     "(f32 would run as tf32); use pallas_kernels.moe.moe for f32")
  cfg.check(t, d, i)
  if shared is not None and shared[0].shape != (i, d):
    raise ValueError(f"shared expert width {shared[0].shape}: slot P needs the routed width I={i} "
                     "(ling_jax.kernel_calls runs another width through the model)")

  meta, wc = _align(topk_ids, topk_weights, cfg.n_tokens, shared is not None)  # [1+P], [S, N]
  return run_kernels(pad_tokens(x, cfg.n_tokens), meta, wc, w_gate, w_up, w_down, shared, t=t, limit=limit,
                     shared_limit=shared_limit, cfg=cfg)


def pad_tokens(x, n):
  """x [T, D] -> [N, D]: the kernels' N token columns, zero rows past T (one XLA pad on the GPU)."""
  return jnp.pad(x, ((0, n - x.shape[0]), (0, 0)))


def run_kernels(x_pad, meta, wc, w_gate, w_up, w_down, shared, *, t, limit, shared_limit, cfg, scales=None,
                x_scales=None):
  """The up and down launches and the fixed-order sum of the split-K partials, on checked operands: x_pad
  [N, D] (pad_tokens of x [T, D]), meta and wc (_align) -> [T, D].
  scales (fp8 weights, see moe_mosaic_fp8.scale_tables): (up [S, I/128, R, W], down [D/128, KS, R', W]) f32.
  x_scales (fp8 weights with fp8_activations): x is e4m3 and x_scales [T, D/128] f32 its per-token group scales
  (ling_jax.quant.quantize_activations); the result is bf16."""
  n = cfg.n_tokens
  if x_pad.shape[0] != n:
    raise ValueError(f"x_pad {x_pad.shape}: the kernels take x padded to n_tokens={n} rows (pad_tokens)")
  d = x_pad.shape[1]
  e, i, _ = w_gate.shape
  has_shared, p = shared is not None, wc.shape[0] - 1
  fp8 = scales is not None
  w8a8 = x_scales is not None
  if w8a8 != (fp8 and cfg.fp8_activations):
    raise ValueError("x_scales (e4m3 activations) go with fp8 weights and fp8_activations=True, and only there")
  up_scales, down_scales = scales if fp8 else ((), ())
  interp = plgpu.InterpretGPUParams() if cfg.interpret else None
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  groups, ns = i // ACT_GROUP, scale_columns(n)
  if w8a8:  # h8 token-major [S, N, I] e4m3 and its scales (times the routing weights) [S, I/128, NS]
    h_type = (jax.ShapeDtypeStruct((p + 1, n, i), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((p + 1, groups, ns), jnp.float32))
    x_tables = [jnp.pad(x_scales.astype(jnp.float32), ((0, ns - t), (0, 0))).T]  # [D/128, NS]
  else:
    h_type, x_tables = jax.ShapeDtypeStruct((p + 1, i, n), x_pad.dtype), []

  up = plgpu.kernel(
      functools.partial(_up_kernel, cfg=cfg, d=d, p=p, limit=float(limit),
                        shared_limit=float(shared_limit), has_shared=has_shared, fp8=fp8),
      out_type=h_type,
      grid=(p + 1, i // cfg.block_i), grid_names=("s", "i"),
      compiler_params=params, interpret=interp)
  h = up(meta, x_pad, *x_tables, wc, *([up_scales] if fp8 else []), w_gate, w_up,
         *(shared[:2] if has_shared else ()))                        # [S, I, N]
  if w8a8:
    h8, hs = h
    h_args = (h8.reshape((p + 1) * n, i), hs.reshape((p + 1) * groups, ns))
  else:
    h_args = (h.reshape((p + 1) * i, n),)

  down = plgpu.kernel(
      functools.partial(_down_kernel, cfg=cfg, d=d, i=i, p=p, has_shared=has_shared, fp8=fp8),
      out_type=jax.ShapeDtypeStruct((cfg.split_k, d, n), jnp.float32),
      grid=(d // cfg.block_d, cfg.split_k), grid_names=("d", "k"),
      compiler_params=params, interpret=interp)
  parts = down(meta, *h_args, *([down_scales] if fp8 else []), w_down.reshape(e * d, i),
               *(shared[2:] if has_shared else ()))                  # [KS, D, N]
  out = parts[0]
  for k in range(1, cfg.split_k):                                     # fixed order
    out = out + parts[k]
  return out[:, :t].T.astype(jnp.bfloat16 if w8a8 else x_pad.dtype)
