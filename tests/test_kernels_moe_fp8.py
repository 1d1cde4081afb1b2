"""fp8-weight Mosaic GPU MoE (pallas_kernels/moe_mosaic_fp8.py): the Mosaic GPU interpreter on CPU against the
model's own MoE math on the dequantised weights (ling_jax.layers.moe.routed_experts + dense_mlp, which gather
and dequantise quant.Fp8Weight experts), and the CUDA lowering at full Ling-3.0-flash shapes.

Shapes: D = 256, I = 128, E = 16, A = 8; T in {1, 6} (T = 17: the lowering test); weights drawn with per-expert ranges that differ by
100x, so a wrong scale index (another expert's, block or step) shows as a large error. Tolerance 1e-2 relative
(bf16 h' rounding after the routing-weight fold, as the bf16 kernel).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import quant
from ling_jax.layers.moe import dense_mlp, routed_experts
from ling_jax.kernel_calls import KernelCalls
from pallas_kernels.moe_mosaic import MosaicMoeConfig
from pallas_kernels.moe_mosaic_fp8 import check_fp8_config, moe_fp8
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
  x, ids, w, wg, wu, wd, sh = make(0, 2)
  with pytest.raises(ValueError, match="x float32"):
    moe_fp8(x.astype(jnp.float32), ids, w, wg, wu, wd, config=CFG)
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
  operands = ("smem", "registers") if t == 6 else ("smem",)  # registers: the GPU-only variant lowers too
  for where in operands:
    cfg = MosaicMoeConfig(fp8_operand=where)
    with jax.sharding.use_abstract_mesh(H200):
      text = jax.jit(lambda *a: moe_fp8(*a[:6], limit=4.0, shared=a[6], shared_limit=5.0, config=cfg)).trace(
          *args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2        # up and down kernels
