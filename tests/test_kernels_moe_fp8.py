"""fp8-weight Mosaic GPU MoE (pallas_kernels/moe_mosaic_fp8.py): the Mosaic GPU interpreter on CPU against the
model's own MoE math on the dequantised weights (ling_jax.layers.moe.routed_experts + dense_mlp, which gather
and dequantise quant.Fp8Weight experts), and the CUDA lowering at full Ling-3.0-flash shapes.
The config's variants: fp8_scale_on="partial" (also against the exact block product: the model's math with the
weights dequantised to f32 and f32 activations), fp8_convert="bits" (the integer convert on every e4m3 value),
fp8_activations (w8a8: against the model's MoE with its activations through quant.fake_quantize_activations,
moe_experts(fp8_activations=True), run in f32 so that only the kernel's summation order and final rounding differ).

Shapes: D = 256, I = 128, E = 16, A = 8; T in {1, 6} (T = 17: the lowering test); weights drawn with per-expert ranges that differ by
100x, so a wrong scale index (another expert's, block or step) shows as a large error. Tolerance 1e-2 relative
(bf16 h' rounding after the routing-weight fold, as the bf16 kernel).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataclasses

import ml_dtypes
from jax import lax

from ling_jax import quant
from ling_jax.layers.moe import dense_mlp, routed_experts
from ling_jax.kernel_calls import KernelCalls
from pallas_kernels import moe_mosaic
from pallas_kernels.moe_mosaic import MosaicMoeConfig
from pallas_kernels.moe_mosaic_fp8 import check_fp8_config, moe_fp8
from tests import kernel_oracles
from tests.conftest import rel_err
from tests.cuda_lowering import H200, S

A, D, I, E = 8, 256, 128, 16
BF = jnp.bfloat16
# Up: one [128, 256] expert tile in 2 K steps (two scale columns); down: 2 D tiles (two scale rows) x 2 I chunks.
CFG = MosaicMoeConfig(block_i=128, block_k=128, up_stages=2, block_d=128, block_kd=64, split_k=2,
                      down_stages=2, interpret=True)


def make(seed, t):
  k = jax.random.split(jax.random.key(seed), 9)
  x = jax.random.normal(k[0], (t, D), jnp.float32).astype(BF)
  ids = jnp.argsort(jax.random.uniform(k[1], (t, E)), axis=1)[:, :A].astype(jnp.int32)
  w = jax.random.uniform(k[2], (t, A), jnp.float32, 0.1, 1.0)
  rng = jnp.logspace(-1, 1, E)[:, None, None]                     # expert e's weights scaled by 0.1 .. 10
  nrm = lambda kk, s, sc: jax.random.normal(kk, s, jnp.float32) * sc
  q = lambda a: quant.quantize(a.astype(BF))
  wg, wu = q(nrm(k[3], (E, I, D), D ** -0.5) * rng), q(nrm(k[4], (E, I, D), D ** -0.5) / rng)
  wd = q(nrm(k[5], (E, D, I), I ** -0.5) * jnp.linspace(0.5, 2.0, D)[None, :, None])
  sh = (q(nrm(k[6], (I, D), D ** -0.5)), q(nrm(k[7], (I, D), D ** -0.5)), q(nrm(k[8], (D, I), I ** -0.5)))
  return x, ids, w, wg, wu, wd, sh


def reference(x, ids, w, wg, wu, wd, sh, limit, shared_limit):
  """The model's MoE on the dequantised weights (fp32 sum of routed and shared, one rounding)."""
  y = routed_experts(x, ids, w, wg, wu, wd, limit)
  y = y + dense_mlp({"gate_proj": sh[0], "up_proj": sh[1], "down_proj": sh[2]}, x, shared_limit).astype(jnp.float32)
  return y.astype(x.dtype)


@pytest.mark.parametrize("t,limit", [(1, 0.0), (6, 0.3)])
def test_moe_fp8_matches_dequantised_model_math(t, limit):
  x, ids, w, wg, wu, wd, sh = make(t, t)
  out = moe_fp8(x, ids, w, wg, wu, wd, limit=limit, shared=sh, shared_limit=limit, config=CFG)
  ref = reference(x, ids, w, wg, wu, wd, sh, limit, limit)
  assert out.shape == x.shape and out.dtype == BF
  assert rel_err(out, ref) <= 1e-2
  if t == 1:  # each expert's own scales are used: expert 0's gate scales everywhere are far off
    same = quant.Fp8Weight(wg.w8, jnp.broadcast_to(wg.scale_inv[:1], wg.scale_inv.shape))
    wrong = moe_fp8(x, ids, w, same, wu, wd, limit=limit, shared=sh, shared_limit=limit, config=CFG)
    assert rel_err(wrong, ref) > 0.1
  if t == 6:  # batch invariance: token 2 alone gives the bit-identical row
    alone = moe_fp8(x[2:3], ids[2:3], w[2:3], wg, wu, wd, limit=limit, shared=sh, shared_limit=limit, config=CFG)
    np.testing.assert_array_equal(np.asarray(out[2:3], np.float32), np.asarray(alone, np.float32))


def test_bits_convert_is_exact_for_every_e4m3():
  """fp8_convert="bits": the integer ops give, for each of the 254 finite e4m3 values (subnormals included),
  a bf16 that is exactly the value times 2^-120 (read in numpy: XLA:CPU flushes bf16 subnormals in arithmetic)."""
  codes = jnp.arange(256, dtype=jnp.uint8)
  w8 = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
  bits = np.asarray(moe_mosaic._e4m3_bits_as_bf16(w8)).view(ml_dtypes.bfloat16).astype(np.float32)
  want = np.asarray(w8, np.float32)
  finite = np.isfinite(want)
  assert finite.sum() == 254 and np.sum((want != 0) & (np.abs(want) < 2.0**-6)) == 14   # 14 subnormals
  np.testing.assert_array_equal(bits[finite] * np.float32(moe_mosaic.BITS_SCALE), want[finite])


def _exact(x, ids, w, wg, wu, wd, sh, limit):
  """The exact block product: the model's MoE with the weights dequantised to f32 and f32 activations."""
  f32 = lambda q: quant.dequantize(q, jnp.float32)
  return kernel_oracles.moe(x.astype(jnp.float32), ids, w, f32(wg), f32(wu), f32(wd), limit=limit,
                            shared=tuple(map(f32, sh)), shared_limit=limit)


@pytest.mark.parametrize("variant", ["partial-bits", "w8a8"])
def test_moe_fp8_variants_match_their_reference_and_are_batch_invariant(variant):
  """T = 6 against the variant's reference; token 2 alone gives the bit-identical row (batch invariance).
  Top-2 of the drawn routing: fewer slots for the interpreter, still 8 distinct experts of 16."""
  t, limit = 6, 0.3
  x, ids, w, wg, wu, wd, sh = make(t, t)
  ids, w = ids[:, :2], w[:, :2]
  if variant == "w8a8":
    cfg = dataclasses.replace(CFG, fp8_activations=True, n_tokens=16)
    quantised = lambda rows: tuple(quant.quantize_activations(x[rows]))
    out = moe_fp8(quantised(slice(None)), ids, w, wg, wu, wd, limit=limit, shared=sh, shared_limit=limit, config=cfg)
    ref = kernel_oracles.moe(x.astype(jnp.float32), ids, w, wg, wu, wd, limit=limit, shared=sh, shared_limit=limit,
                             fp8_activations=True).astype(BF)
    assert rel_err(out, ref) <= 1e-3    # the same quantised activations: summation order and roundings apart
    # what w8a8 costs against the bf16 model (e4m3 keeps 3 mantissa bits of x and h)
    assert 0.02 < rel_err(out, reference(x, ids, w, wg, wu, wd, sh, limit, limit)) < 0.15
    alone = moe_fp8(quantised(slice(2, 3)), ids[2:3], w[2:3], wg, wu, wd, limit=limit, shared=sh, shared_limit=limit,
                    config=cfg)
  else:
    cfg = dataclasses.replace(CFG, fp8_scale_on="partial", fp8_convert="bits")
    out = moe_fp8(x, ids, w, wg, wu, wd, limit=limit, shared=sh, shared_limit=limit, config=cfg)
    ref = reference(x, ids, w, wg, wu, wd, sh, limit, limit)
    assert rel_err(out, ref) <= 1e-2
    exact = _exact(x, ids, w, wg, wu, wd, sh, limit)
    assert rel_err(out, exact) < rel_err(ref, exact)   # the scale on the partial: closer to the exact product
    alone = moe_fp8(x[2:3], ids[2:3], w[2:3], wg, wu, wd, limit=limit, shared=sh, shared_limit=limit, config=cfg)
  assert out.shape == x.shape and out.dtype == BF
  np.testing.assert_array_equal(np.asarray(out[2:3], np.float32), np.asarray(alone, np.float32))


def test_kernel_calls_route_fp8_experts_and_fall_back_to_dequantised():
  """KernelCalls.moe takes Fp8Weight experts: interpret mode and widths the Mosaic tiles cannot take (the demo
  model's I = 96) run the bf16 kernels on dequantised weights; the result is the model's math either way."""
  x, ids, w, wg, wu, wd, sh = make(3, 2)
  calls = KernelCalls(interpret=True)
  out = calls.moe(x, ids, w, wg, wu, wd, limit=0.0, shared=sh, shared_limit=0.0)
  assert rel_err(out, reference(x, ids, w, wg, wu, wd, sh, 0.0, 0.0)) <= 1e-2


def test_fp8_config_and_operand_errors():
  with pytest.raises(ValueError, match="block_k=192"):
    check_fp8_config(MosaicMoeConfig(block_k=192))
  with pytest.raises(ValueError, match="fp8_operand='registers': the interpreter"):
    MosaicMoeConfig(fp8_operand="registers", interpret=True)
  with pytest.raises(ValueError, match="fp8_scale_on='scalar'"):
    MosaicMoeConfig(fp8_scale_on="scalar")
  with pytest.raises(ValueError, match="fp8_convert='lut'"):
    MosaicMoeConfig(fp8_convert="lut")
  with pytest.raises(ValueError, match="needs block_i=128"):
    MosaicMoeConfig(fp8_activations=True)
  with pytest.raises(ValueError, match="must keep their defaults"):
    MosaicMoeConfig(fp8_activations=True, block_i=128, fp8_scale_on="partial")
  x, ids, w, wg, wu, wd, sh = make(0, 2)
  with pytest.raises(ValueError, match="x float32"):
    moe_fp8(x.astype(jnp.float32), ids, w, wg, wu, wd, config=CFG)
  w8a8 = dataclasses.replace(CFG, fp8_activations=True)
  with pytest.raises(ValueError, match="must be the .x8 e4m3"):
    moe_fp8(x, ids, w, wg, wu, wd, config=w8a8)
  with pytest.raises(ValueError, match=r"x: expected float8_e4m3fn \[T, 256\] with scales \(2, 2\)"):
    moe_fp8((quant.quantize_activations(x).x8, jnp.zeros((2, 1))), ids, w, wg, wu, wd, config=w8a8)
  with pytest.raises(ValueError, match="x tuple"):   # the pair is fp8_activations' only
    moe_fp8(tuple(quant.quantize_activations(x)), ids, w, wg, wu, wd, config=CFG)
  with pytest.raises(ValueError, match=r"w_up: expected float8_e4m3fn \(16, 128, 256\) with scales \(16, 1, 2\)"):
    moe_fp8(x, ids, w, wg, quant.Fp8Weight(wu.w8, wu.scale_inv[:, :, :1]), wd, config=CFG)


@pytest.mark.parametrize("t", [1, 6, 17])
def test_moe_fp8_lowers_for_cuda(t):
  """Full Ling-3.0-flash shapes (E = 512, I = 768, D = 2560): Pallas -> Mosaic GPU -> NVVM."""
  d, e, i = 2560, 512, 768
  f8, f32 = jnp.float8_e4m3fn, jnp.float32
  pair = lambda shape: quant.Fp8Weight(S(shape, f8), S(quant.scale_shape(shape), f32))
  args = (S((t, d), BF), S((t, A), jnp.int32), S((t, A), f32), pair((e, i, d)), pair((e, i, d)), pair((e, d, i)),
          (pair((i, d)), pair((i, d)), pair((d, i))))
  n = 16 if t <= 16 else 32
  # the default, w8a8 and the GPU's fastest bf16-wgmma form (KernelCalls' partial-bits with moe_fp8_n_tokens=16)
  configs = [MosaicMoeConfig(), MosaicMoeConfig(fp8_activations=True, block_i=128, n_tokens=n),
             MosaicMoeConfig(fp8_operand="registers", fp8_scale_on="partial", fp8_convert="bits", n_tokens=n)]
  if t == 6:  # the GPU-only register operand and the other bf16-wgmma forms lower too
    configs += [MosaicMoeConfig(fp8_operand="registers"),
                MosaicMoeConfig(fp8_scale_on="partial"), MosaicMoeConfig(fp8_convert="bits")]
  for cfg in configs:
    xs = (S((t, d), f8), S((t, d // 128), f32)) if cfg.fp8_activations else args[0]
    with jax.sharding.use_abstract_mesh(H200):
      text = jax.jit(lambda *a: moe_fp8(*a[:6], limit=4.0, shared=a[6], shared_limit=5.0, config=cfg)).trace(
          xs, *args[1:]).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2        # up and down kernels


def test_kernel_calls_moe_fp8_scheme_selects_the_config_and_lowers():
  """KernelCalls.moe_fp8_scheme: validated, mapped onto the config's fp8 fields (the default: partial-bits,
  16 token columns); fp8_activations (the numerics' "dynamic") selects w8a8 whatever the field says, and the w8a8
  call (quantize_activations + 2 kernels) lowers for CUDA."""
  with pytest.raises(ValueError, match="moe_fp8_scheme='fp4'"):
    KernelCalls(moe_fp8_scheme="fp4")
  with pytest.raises(ValueError, match="moe_fp8_scheme='w8a8' quantises the activations: a numerics choice"):
    KernelCalls(moe_fp8_scheme="w8a8")
  with pytest.raises(ValueError, match="block_i=64 must be 128"):
    KernelCalls(moe_tiles=MosaicMoeConfig())._fp8_moe_config(6, None, fp8_activations=True)
  # the default: partial-bits in registers over 16 token columns (the form the H200 timed fastest)
  assert KernelCalls()._fp8_moe_config(6, None) == MosaicMoeConfig(
      n_tokens=16, fp8_scale_on="partial", fp8_convert="bits", fp8_operand="registers")
  want = {"weight": {}, "partial": dict(fp8_scale_on="partial", fp8_operand="registers"),
          "partial-bits": dict(fp8_scale_on="partial", fp8_convert="bits", fp8_operand="registers")}
  for scheme, fields in want.items():
    calls = KernelCalls(moe_fp8_scheme=scheme, moe_n_tokens=16, moe_fp8_n_tokens=None)
    assert calls._fp8_moe_config(6, None) == MosaicMoeConfig(n_tokens=16, **fields)
    assert calls._fp8_moe_config(6, None, fp8_activations=True) == MosaicMoeConfig(n_tokens=16, fp8_activations=True,
                                                                                   block_i=128)
  # moe_fp8_n_tokens: the fp8 kernel's own columns (16 -> 32 -> 64 as T grows), moe_n_tokens left to the bf16 one
  fp8_cols = KernelCalls(moe_fp8_n_tokens=16)
  assert [fp8_cols._fp8_moe_config(t, None).n_tokens for t in (1, 6, 16, 17, 32, 33)] == [16, 16, 16, 32, 32, 64]
  assert fp8_cols._mosaic_moe_config(6, None).n_tokens == 64
  assert KernelCalls(moe_fp8_n_tokens=None)._fp8_moe_config(6, None).n_tokens == 64   # None: moe_n_tokens
  with pytest.raises(ValueError, match="moe_fp8_n_tokens=48"):
    KernelCalls(moe_fp8_n_tokens=48)
  # moe_fp8_split_k: 6 where 128 x 6 divides I (Ling's 768), else the tiles' own 3 (a width of 384)
  ling_gate, narrow_gate = S((512, 768, 2560), jnp.float8_e4m3fn), S((16, 384, 256), jnp.float8_e4m3fn)
  assert KernelCalls()._fp8_moe_config(6, ling_gate).split_k == 6
  assert KernelCalls()._fp8_moe_config(6, narrow_gate).split_k == MosaicMoeConfig().split_k == 3
  assert KernelCalls(moe_fp8_split_k=None)._fp8_moe_config(6, ling_gate).split_k == 3
  with pytest.raises(ValueError, match="moe_fp8_split_k=0"):
    KernelCalls(moe_fp8_split_k=0)
  d, e, i, t = 2560, 512, 768, 6
  f8, f32 = jnp.float8_e4m3fn, jnp.float32
  pair = lambda shape: quant.Fp8Weight(S(shape, f8), S(quant.scale_shape(shape), f32))
  calls = KernelCalls(moe_n_tokens=16)
  with jax.sharding.use_abstract_mesh(H200):
    text = jax.jit(lambda x, ids, w, *ws: calls.moe(x, ids, w, *ws[:3], limit=4.0, shared=ws[3:], shared_limit=5.0,
                                                    fp8_activations=True)
                   ).trace(S((t, d), BF), S((t, A), jnp.int32), S((t, A), f32), pair((e, i, d)), pair((e, i, d)),
                           pair((e, d, i)), pair((i, d)), pair((i, d)), pair((d, i))
                           ).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 2
