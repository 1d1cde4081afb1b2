"""Fused kda_decode (Pallas Triton, interpret mode on CPU) vs the model's decode step (ling_jax/layers/kda.py:
kda_inputs, kda_recurrent, slide_window; through tests/kernel_oracles.py) in bf16, the model vs a float64 numpy
loop in fp32, and the CUDA lowering at Ling-3.0-flash shapes."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda_decode import kda_decode
from pallas_kernels.kda_verify import KdaConfig
from tests import kernel_oracles as model
from tests.test_kernels_kda import make, numpy_kda, rel_err
from tests.cuda_lowering import H200, S

W = 4


def decode_layout(args):
  """test_kernels_kda.make's arguments (the model's layouts, stacks of one layer) in kda_decode's: the raw q, k, v,
  f streams and the three conv weights apart, conv_state [B, W-1, 3C], rec_state [B, H, K, V]."""
  proj, b_raw, a_log, dt_bias, conv_w, conv, rec = args
  return (*(proj[:, :, s] for s in range(4)), b_raw, a_log, dt_bias, *conv_w,
          conv[0].reshape(conv.shape[1], W - 1, -1), rec[0])


def test_kda_decode_matches_model_and_numpy_loop():
  stacked = make(9, 2, 1, 3, 32, jnp.bfloat16, n_layers=1)
  args = decode_layout(stacked)
  o_ref, s_ref, cs_ref = model.kda_decode(*args)
  o, s, cs = kda_decode(*args, config=KdaConfig(block_v=16, interpret=True))
  assert o.shape == o_ref.shape and s.shape == s_ref.shape and cs.dtype == cs_ref.dtype
  assert rel_err(o, o_ref) <= 1e-5
  assert rel_err(s, s_ref) <= 1e-5
  np.testing.assert_array_equal(np.asarray(cs), np.asarray(cs_ref))   # a pure copy
  o_np, states = numpy_kda(stacked, 0)   # unrounded math: the kernel sits far closer to the bf16 model's roundings
  assert rel_err(o, o_np) > 10 * max(rel_err(o, o_ref), 1e-7)
  cat = np.concatenate([np.asarray(args[10]),
                        np.concatenate([np.asarray(a) for a in args[:3]], axis=-1)], axis=1)
  np.testing.assert_array_equal(np.asarray(cs_ref), cat[:, 1:])
  args32 = make(9, 2, 1, 3, 32, jnp.float32, n_layers=1)          # the model vs the math (fp32)
  o32, s32, _ = model.kda_decode(*decode_layout(args32))
  o_np, states = numpy_kda(args32, 0)
  assert rel_err(o32, o_np) <= 1e-5 and rel_err(s32, states[1]) <= 1e-5


def test_kda_decode_lowers_for_cuda():
  H, DK = 32, 128
  HD = H * DK
  BF, F32 = jnp.bfloat16, jnp.float32
  args = ((S((1, 1, HD), BF),) * 4 + (S((1, 1, H), BF), S((H,), F32), S((HD,), F32))
          + (S((HD, 1, W), BF),) * 3 + (S((1, W - 1, 3 * HD), BF), S((1, H, DK, DK), F32)))
  with jax.sharding.use_abstract_mesh(H200):
    text = jax.jit(kda_decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1
