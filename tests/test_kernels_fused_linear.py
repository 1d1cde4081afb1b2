"""Fused norm + projection and projection + residual (pallas_kernels/fused_linear.py): the Mosaic GPU
interpreter on CPU vs the model's own functions (ling_jax.layers.norms.rms_norm, jnp.einsum as the layers
write it, layers.moe.swiglu, router_logits), batch invariance, and the CUDA lowering at Ling shapes.

bf16 only: the wgmma path takes bf16 operands (f32 would run as tf32), so there is no 1e-5 case; the
kernel's bf16 rounding points (x * r rounded, then w * that; the einsum output rounded before sigmoid /
SwiGLU; the projection rounded before the residual add) are checked by comparing with the model's
composition to <= 1e-2, most cases bitwise, and by showing that skipping a rounding point is visible.
Shapes: D = 256 (two K steps of 128), projections of 128, 32 and 64 rows; T in {1, 5, 6, 17}.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.layers.moe import router_logits, swiglu
from ling_jax.layers.norms import rms_norm
from pallas_kernels.fused_linear import LinearConfig, Proj, linear_residual, norm_linear
from tests.cuda_lowering import H200, S, lower_cuda

BF, F32 = jnp.bfloat16, jnp.float32
D, EPS = 256, 1e-6
CFG = LinearConfig(block_n=64, block_k=128, ring_bytes=4 * 64 * 128 * 2, interpret=True)
PROJS = (Proj(), Proj("sigmoid"), Proj("swiglu", limit=0.5), Proj("sigmoid", logit="float32"))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(seed, t, d=D):
  k = jax.random.split(jax.random.key(seed), 8)
  w = lambda kk, n: (jax.random.normal(kk, (n, d), F32) * d ** -0.5).astype(BF)
  x = (3 * jax.random.normal(k[0], (t, d), F32)).astype(BF)
  nw = (1 + 0.2 * jax.random.normal(k[1], (d,), F32)).astype(BF)
  return x, nw, (w(k[2], 128), w(k[3], 32), (w(k[4], 64), w(k[5], 64)), w(k[6], 64))


def model_outputs(x, nw, weights):
  """The layers' composition: rms_norm, then each projection as the model writes it."""
  xn = rms_norm(x, nw, EPS)
  proj = lambda w: jnp.einsum("td,nd->tn", xn, w)
  (gate, up), router = weights[2], weights[3]
  return (proj(weights[0]),                                            # KDA q|k|v|f|g, MLA q, kv_a
          jax.nn.sigmoid(proj(weights[1]).astype(F32)),                # KDA beta, MLA gate
          swiglu(proj(gate), proj(up), 0.5),                    # dense / shared expert
          jax.nn.sigmoid(router_logits(xn, router, fp32_weight=False)))  # router scores


@pytest.mark.parametrize("t", [1, 6, 17])
def test_norm_linear_matches_model(t):
  x, nw, weights = make(t, t)
  outs = norm_linear(x, nw, weights, projs=PROJS, eps=EPS, config=CFG)
  refs = model_outputs(x, nw, weights)
  for o, r in zip(outs, refs):
    assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, o.dtype, r.shape, r.dtype)
    assert rel_err(o, r) <= 1e-2
  # Same rounding points as the model: the bf16 outputs agree bitwise in the interpreter.
  for o, r in zip(outs[:3], refs[:3]):
    np.testing.assert_array_equal(np.asarray(o, F32), np.asarray(r, F32))
  # ... and the normed-x rounding is visible: an fp32 normed x gives a different projection.
  xf = x.astype(F32)
  unrounded = jnp.einsum("td,nd->tn", (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + EPS)
                                       * nw.astype(F32)).astype(BF), weights[0])
  assert not np.array_equal(np.asarray(unrounded, F32), np.asarray(outs[0], F32))
  # The clamp bites at L = 0.5.
  assert rel_err(swiglu(*(jnp.einsum("td,nd->tn", rms_norm(x, nw, EPS), w) for w in weights[2]), 0.0),
                 refs[2]) > 0.1


def test_batch_invariance():
  """Row r of a T=6 call equals the T=1 call on row r, bitwise (both run wgmma N = 8). T=17 runs N = 24:
  its bf16 outputs are bitwise equal too; the f32 router scores may differ by an ulp here because the
  interpreter's wgmma is a CPU dot whose summation blocking depends on N (the GPU bench checks bitwise)."""
  x, nw, weights = make(3, 17)
  many6 = norm_linear(x[:6], nw, weights, projs=PROJS, eps=EPS, config=CFG)
  many17 = norm_linear(x, nw, weights, projs=PROJS, eps=EPS, config=CFG)
  for r in (0, 4):
    one = norm_linear(x[r:r + 1], nw, weights, projs=PROJS, eps=EPS, config=CFG)
    for a, b, c in zip(many6, many17, one):
      np.testing.assert_array_equal(np.asarray(a[r:r + 1], F32), np.asarray(c, F32))
      if b.dtype == BF:
        np.testing.assert_array_equal(np.asarray(b[r:r + 1], F32), np.asarray(c, F32))
      else:
        np.testing.assert_allclose(np.asarray(b[r:r + 1]), np.asarray(c), rtol=1e-6, atol=0)


def test_two_normed_inputs_mtp():
  """MTP: eh_proj(concat[enorm(e), hnorm(h)]) with both norms in the prologue."""
  e, ne, _ = make(5, 5)
  h, nh, _ = make(6, 5)
  w = (jax.random.normal(jax.random.key(7), (128, 2 * D), F32) * (2 * D) ** -0.5).astype(BF)
  (out,) = norm_linear((e, h), (ne, nh), (w,), projs=(Proj(),), eps=EPS, config=CFG)
  ref = jnp.einsum("btc,dc->btd", jnp.concatenate([rms_norm(e, ne, EPS), rms_norm(h, nh, EPS)], -1)[None], w)[0]
  assert rel_err(out, ref) <= 1e-2
  np.testing.assert_array_equal(np.asarray(out, F32), np.asarray(ref, F32))


def test_linear_residual_matches_model():
  """x + einsum(o, W): the projection is rounded to bf16 before the add, as the layers return it."""
  k = jax.random.split(jax.random.key(8), 3)
  o = jax.random.normal(k[0], (6, 256), F32).astype(BF)
  w = (jax.random.normal(k[1], (192, 256), F32) * 256 ** -0.5).astype(BF)
  res = (4 * jax.random.normal(k[2], (6, 192), F32)).astype(BF)
  out = linear_residual(o, w, res, config=CFG)
  ref = res + jnp.einsum("btc,dc->btd", o[None], w)[0]
  assert out.dtype == BF and rel_err(out, ref) <= 1e-2
  np.testing.assert_array_equal(np.asarray(out, F32), np.asarray(ref, F32))
  fused_f32 = (res.astype(F32) + jnp.einsum("tc,dc->td", o, w, preferred_element_type=F32)).astype(BF)
  assert not np.array_equal(np.asarray(fused_f32, F32), np.asarray(out, F32))


def test_config_and_input_errors():
  with pytest.raises(ValueError, match="block_n=96"):
    LinearConfig(block_n=96)
  with pytest.raises(ValueError, match="ring_bytes=1024"):
    LinearConfig(ring_bytes=1024)
  with pytest.raises(ValueError, match="kind='gelu'"):
    Proj("gelu")
  with pytest.raises(ValueError, match="limit=1.0"):
    Proj("sigmoid", limit=1.0)
  x, nw, weights = make(0, 2)
  with pytest.raises(ValueError, match="bfloat16"):
    norm_linear(x.astype(F32), nw, weights, projs=PROJS, eps=EPS, config=CFG)
  with pytest.raises(ValueError, match="weight \\[96, 256\\]"):
    norm_linear(x, nw, (weights[0][:96],), projs=(Proj(),), eps=EPS, config=CFG)
  with pytest.raises(ValueError, match="SMEM"):
    norm_linear(jnp.zeros((24, 8192), BF), jnp.ones((8192,), BF), (jnp.zeros((64, 8192), BF),),
                projs=(Proj(),), eps=EPS)


def test_persistent_ring_across_tiles_and_projections():
  """Fewer CTAs than tiles: sms=2 runs the 5 tiles (q 0-1, beta 2, swiglu 3, router 4) as CTA 0: 0, 2, 4 and
  CTA 1: 1, 3; the ring runs across tiles of different kinds (1 and 2 weights per step) and R = 4 does not
  divide a tile's 5 or 10 loads (KB = 5), so refills land mid-step in the next tile; R >= 4 keeps one wgmma
  group in flight (deferred release). Same values as the model (bitwise for the bf16 outputs, as the
  one-CTA-per-tile test)."""
  x, nw, weights = make(11, 6, d=640)
  refs = model_outputs(x, nw, weights)
  cfg = LinearConfig(sms=2, ring_bytes=4 * 64 * 128 * 2, interpret=True)
  outs = norm_linear(x, nw, weights, projs=PROJS, eps=EPS, config=cfg)
  for o, r in zip(outs, refs):
    assert o.shape == r.shape and rel_err(o, r) <= 1e-2
  for o, r in zip(outs[:3], refs[:3]):
    np.testing.assert_array_equal(np.asarray(o, F32), np.asarray(r, F32))


@pytest.mark.parametrize("t", [6, 17])
def test_linear_residual_streamed_x(t):
  """stream_x: x's chunk rides in each ring slot (o_proj at T = 17 cannot keep x resident); two CTAs over
  four tiles; bitwise equal to resident x and to the model's residual + bf16 projection."""
  k = jax.random.split(jax.random.key(9), 3)
  o = jax.random.normal(k[0], (t, 512), F32).astype(BF)
  w = (jax.random.normal(k[1], (256, 512), F32) * 512 ** -0.5).astype(BF)
  res = (4 * jax.random.normal(k[2], (t, 256), F32)).astype(BF)
  ref = res + jnp.einsum("btc,dc->btd", o[None], w)[0]
  streamed = linear_residual(o, w, res, config=LinearConfig(sms=2, ring_bytes=3 * 64 * 128 * 2, stream_x=True,
                                                            interpret=True))
  resident = linear_residual(o, w, res, config=LinearConfig(sms=2, stream_x=False, interpret=True))
  assert streamed.shape == ref.shape and rel_err(streamed, ref) <= 1e-2
  np.testing.assert_array_equal(np.asarray(streamed, F32), np.asarray(resident, F32))
  np.testing.assert_array_equal(np.asarray(streamed, F32), np.asarray(ref, F32))


def test_ring_and_grid_errors():
  with pytest.raises(ValueError, match="ctas_per_sm=3"):
    LinearConfig(ctas_per_sm=3)
  x, nw, weights = make(0, 2)
  with pytest.raises(ValueError, match="stream_x=True"):
    norm_linear(x, nw, weights, projs=PROJS, eps=EPS, config=LinearConfig(stream_x=True, interpret=True))
  with pytest.raises(ValueError, match="block_k=512"):
    norm_linear(jnp.zeros((2, 1024), BF), jnp.ones((1024,), BF), (jnp.zeros((64, 1024), BF),), projs=(Proj(),),
                eps=EPS, config=LinearConfig(block_k=512))
  with pytest.raises(ValueError, match="K=128 must be >= 2"):
    norm_linear(x[:, :128], nw[:128], (weights[0][:, :128],), projs=(Proj(),), eps=EPS, config=CFG)
  with pytest.raises(ValueError, match="SMEM"):   # an explicit ring larger than the CTA's share
    norm_linear(jnp.zeros((2, 4096), BF), jnp.ones((4096,), BF), (jnp.zeros((64, 4096), BF),), projs=(Proj(),),
                eps=EPS, config=LinearConfig(ring_bytes=200 * 1024, ctas_per_sm=2))


LING = dict(  # name -> (weight shapes, projs) at D = 2560 (K = 4096 for o_proj)
    kda=([(20480, 2560), (32, 2560)], (Proj(), Proj())),
    mla=([(6144, 2560), (576, 2560), (32, 2560)], (Proj(), Proj(), Proj("sigmoid"))),
    dense=([(6144, 2560), (6144, 2560)], (Proj("swiglu", limit=7.0),)),
    shared=([(768, 2560), (768, 2560), (512, 2560)], (Proj("swiglu", limit=7.0), Proj("sigmoid", logit="float32"))),
)


def _ling_fn(projs, cfg):
  def f(x, nw, *ws):
    it = iter(ws)
    weights = tuple((next(it), next(it)) if p.kind == "swiglu" else next(it) for p in projs)
    return norm_linear(x, nw, weights, projs=projs, eps=EPS, config=cfg)
  return f


@pytest.mark.parametrize("t", [1, 17])
def test_lowers_for_cuda_at_ling_shapes(t):
  """D = 2560: KDA q|k|v|f|g [20480] + b [32], MLA q|kv_a|g, dense and shared gate/up (+ router), and
  o_proj + residual 4096 -> 2560 (T = 17: x streamed), at the default config and at 2 CTAs / SM (T = 1; at
  T = 17 the resident x [24, 2560] alone exceeds half an SM) or BK = 256 (T = 17)."""
  for cfg in (LinearConfig(), LinearConfig(ctas_per_sm=2) if t == 1 else LinearConfig(block_k=256)):
    for name, (shapes, projs) in LING.items():
      text = lower_cuda(_ling_fn(projs, cfg), S((t, 2560), BF), S((2560,), BF), *(S(s, BF) for s in shapes))
      assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma" in text, name
    res = lambda o, w, r, cfg=cfg: linear_residual(o, w, r, config=cfg)
    text = lower_cuda(res, S((t, 4096), BF), S((2560, 4096), BF), S((t, 2560), BF))
    assert text.count("custom_call @mosaic_gpu") == 1
