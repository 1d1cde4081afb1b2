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
     reduction (no scatter, no atomics). `moe`: in XLA (`_align`, ~6 small kernels + the pad of
     x); `moe_slots`: the tables come from the router's top-k launch (router.route_slots).
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
fp8 weights: moe_mosaic_fp8 runs these same kernels (`run_kernels`) with fp8 tiles, each dequantised before its
wgmma (`_weight_tile`), one scale per tile from a per-CTA SMEM row.
Limits: tokens are padded to N columns (64; 16 or 32 for small T: x and h' tiles cost SMEM/L2
traffic and pipeline slots, not HBM); up and down are two launches (no PDL yet); the split-K
sum is one XLA fusion (it also takes the caller's residual add).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import _swiglu


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


def _with_row(src_gmem, body):
  """body(row_smem) with a GMEM row ([L] or [L/W, W]) f32 copied to SMEM (TMA + barrier); None -> body(None)."""
  if src_gmem is None:
    return body(None)

  def scope(row_smem, bar):
    plgpu.copy_gmem_to_smem(src_gmem, row_smem, bar)
    plgpu.barrier_wait(bar)
    return body(row_smem)
  return pl.run_scoped(scope, plgpu.SMEM(src_gmem.shape, jnp.float32), plgpu.Barrier(num_barriers=1))


def _load_row(src_gmem):
  """wc row [N] f32 from GMEM via SMEM."""
  return _with_row(src_gmem, lambda row_smem: row_smem[...])


def _weight_tile(w_smem, scales, j, scratch):
  """The wgmma A operand: the bf16 SMEM tile itself, or (fp8 weights: `scales` is the CTA's scale row in SMEM,
  [L/W, W] f32 (TMA copies <= 256 per axis), one scale per tile since a tile lies in one 128 x 128 block) the
  tile dequantised in registers with scale j of the row, bf16(f32(w8) * s) (the model's dequantised weight),
  stored to the bf16 SMEM `scratch` tile, or kept in registers when scratch is None."""
  if scales is None:
    return w_smem
  w = scales.shape[-1]
  tile = (w_smem[...].astype(jnp.float32) * scales[j // w, j % w]).astype(jnp.bfloat16)
  if scratch is None:
    return tile
  scratch[...] = tile
  plgpu.commit_smem()
  return scratch


def _with_scratch(cfg, fp8, shapes, body):
  """body(*scratch): bf16 SMEM tiles for the dequantised fp8 operands (Nones when unused)."""
  if not fp8 or cfg.fp8_operand == "registers":
    return body(*(None,) * len(shapes))
  return pl.run_scoped(body, *(plgpu.SMEM(shape, jnp.bfloat16) for shape in shapes))


def _await_register_operands(scales):
  """A register A operand must stay untouched until its wgmma has read it (fp8: wait each step)."""
  if scales is not None:
    plgpu.wgmma_wait(0)


def _up_slot(wg_gmem, wu_gmem, x_gmem, wc_gmem, h_gmem, s, ib, *, cfg, d, limit, scales_gmem=None):
  """h'[s, ib*BI:(ib+1)*BI, :] = wc[s] * SwiGLU(wg_tile @ x^T, wu_tile @ x^T).
  scales_gmem (fp8 weights): this CTA's row of scales, gate's of K step k at k, up's at d/BK + k."""
  bi, bk, n = cfg.block_i, cfg.block_k, cfg.n_tokens

  def acc_scope(acc_g, acc_u):
    body = lambda scales: _with_scratch(cfg, scales is not None, [(bi, bk)] * 2,
                                        functools.partial(pipeline, acc_g, acc_u, scales))
    return _with_row(scales_gmem, body)

  def pipeline(acc_g, acc_u, scales, g_tmp, u_tmp):
    def step(idx, g_smem, u_smem, x_smem):
      (k,) = idx
      plgpu.wgmma(acc_g, _weight_tile(g_smem, scales, k, g_tmp), x_smem.transpose((1, 0)))  # [BI, BK] @ [BK, N]
      plgpu.wgmma(acc_u, _weight_tile(u_smem, scales, d // bk + k, u_tmp), x_smem.transpose((1, 0)))
      _await_register_operands(scales)

    spec = lambda shape, imap: plgpu.BlockSpec(shape, imap, delay_release=1)
    plgpu.emit_pipeline(
        step, grid=(d // bk,),
        in_specs=[spec((bi, bk), lambda k: (ib, k)), spec((bi, bk), lambda k: (ib, k)),
                  spec((n, bk), lambda k: (0, k))],
        max_concurrent_steps=cfg.up_stages,
    )(wg_gmem, wu_gmem, x_gmem)
    return acc_g[...], acc_u[...]

  g, u = pl.run_scoped(acc_scope, plgpu.ACC((bi, n)), plgpu.ACC((bi, n)))
  wc = _load_row(wc_gmem.at[s])                                       # [N]
  h = _swiglu(g, u, limit) * lax.broadcast_in_dim(wc, (bi, n), (1,))

  def store(h_smem):
    h_smem[...] = h.astype(h_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_smem, h_gmem.at[s, pl.ds(ib * bi, bi), :])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, plgpu.SMEM((bi, n), h_gmem.dtype))


def _up_kernel(meta, x_gmem, wc_gmem, *rest, cfg, d, p, limit, shared_limit, has_shared, fp8):
  """rest: ([up scales [S, I/128, R, W] if fp8], w_gate, w_up, [shared gate, up], h')."""
  scales, rest = (rest[0], rest[1:]) if fp8 else (None, rest)
  wg_gmem, wu_gmem, *rest = rest
  swg, swu, h_gmem = rest if has_shared else (None, None, rest[0])
  s, ib = lax.axis_index("s"), lax.axis_index("i")
  rows = None if scales is None else scales.at[s, (ib * cfg.block_i) // 128]
  up = functools.partial(_up_slot, x_gmem=x_gmem, wc_gmem=wc_gmem, h_gmem=h_gmem, s=s, ib=ib,
                         cfg=cfg, d=d, scales_gmem=rows)

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
  rest: ([down scales [D/128, KS, R, W] if fp8: step j of slot s at s * kper + j], w_down, [shared down], out)."""
  scales, rest = (rest[0], rest[1:]) if fp8 else (None, rest)
  wd_gmem, *rest = rest
  swd, out_gmem = rest if has_shared else (None, rest[0])
  db, ks = lax.axis_index("d"), lax.axis_index("k")
  bd, bkd, n = cfg.block_d, cfg.block_kd, cfg.n_tokens
  kper = i // (cfg.split_k * bkd)                   # pipeline steps per slot
  k0 = ks * kper                                    # first I block of this CTA's chunk
  spec = lambda shape, imap: plgpu.BlockSpec(shape, imap, delay_release=1)
  row = None if scales is None else scales.at[(db * bd) // 128, ks]

  def acc_scope(acc):
    body = lambda scales: _with_scratch(cfg, scales is not None, [(bd, bkd)],
                                        functools.partial(pipelines, acc, scales))
    return _with_row(row, body)

  def pipelines(acc, scales, w_tmp):
    def step(idx, w_smem, h_smem, base=0):
      (j,) = idx
      plgpu.wgmma(acc, _weight_tile(w_smem, scales, base + j, w_tmp), h_smem)  # [BD, BKD] @ [BKD, N]
      _await_register_operands(scales)

    # Routed: step j -> slot j // kper (ascending expert), I block k0 + j % kper.
    # wd_gmem is [E * D, I]; h_gmem is [S * I, N].
    plgpu.emit_pipeline(
        step, grid=(meta[0] * kper,),
        in_specs=[
            spec((bd, bkd), lambda j: (meta[1 + j // kper] * (d // bd) + db, k0 + j % kper)),
            spec((bkd, n), lambda j: ((j // kper) * (i // bkd) + k0 + j % kper, 0))],
        max_concurrent_steps=cfg.down_stages,
    )(wd_gmem, h_gmem)
    if has_shared:
      plgpu.emit_pipeline(
          functools.partial(step, base=p * kper), grid=(kper,),
          in_specs=[spec((bd, bkd), lambda j: (db, k0 + j)),
                    spec((bkd, n), lambda j: (p * (i // bkd) + k0 + j, 0))],
          max_concurrent_steps=cfg.down_stages,
      )(swd, h_gmem)
    return acc[...]

  out = pl.run_scoped(acc_scope, plgpu.ACC((bd, n)))

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
  return run_kernels(x, meta, wc, w_gate, w_up, w_down, shared, limit=limit, shared_limit=shared_limit, cfg=cfg)


def moe_slots(x_pad, meta, wc, w_gate, w_up, w_down, *, t, limit=0.0, shared=None, shared_limit=0.0,
              config=None):
  """The MoE on slot tables the router already built (pallas_kernels.router.route_slots): x_pad [N, D]
  (x with zero rows past T), meta [1 + P], wc [P + 1, N] -> [T, D] in x's dtype; the up and down
  launches and one XLA fusion (the split-K sum, transposed), nothing before them. The shared expert's
  width must equal I (it rides as slot P)."""
  cfg = config or MosaicMoeConfig()
  n, d = x_pad.shape
  e, i, _ = w_gate.shape
  if n != cfg.n_tokens or wc.shape != (meta.shape[0], n):
    raise ValueError(f"x_pad {x_pad.shape}, meta {meta.shape}, wc {wc.shape}: expected N = n_tokens = "
                     f"{cfg.n_tokens} rows and wc [1 + P, N]")
  if x_pad.dtype not in (jnp.bfloat16, jnp.float16) or w_gate.dtype != x_pad.dtype:
    raise ValueError(f"x {x_pad.dtype} / weights {w_gate.dtype}: the wgmma path takes bf16 or f16")
  if shared is not None and shared[0].shape != (i, d):
    raise ValueError(f"shared gate {shared[0].shape}: slot P needs the routed width I={i}")
  cfg.check(t, d, i)
  return run_kernels(None, meta, wc, w_gate, w_up, w_down, shared, limit=limit, shared_limit=shared_limit,
                     cfg=cfg, x_pad=x_pad, t=t)


def run_kernels(x, meta, wc, w_gate, w_up, w_down, shared, *, limit, shared_limit, cfg, scales=None,
                x_pad=None, t=None):
  """The up and down launches and the fixed-order sum of the split-K partials, on checked operands.
  scales (fp8 weights, see moe_mosaic_fp8.scale_tables): (up [S, I/128, R, W], down [D/128, KS, R', W]) f32.
  x [T, D] is padded here, or x_pad [N, D] comes padded (with t = T)."""
  n = cfg.n_tokens
  if x_pad is None:
    t = x.shape[0]
    x_pad = jnp.pad(x, ((0, n - t), (0, 0)))                          # [N, D]
  d = x_pad.shape[1]
  e, i, _ = w_gate.shape
  has_shared, p = shared is not None, wc.shape[0] - 1
  fp8 = scales is not None
  up_scales, down_scales = scales if fp8 else ((), ())
  interp = plgpu.InterpretGPUParams() if cfg.interpret else None
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)

  up = plgpu.kernel(
      functools.partial(_up_kernel, cfg=cfg, d=d, p=p, limit=float(limit),
                        shared_limit=float(shared_limit), has_shared=has_shared, fp8=fp8),
      out_type=jax.ShapeDtypeStruct((p + 1, i, n), x_pad.dtype),
      grid=(p + 1, i // cfg.block_i), grid_names=("s", "i"),
      compiler_params=params, interpret=interp)
  h = up(meta, x_pad, wc, *([up_scales] if fp8 else []), w_gate, w_up,
         *(shared[:2] if has_shared else ()))                        # [S, I, N]

  down = plgpu.kernel(
      functools.partial(_down_kernel, cfg=cfg, d=d, i=i, p=p, has_shared=has_shared, fp8=fp8),
      out_type=jax.ShapeDtypeStruct((cfg.split_k, d, n), jnp.float32),
      grid=(d // cfg.block_d, cfg.split_k), grid_names=("d", "k"),
      compiler_params=params, interpret=interp)
  parts = down(meta, h.reshape((p + 1) * i, n), *([down_scales] if fp8 else []), w_down.reshape(e * d, i),
               *(shared[2:] if has_shared else ()))                  # [KS, D, N]
  out = parts[0]
  for k in range(1, cfg.split_k):                                     # fixed order
    out = out + parts[k]
  return out[:, :t].T.astype(x_pad.dtype)
