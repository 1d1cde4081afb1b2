"""Fused lm_head + argmax (pallas_kernels/lm_head_argmax.py): the Mosaic GPU interpreter on CPU vs the
model's own path, ling_jax.model.lm_logits then ling_jax.sampling.greedy (jnp.argmax over fp32 logits),
and the CUDA lowering at full Ling-3.0-flash shapes.

Shapes: D = 256, V = 1000 (not a multiple of the 128-row tile: 8 tiles, the last one slides back to
rows 872..999 and masks 872..895). Ties are planted by copying the winning lm_head row to other rows
(identical rows give bit-identical logits in any accumulation order), in other tiles, in the same tile
and in the tail's overlap region; a zero hidden row makes all V logits tie at 0.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.model import lm_logits
from ling_jax.sampling import greedy
from pallas_kernels.lm_head_argmax import LmHeadConfig, lm_head_argmax
from tests.cuda_lowering import H200, S, lower_cuda

BF = jnp.bfloat16
D, V = 256, 1000
CFG = LmHeadConfig(block_v=128, block_k=128, stages=2, n_tokens=32, interpret=True)


def make(seed, t, v=V):
  k1, k2 = jax.random.split(jax.random.key(seed))
  hidden = jax.random.normal(k1, (t, D), jnp.float32).astype(BF)
  w = (jax.random.normal(k2, (v, D), jnp.float32) * D ** -0.5).astype(BF)
  return hidden, w


def model_path(hidden, w):
  logits = lm_logits({"lm_head": w}, hidden)                 # [T, V] f32
  return greedy(logits), jnp.max(logits, axis=-1)


def check(hidden, w, cfg=CFG):
  token, best = lm_head_argmax(hidden, w, config=cfg)
  ref_token, ref_best = model_path(hidden, w)
  assert token.dtype == jnp.int32 and best.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(token), np.asarray(ref_token))
  rel = np.abs(np.asarray(best) - np.asarray(ref_best)) / np.maximum(np.abs(np.asarray(ref_best)), 1e-30)
  assert rel.max() <= 1e-5, rel
  return token, best


@pytest.mark.parametrize("t", [1, 6, 17])
def test_matches_model_argmax(t):
  check(*make(t, t))


def test_planted_ties_take_the_lowest_index():
  hidden, w = make(3, 6)
  token, _ = model_path(hidden, w)
  win = [int(i) for i in token]
  # Row 0: winner copied to a later tile and to a row before it in another tile -> that earlier row wins.
  # Row 1: copied inside its own tile, before and after. Row 2: copied into the tail's overlap region
  # (rows 872..895, owned by tile 6 and reloaded by tile 7) and into the real tail.
  # Row 3: all logits 0 (zero hidden): index 0.
  plant = {0: [win[0] + 300 if win[0] < 600 else win[0] - 300, 5],
           1: [(win[1] // 128) * 128 + 127, (win[1] // 128) * 128 + 1],
           2: [880, 990]}
  for row, copies in plant.items():
    for c in copies:
      if c != win[row]:
        w = w.at[c].set(w[win[row]])
  hidden = hidden.at[3].set(0)
  token, best = check(hidden, w)
  assert int(token[0]) == min(win[0], 5)
  assert int(token[1]) == min(win[1], (win[1] // 128) * 128 + 1)
  assert int(token[2]) == min(win[2], 880)
  assert int(token[3]) == 0 and float(best[3]) == 0.0


@pytest.mark.parametrize("v", [640, 777])
def test_vocab_tail(v):
  """V a multiple of the tile, and a tail of 9 rows, with the winner planted in the tail."""
  hidden, w = make(5, 4, v)
  w = w.at[v - 2].set(hidden[1] * 0.5)                       # row v-2 wins for token 1 (logit |h|^2/2)
  token, _ = check(hidden, w)
  assert int(token[1]) == v - 2


def test_batch_invariant():
  hidden, w = make(7, 6)
  token, best = lm_head_argmax(hidden, w, config=CFG)
  alone_t, alone_b = lm_head_argmax(hidden[2:3], w, config=CFG)
  assert int(alone_t[0]) == int(token[2])
  assert np.asarray(alone_b)[0].tobytes() == np.asarray(best)[2].tobytes()   # bit-identical


def test_leading_dims_and_errors():
  hidden, w = make(9, 6)
  token, _ = lm_head_argmax(hidden.reshape(2, 3, D), w, config=CFG)
  assert token.shape == (2, 3)
  np.testing.assert_array_equal(np.asarray(token).reshape(-1), np.asarray(model_path(hidden, w)[0]))
  with pytest.raises(ValueError, match="block_v=96"):
    LmHeadConfig(block_v=96)
  with pytest.raises(ValueError, match="n_tokens=20"):
    LmHeadConfig(n_tokens=20)
  with pytest.raises(ValueError, match="T=33"):
    lm_head_argmax(jnp.zeros((33, D), BF), w, config=CFG)
  with pytest.raises(ValueError, match="f32"):
    lm_head_argmax(hidden.astype(jnp.float32), w.astype(jnp.float32), config=CFG)
  with pytest.raises(ValueError, match="V=100 is below block_v=128"):
    lm_head_argmax(hidden, w[:100], config=CFG)


@pytest.mark.parametrize("t", [1, 6, 17])
def test_lowers_for_cuda_at_ling_shapes(t):
  """V = 157184, D = 2560: Pallas -> Mosaic GPU -> NVVM (layouts, SMEM budget, wgmma shapes)."""
  text = lower_cuda(lm_head_argmax, S((t, 2560), BF), S((157184, 2560), BF))
  assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma" in text
  if t == 17:   # 8 stages x (256 x 128 + 32 x 128) x 2 B = 590 KB: over the SMEM budget
    with pytest.raises(ValueError, match="shared memory"):
      lower_cuda(lambda h, w: lm_head_argmax(h, w, config=LmHeadConfig(block_v=256, stages=8)),
                 S((t, 2560), BF), S((157184, 2560), BF))
