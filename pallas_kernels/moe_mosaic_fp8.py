"""Routed + shared MoE with block-fp8 weights and bf16 activations: the Mosaic GPU kernels of moe_mosaic.

Shape legend (as moe_mosaic): T tokens, N token columns, D hidden, A experts per token, E experts, I expert
width, P = T*A pairs, S = P + 1 slots (slot P: the shared expert), KS the split of I in the down GEMM,
KPS = I / (KS * BKD) down steps per slot and CTA, nI = ceil(I/128), nD = ceil(D/128) scale blocks.

Weights are (w8, scale_inv) pairs in the DeepSeek-V3 layout (ling_jax.quant.Fp8Weight is one):
  w_gate, w_up: w8 [E, I, D] e4m3, scale_inv [E, nI, nD] f32; w_down: w8 [E, D, I], scale_inv [E, nD, nI];
  shared: three pairs of [I, D], [I, D], [D, I] weights and their [nI, nD] / [nD, nI] scales.
Math: moe_mosaic's with W = bf16(f32(W8) * s) per 128 x 128 block (the model's dequantised weight, so the
reference is the model's routed_experts + dense_mlp on dequantised weights; only summation order differs).

Plan: the same two launches and pipelines as the bf16 kernel (moe_mosaic.run_kernels); TMA streams the fp8
tiles (half the bytes). A tile lies inside one scale block (tiles divide 128), so it takes one scalar scale, read
from a per-CTA scale row in SMEM that one TMA copy loads before the pipeline. The rows come from two small XLA
gathers over the aligned slots (the scale tables). What a pipeline step does with its [BI, BK] (up) or [BD, BKD]
(down) e4m3 tile is the config's choice (MosaicMoeConfig):
  fp8_scale_on="weight" (default): dequantise in registers, bf16(f32(w8) * s), then a bf16 wgmma with fp32
    accumulation (the model's dequantised weight: the reference is the model's routed_experts + dense_mlp on
    dequantised weights; only summation order differs);
  fp8_scale_on="partial": convert only (exact), bf16 wgmma into a fresh fp32 partial, acc += s * partial (the
    exact block product);
  fp8_convert="cvt" | "bits": the conversion by PTX cvt (e4m3 -> f16 -> f32 -> bf16 here: 4 conversions per 2
    elements at 16 per clock per SM: ~0.5 of the HBM ceiling; measured 0.41-0.46) or by
    integer ops (see moe_mosaic._e4m3_bits_as_bf16);
  fp8_activations=True (w8a8): no per-element work on the weights: x arrives quantised per token and 128-column
    group (ling_jax.quant.quantize_activations: x = (x8, scale)), the e4m3 x e4m3 wgmma reads both TMA'd tiles,
    each step's fp32 partial is promoted with s_w * s_x[token] (DeepGEMM's scheme, which also bounds the fp8
    MMA's accumulation to one 128-deep K block), and the up kernel's epilogue quantises h the same way (per
    token and 128 rows of I, its scale times the routing weight), storing it token-major [S, N, I] for the
    down GEMM (an e4m3 wgmma takes K-major operands only). Reference: the model's MoE with its activations
    through quant.fake_quantize_activations (moe_experts(fp8_activations=True)).
Batch invariance as in moe_mosaic (a column only sees its own experts, in ascending order, fixed I split); the
activation scales are per token, so w8a8 keeps it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe_mosaic import MosaicMoeConfig, _align, pad_tokens, run_kernels

FP8_DTYPES = (jnp.float8_e4m3fn,)
SCALE_BLOCK = 128


def check_fp8_config(cfg: MosaicMoeConfig):
  """Each weight tile must lie in one 128 x 128 scale block (one scalar scale per pipeline step)."""
  for name in ("block_i", "block_k", "block_d", "block_kd"):
    v = getattr(cfg, name)
    if SCALE_BLOCK % v:
      raise ValueError(f"{name}={v}: fp8 tiles must divide the {SCALE_BLOCK}-wide scale blocks (64 or 128)")


ROW = 16  # scale rows are stored [L/ROW, ROW]: TMA copies <= 256 elements per axis, in 16-byte units


def _rows(a):
  """[..., L] -> zero-padded [..., ceil(L/ROW), ROW] f32."""
  extra = -a.shape[-1] % ROW
  a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)]) if extra else a
  return a.reshape(*a.shape[:-1], a.shape[-1] // ROW, ROW).astype(jnp.float32)


def _per_slot(scale, shared_scale, slot_expert):
  """scale [E, r, c] -> [S, r, c]: slot s's expert's scales, the shared expert's (or zeros) in slot P."""
  rows = scale[slot_expert]                                           # [P, r, c]
  last = jnp.zeros_like(rows[:1]) if shared_scale is None else shared_scale[None]
  return jnp.concatenate([rows, last])


def scale_tables(meta, p, gate_s, up_s, down_s, shared_s, *, cfg, d, i):
  """The per-CTA scale rows (flat index shown; stored as [R, ROW]). up [S, nI, .]: gate's scale of D step k
  at k, up's at D/BK + k; down [nD, KS, .]: CTA (row block, ks) step j of slot s (I block ks*KPS + j) at
  s * KPS + j."""
  slot_expert = meta[1:1 + p]
  sg, su, sd = shared_s if shared_s is not None else (None, None, None)
  kcols = np.arange(d // cfg.block_k) * cfg.block_k // SCALE_BLOCK   # D step -> scale column
  g = _per_slot(gate_s, sg, slot_expert)[:, :, kcols]                 # [S, nI, D/BK]
  u = _per_slot(up_s, su, slot_expert)[:, :, kcols]
  up = jnp.concatenate([g, u], axis=-1)                               # [S, nI, 2*D/BK]
  kps = i // (cfg.split_k * cfg.block_kd)
  icols = (np.arange(cfg.split_k)[:, None] * kps + np.arange(kps)[None]) * cfg.block_kd // SCALE_BLOCK
  dn = _per_slot(down_s, sd, slot_expert)[:, :, icols]                # [S, nD, KS, KPS]
  s_slots, n_d = dn.shape[:2]
  dn = dn.transpose(1, 2, 0, 3).reshape(n_d, cfg.split_k, s_slots * kps)
  return _rows(up), _rows(dn)


class Aligned(NamedTuple):
  """What the two kernels read besides the weights (and, w8a8, x's scales), per call:
  x [N, D] (x's rows, zero rows past T: pad_tokens; w8a8: the e4m3 x8), meta [1 + P] int32 and wc [S, N] f32
  (moe_mosaic._align), up [S, nI, R, W] and down [nD, KS, R', W] f32 (scale_tables)."""
  x: jax.Array
  meta: jax.Array
  wc: jax.Array
  up: jax.Array
  down: jax.Array


def align(x, topk_ids, topk_weights, gate_s, up_s, down_s, shared_s=None, *, cfg: MosaicMoeConfig, i: int) -> Aligned:
  """moe_fp8's per-call operands in XLA: x [T, D], topk_ids / topk_weights [T, A], the scales gate_s / up_s
  [E, nI, nD], down_s [E, nD, nI], shared_s (the shared expert's three, or None) -> Aligned. On the GPU this is
  ~8 small launches (_align's compares and sums, the tables' gathers and concatenates, the pad of x);
  pallas_kernels/moe_fp8_tables.align_tables is the same arrays in one (this is its reference)."""
  meta, wc = _align(topk_ids, topk_weights, cfg.n_tokens, shared_s is not None)  # [1+P], [S, N]
  up, down = scale_tables(meta, topk_ids.size, gate_s, up_s, down_s, shared_s, cfg=cfg, d=x.shape[1], i=i)
  return Aligned(pad_tokens(x, cfg.n_tokens), meta, wc, up, down)


@functools.partial(jax.jit, static_argnames=("limit", "shared_limit", "config"))
def moe_fp8(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, limit=0.0, shared=None,
            shared_limit=0.0, config=None, aligned: Aligned | None = None):
  """Mosaic GPU MoE on block-fp8 weights: the signature of moe_mosaic.moe with (w8, scale_inv) pairs for
  every weight (shared: three pairs). x bf16 [T, D] -> [T, D] bf16; with config.fp8_activations x is the pair
  (x8 [T, D] float8_e4m3fn, scale [T, ceil(D/128)] f32) of ling_jax.quant.quantize_activations.
  aligned: the call's Aligned computed elsewhere (moe_fp8_tables.align_tables: one Triton launch), checked
  against the shapes `align` gives; None: `align` here, in XLA."""
  cfg = config or MosaicMoeConfig()
  (wg8, gs), (wu8, us), (wd8, ds) = w_gate, w_up, w_down
  e, i, d = wg8.shape
  x, x_scales = _activations(x, cfg, d)
  t = x.shape[0]
  for name, (w8, sc), shape in (("w_gate", w_gate, (e, i, d)), ("w_up", w_up, (e, i, d)),
                                ("w_down", w_down, (e, d, i))):
    want = shape[:1] + tuple(-(-n // SCALE_BLOCK) for n in shape[1:])
    if w8.dtype not in FP8_DTYPES or w8.shape != shape or sc.shape != want:
      raise ValueError(f"{name}: expected float8_e4m3fn {shape} with scales {want}, got {w8.dtype} "
                       f"{w8.shape} with scales {sc.shape}")
  if shared is not None and shared[0][0].shape != (i, d):
    raise ValueError(f"shared expert gate {shared[0][0].shape}: the fp8 kernel runs it as slot P, so its "
                     f"width must equal the routed width I={i} (dequantise it and use moe_mosaic.moe otherwise)")
  cfg.check(t, d, i)
  check_fp8_config(cfg)
  shared_s = None if shared is None else tuple(sc for _, sc in shared)
  align_args = (x, topk_ids, topk_weights, gs, us, ds, shared_s)
  if aligned is None:
    aligned = align(*align_args, cfg=cfg, i=i)
  else:
    want = jax.eval_shape(functools.partial(align, cfg=cfg, i=i), *align_args)
    got, need = [(a.shape, a.dtype) for a in aligned], [(a.shape, a.dtype) for a in want]
    if got != need:
      raise ValueError(f"aligned {got}: expected align's {need}")
  shared8 = None if shared is None else tuple(w for w, _ in shared)
  return run_kernels(aligned.x, aligned.meta, aligned.wc, wg8, wu8, wd8, shared8, t=t, limit=limit,
                     shared_limit=shared_limit, cfg=cfg, scales=(aligned.up, aligned.down), x_scales=x_scales)


def _activations(x, cfg: MosaicMoeConfig, d: int):
  """The kernel's x and x_scales: bf16 x and None, or (fp8_activations) the checked (x8, scale) pair."""
  if not cfg.fp8_activations:
    if not hasattr(x, "dtype") or x.dtype != jnp.bfloat16:
      raise ValueError(f"x {getattr(x, 'dtype', type(x).__name__)}: the fp8-weight kernel takes bf16 activations "
                       "(or, with fp8_activations=True, the (x8, scale) pair of quant.quantize_activations)")
    return x, None
  if hasattr(x, "dtype") or len(x) != 2:
    raise ValueError("fp8_activations=True: x must be the (x8 e4m3 [T, D], scale f32 [T, D/128]) pair of "
                     "ling_jax.quant.quantize_activations")
  x8, scale = x
  want = (x8.shape[0], -(-d // SCALE_BLOCK))
  if x8.dtype not in FP8_DTYPES or x8.ndim != 2 or x8.shape[1] != d or scale.shape != want:
    raise ValueError(f"x: expected float8_e4m3fn [T, {d}] with scales {want}, got {x8.dtype} {x8.shape} with "
                     f"scales {scale.shape}")
  return x8, scale
