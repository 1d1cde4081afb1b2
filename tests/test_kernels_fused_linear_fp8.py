"""Fused norm + projection / projection + residual on block-fp8 weights (pallas_kernels/fused_linear_fp8.py): the
Mosaic GPU interpreter on CPU against the model's own projection (ling_jax.layers.linear: Normed.value, project,
linear) on the weights quant.py dequantises, the chooser (KernelCalls.norm_linear / linear_residual with
quant.Fp8Weight), batch invariance, and the CUDA lowering at Ling-3.0-flash shapes.

Oracles: scale_on="partial" computes xn @ (f32(W8) s)^T, so its f32 output is held to 1e-5 of the model's
`project` in f32 (weights dequantised to f32); scale_on="weight" rounds W8 s to bf16 first (quant.dense), so its
f32 output is held to 1e-5 of the einsum on the bf16-dequantised weight; scale_on="e4m3" quantises xn
(quant.quantize_activations), so its f32 output is held to 1e-5 of `project` in f32 on
quant.dequantize_activations of that (the model's functions composed). bf16 outputs: <= 1e-2 of the model's bf16
path (on those activations for "e4m3"). Weights: block magnitudes spread over 100x (a wrong block's scale is a
large error). Shapes: K = 192 with BK = 64 (3 steps; the second 128-wide scale column is half a block) and N = 192
(the second scale row half a block), so partial scale blocks on both axes are exercised ("e4m3": BK = 128, so
K = 256 .. 512, N = 192).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import quant
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.linear import Normed, Projection, linear, norm_projections, project
from pallas_kernels.fused_linear import LinearConfig, Proj
from pallas_kernels.fused_linear_fp8 import linear_residual_fp8, norm_linear_fp8
from tests.conftest import rel_err
from tests.cuda_lowering import S, lower_cuda

BF, F32, F8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
D, EPS = 192, 1e-6
CFG = LinearConfig(block_n=64, block_k=64, ring_bytes=4 * 64 * 64 * 2, interpret=True)  # 8 fp8 slots
PROJS = (Proj(out="float32"), Proj("sigmoid"), Proj("swiglu", limit=0.5))


def fp8_weight(key, n, k):
  """quant.quantize of a weight whose 128 x 128 blocks differ in magnitude by up to 100x."""
  kw, kb = jax.random.split(key)
  blocks = jnp.exp(jax.random.uniform(kb, (-(-n // 128), -(-k // 128)), F32, -2.3, 2.3))
  mag = jnp.repeat(jnp.repeat(blocks, 128, 0), 128, 1)[:n, :k]
  return quant.quantize(jax.random.normal(kw, (n, k), F32) * k ** -0.5 * mag)


def make(seed, t):
  k = jax.random.split(jax.random.key(seed), 6)
  x = (3 * jax.random.normal(k[0], (t, D), F32)).astype(BF)
  nw = (1 + 0.2 * jax.random.normal(k[1], (D,), F32)).astype(BF)
  return x, nw, (fp8_weight(k[2], 192, D), fp8_weight(k[3], 32, D), (fp8_weight(k[4], 64, D), fp8_weight(k[5], 64, D)))


def model_projections(x, nw, weights):
  """The model's path: Normed.value() (rms_norm), then `project` per projection on the fp8 weights."""
  hv = Normed(x, nw, EPS).value()
  kinds = (("linear", 0.0), ("sigmoid", 0.0), ("swiglu", 0.5))     # PROJS
  return hv, tuple(project(hv, Projection(w, *kind)) for w, kind in zip(weights, kinds))


@pytest.mark.parametrize("scale_on,t", [("partial", 6), ("weight", 1)])
def test_norm_linear_fp8_matches_dequantised_model(scale_on, t):
  x, nw, weights = make(t, t)
  if scale_on == "weight":   # the epilogues are shared with "partial": only the f32 projection (interpreter time)
    weights = weights[:1]
  projs = PROJS[:len(weights)]
  outs = norm_linear_fp8(x, nw, weights, projs=projs, eps=EPS, config=CFG, scale_on=scale_on)
  hv, refs = model_projections(x, nw, weights)
  for o, r in zip(outs[1:], refs[1:]):       # bf16 outputs (f32 sigmoid: its bf16 logit rounded)
    assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, o.dtype, r.shape, r.dtype)
    assert rel_err(o, r) <= 1e-2
  # the f32 output against the dequantised math of its scale placement, to 1e-5
  if scale_on == "partial":
    exact = project(hv.astype(F32), Projection(weights[0]))                     # W = f32(W8) s
  else:
    exact = jnp.einsum("td,nd->tn", hv, quant.dense(weights[0], BF), preferred_element_type=F32)
  assert outs[0].dtype == F32 and rel_err(outs[0], exact) <= 1e-5
  # ... which tells the two apart (the bf16 rounding of W8 s is ~1e-3), and a wrong block scale is visible
  other = jnp.einsum("td,nd->tn", hv, quant.dense(weights[0], BF if scale_on == "partial" else F32),
                     preferred_element_type=F32)
  assert rel_err(outs[0], other) > 1e-4
  if t > 1:  # batch invariance: row 4 of the T = 6 call equals the T = 1 call on that row, bitwise (wgmma N = 8)
    one = norm_linear_fp8(x[4:5], nw, weights, projs=projs, eps=EPS, config=CFG, scale_on=scale_on)
    for a, b in zip(outs, one):
      np.testing.assert_array_equal(np.asarray(a[4:5], F32), np.asarray(b, F32))


def test_linear_residual_fp8_streamed_x():
  """residual + bf16(o @ W^T) with x streamed through the ring, two CTAs over three tiles (N = 192)."""
  k = jax.random.split(jax.random.key(9), 3)
  o = jax.random.normal(k[0], (6, 256), F32).astype(BF)
  w = fp8_weight(k[1], 192, 256)
  res = (4 * jax.random.normal(k[2], (6, 192), F32)).astype(BF)
  cfg = LinearConfig(sms=2, ring_bytes=4 * 64 * 128, stream_x=True, interpret=True)
  out = linear_residual_fp8(o, w, res, config=cfg)
  ref = linear(o, w, residual=res)                                   # the model's: dequantise, einsum, add
  assert out.shape == ref.shape and out.dtype == BF and rel_err(out, ref) <= 1e-2


def test_chooser_routes_fp8_weights():
  """KernelCalls(fused_linear=True): an [S, C, D] Fp8Weight (KDA's w_qkvfg form [5, C, D]) with a bf16 projection beside it
  (two kernels, one per weight kind) and an Fp8Weight output projection, against the jnp model path."""
  k = jax.random.split(jax.random.key(5), 5)
  x = (3 * jax.random.normal(k[0], (1, 2, 256), F32)).astype(BF)
  nw = (1 + 0.2 * jax.random.normal(k[1], (256,), F32)).astype(BF)
  w5 = quant.quantize(jax.random.normal(k[2], (2, 128, 256), F32) * 256 ** -0.5)
  b = (jax.random.normal(k[3], (4, 256), F32) * 256 ** -0.5).astype(BF)
  h, projs = Normed(x, nw, EPS), (Projection(w5), Projection(b, "sigmoid"))
  calls = KernelCalls(interpret=True, fused_linear=True)
  got = calls.norm_linear(h, projs)
  assert got is not None
  for o, r in zip(got, norm_projections(h, projs, None)):
    assert o.shape == r.shape and rel_err(o, r) <= 1e-2
  wo = fp8_weight(k[4], 64, 256)
  o_in = jax.random.normal(k[0], (1, 2, 256), F32).astype(BF)
  res = x[..., :64]
  out = calls.linear_residual(o_in, wo, res)
  assert out is not None and rel_err(out, linear(o_in, wo, None, res)) <= 1e-2
  ragged = quant.quantize(jax.random.normal(k[2], (2, 96, 256), F32))         # C = 96: blocks span two heads
  assert calls.norm_linear(h, (Projection(ragged),)) is None


def test_errors():
  x, nw, weights = make(0, 2)
  with pytest.raises(ValueError, match="block_k=256"):
    norm_linear_fp8(jnp.zeros((2, 512), BF), jnp.ones((512,), BF), (fp8_weight(jax.random.key(0), 64, 512),),
                    projs=(Proj(),), eps=EPS, config=LinearConfig(block_k=256, interpret=True))
  with pytest.raises(ValueError, match="float32 scales"):
    norm_linear_fp8(x, nw, ((weights[1].w8, weights[1].scale_inv[:, :1]),), projs=(Proj(),), eps=EPS, config=CFG)
  with pytest.raises(ValueError, match="scale_on='block'"):
    norm_linear_fp8(x, nw, weights[1:2], projs=(Proj(),), eps=EPS, config=CFG, scale_on="block")
  with pytest.raises(ValueError, match="fp8_linear_scale"):
    KernelCalls(fp8_linear_scale="tensor")


def quantised(h, dtype=F32):
  """The activations an e4m3 x e4m3 wgmma sees: the model's dynamic quantisation of h, dequantised."""
  return quant.dequantize_activations(quant.quantize_activations(h), dtype)


CFG_E4M3 = LinearConfig(block_n=64, block_k=128, ring_bytes=4 * 64 * 128, interpret=True)  # 4 fp8 slots


def test_norm_linear_e4m3_matches_model_on_quantised_activations():
  """scale_on="e4m3" at T = 6, K = 512 (4 groups of 128 = 4 steps: the step-pair loop and its tail), N = 192
  (3 tiles, a half scale block) as an f32 output and a swiglu (4 slots = 2 nw: pipelined, two partials per
  weight); row 5 of x is zero (all-zero groups: s_x = 0, x8 = 0); row 2 bitwise equal to the T = 1 call. (The
  sigmoid epilogue is the other scale_on's, tested above.)"""
  k = jax.random.split(jax.random.key(11), 5)
  t, d = 6, 512
  x = (3 * jax.random.normal(k[0], (t, d), F32)).astype(BF).at[5].set(0)
  nw = (1 + 0.2 * jax.random.normal(k[1], (d,), F32)).astype(BF)
  weights = (fp8_weight(k[2], 192, d), (fp8_weight(k[3], 64, d), fp8_weight(k[4], 64, d)))
  projs = (PROJS[0], PROJS[2])
  outs = norm_linear_fp8(x, nw, weights, projs=projs, eps=EPS, config=CFG_E4M3, scale_on="e4m3")
  hv = Normed(x, nw, EPS).value()
  gated = project(quantised(hv, BF), Projection(weights[1], "swiglu", 0.5))
  assert outs[1].shape == gated.shape and outs[1].dtype == BF and rel_err(outs[1], gated) <= 1e-2
  exact = project(quantised(hv), Projection(weights[0]))                # f32: x8 s_x @ (f32(W8) s)^T
  assert outs[0].dtype == F32 and rel_err(outs[0], exact) <= 1e-5
  assert rel_err(outs[0], project(hv.astype(F32), Projection(weights[0]))) > 1e-3    # the quantisation is visible
  assert not np.asarray(outs[0][5]).any()
  one = norm_linear_fp8(x[2:3], nw, weights, projs=projs, eps=EPS, config=CFG_E4M3, scale_on="e4m3")
  for a, b in zip(outs, one):
    np.testing.assert_array_equal(np.asarray(a[2:3], F32), np.asarray(b, F32))


def test_norm_linear_e4m3_one_step_at_a_time():
  """A swiglu with a ring of 2 slots (K = 256: R = KB = 2 < 2 nw): each step waits for its own wgmma."""
  k = jax.random.split(jax.random.key(13), 3)
  x = (3 * jax.random.normal(k[0], (2, 256), F32)).astype(BF)
  nw = jnp.ones((256,), BF)
  w = (fp8_weight(k[1], 64, 256), fp8_weight(k[2], 64, 256))
  (out,) = norm_linear_fp8(x, nw, (w,), projs=(PROJS[2],), eps=EPS, config=CFG_E4M3, scale_on="e4m3")
  ref = project(quantised(Normed(x, nw, EPS).value(), BF), Projection(w, "swiglu", 0.5))
  assert out.shape == ref.shape and rel_err(out, ref) <= 1e-2


def test_linear_residual_e4m3():
  """residual + bf16(o8 s_x @ W^T): x quantised in the prologue without a norm (K = 384: 3 steps, the pair loop
  and an odd last step; two CTAs), against the model's `linear` on the quantised activations."""
  k = jax.random.split(jax.random.key(12), 3)
  o = jax.random.normal(k[0], (6, 384), F32).astype(BF)
  w = fp8_weight(k[1], 128, 384)
  res = (4 * jax.random.normal(k[2], (6, 128), F32)).astype(BF)
  cfg = LinearConfig(sms=2, interpret=True)
  out = linear_residual_fp8(o, w, res, config=cfg, scale_on="e4m3")
  ref = linear(quantised(o, BF), w, residual=res)
  assert out.shape == ref.shape and out.dtype == BF and rel_err(out, ref) <= 1e-2
  exact = res.astype(F32) + (quantised(o) @ quant.dequantize(w, F32).T).astype(BF).astype(F32)
  assert rel_err(out, exact) <= 4e-3


def test_e4m3_errors():
  x, w = jnp.zeros((2, 256), BF), fp8_weight(jax.random.key(0), 64, 256)
  with pytest.raises(ValueError, match="block_k=64"):
    norm_linear_fp8(x, jnp.ones((256,), BF), (w,), projs=(Proj(),), eps=EPS, config=CFG, scale_on="e4m3")
  with pytest.raises(ValueError, match="resident"):
    linear_residual_fp8(x, w, jnp.zeros((2, 64), BF), config=LinearConfig(stream_x=True, interpret=True),
                        scale_on="e4m3")
  with pytest.raises(ValueError, match=r"Numerics\(fp8_activations='dynamic'\)"):   # the numerics choose e4m3
    KernelCalls(interpret=True, fused_linear=True, fp8_linear_scale="e4m3")


LING = dict(  # name -> (weight shapes, projs) at D = 2560
    kda=([(20480, 2560), (32, 2560)], (Proj(), Proj())),
    mla=([(6144, 2560), (576, 2560), (32, 2560)], (Proj(), Proj(), Proj("sigmoid"))),
    dense=([(6144, 2560), (6144, 2560)], (Proj("swiglu", limit=7.0),)),
    shared=([(768, 2560), (768, 2560), (512, 2560)], (Proj("swiglu", limit=7.0), Proj("sigmoid", logit="float32"))),
)
pair = lambda n, k: (S((n, k), F8), S((-(-n // 128), -(-k // 128)), F32))


@pytest.mark.parametrize("t,scale_on", [(6, "partial"), (17, "weight"), (6, "e4m3")])
def test_lowers_for_cuda_at_ling_shapes(t, scale_on):
  """Each fused projection group of a Ling layer (T = 6) and o_proj + residual (4096 -> 2560; x streamed at
  T = 17); "e4m3" (x resident: quantised in the prologue) with its pipelined K loop."""
  for name, (shapes, projs) in LING.items() if t == 6 else ():
    def f(x, nw, *ws, projs=projs):
      it = iter(zip(ws[::2], ws[1::2]))
      weights = tuple((next(it), next(it)) if p.kind == "swiglu" else next(it) for p in projs)
      return norm_linear_fp8(x, nw, weights, projs=projs, eps=EPS, scale_on=scale_on)
    text = lower_cuda(f, S((t, 2560), BF), S((2560,), BF), *(a for s in shapes for a in pair(*s)))
    assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma" in text, name
  res = lambda o, w, s, r: linear_residual_fp8(o, (w, s), r, scale_on=scale_on)
  text = lower_cuda(res, S((t, 4096), BF), *pair(2560, 4096), S((t, 2560), BF))
  assert text.count("custom_call @mosaic_gpu") == 1
