"""Mosaic GPU MoE (pallas_kernels/moe_mosaic.py): the Mosaic GPU interpreter on CPU vs the model's
moe_experts (ling_jax.layers.moe, through tests/kernel_oracles.py),
and the CUDA lowering at full Ling-3.0-flash shapes.

The interpreter simulates TMA copies, barriers, SMEM and wgmma (as a matmul of the SMEM tiles), so
the index maps, slot alignment, epilogue and combine are exercised for real; what it cannot show is
GPU timing or ptxas-level issues (the lowering test runs the whole Python Mosaic pipeline to NVVM).
Shapes: D = 256, I = 128, E = 16, A = 8; T in {1, 5, 6, 17} (none a multiple of the 64 token
columns). bf16 only: the wgmma path rejects f32 (it would run as tf32), so no 1e-5 case here.
Tolerance ||out - ref|| / ||ref|| <= 1e-2.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_mosaic import MosaicMoeConfig, moe
from tests.cuda_lowering import H200, S, lower_cuda
from tests.kernel_oracles import moe as moe_model

A, D, I, E = 8, 256, 128, 16
BF = jnp.bfloat16
# Up: one [128, 256] tile per slot in 2 K steps; down: 2 D tiles x 2 I chunks of 64.
CFG = MosaicMoeConfig(block_i=128, block_k=128, up_stages=2, block_d=128, block_kd=64, split_k=2,
                      down_stages=2, interpret=True)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(seed, t, ids_mode="random", shared=True):
  k = jax.random.split(jax.random.key(seed), 9)
  x = jax.random.normal(k[0], (t, D), jnp.float32).astype(BF)
  if ids_mode == "random":        # distinct per token, heavy overlap across tokens (E = 16)
    ids = jnp.argsort(jax.random.uniform(k[1], (t, E)), axis=1)[:, :A]
  elif ids_mode == "same":        # every token on the same 8 experts
    ids = jnp.tile(jax.random.permutation(k[1], E)[:A], (t, 1))
  else:                           # "dup": token 0 puts all 8 picks on one expert, the others
    ids = jax.random.randint(k[1], (t, A), 0, 3) * 5  # repeat experts (3 distinct per token)
    ids = ids.at[0].set(5)
  w = jax.random.uniform(k[2], (t, A), jnp.float32, 0.1, 1.0)
  nrm = lambda kk, s, sc: (jax.random.normal(kk, s, jnp.float32) * sc).astype(BF)
  wg, wu = nrm(k[3], (E, I, D), D ** -0.5), nrm(k[4], (E, I, D), D ** -0.5)
  wd = nrm(k[5], (E, D, I), I ** -0.5)
  sh = (nrm(k[6], (I, D), D ** -0.5), nrm(k[7], (I, D), D ** -0.5), nrm(k[8], (D, I), I ** -0.5)
        ) if shared else None
  return x, ids.astype(jnp.int32), w, wg, wu, wd, sh


CASES = [  # (t, ids_mode, shared, limit)
    (1, "random", False, 0.0),
    (6, "random", True, 0.3),
    (17, "same", True, 0.3),
    (5, "dup", False, 0.3),
]


@pytest.mark.parametrize("t,ids_mode,shared,limit", CASES)
def test_moe_mosaic_matches_model(t, ids_mode, shared, limit):
  x, ids, w, wg, wu, wd, sh = make(t * 7 + len(ids_mode), t, ids_mode, shared)
  kw = dict(limit=limit, shared=sh, shared_limit=limit)
  out = moe(x, ids, w, wg, wu, wd, config=CFG, **kw)
  ref = moe_model(x, ids, w, wg, wu, wd, **kw)
  assert out.shape == x.shape and out.dtype == x.dtype
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert rel_err(out, ref) <= 1e-2
  if limit > 0:   # the clamps bite at this limit: turning them off changes the result
    unclamped = moe_model(x, ids, w, wg, wu, wd, shared=sh)
    assert rel_err(unclamped, ref) > 0.1
  if t == 6:      # batch invariance: token 2 alone gives the bit-identical row
    alone = moe(x[2:3], ids[2:3], w[2:3], wg, wu, wd, config=CFG, **kw)
    np.testing.assert_array_equal(np.asarray(out[2:3], np.float32), np.asarray(alone, np.float32))


def test_config_and_dtype_errors():
  with pytest.raises(ValueError, match="block_i=96"):
    MosaicMoeConfig(block_i=96)
  with pytest.raises(ValueError, match="n_tokens=320"):
    MosaicMoeConfig(n_tokens=320)
  x, ids, w, wg, wu, wd, _ = make(0, 2, shared=False)
  with pytest.raises(ValueError, match="f32"):
    moe(x.astype(jnp.float32), ids, w, *(a.astype(jnp.float32) for a in (wg, wu, wd)), config=CFG)
  with pytest.raises(ValueError, match="T=65"):
    MosaicMoeConfig().check(65, 2560, 768)
  with pytest.raises(ValueError, match="block_kd \\* split_k=384 must divide 128"):
    MosaicMoeConfig(split_k=3).check(1, 256, 128)


def test_moe_mosaic_lowers_for_cuda():
  """Full Ling-3.0-flash shapes: Pallas -> Mosaic GPU -> NVVM (layouts, SMEM budget, wgmma shapes)."""
  d, e, i = 2560, 512, 768
  for t in (1, 17):
    args = (S((t, d), BF), S((t, A), jnp.int32), S((t, A), jnp.float32), S((e, i, d), BF),
            S((e, i, d), BF), S((e, d, i), BF), S((i, d), BF), S((i, d), BF), S((d, i), BF))
    text = lower_cuda(lambda *a: moe(*a[:6], limit=4.0, shared=a[6:], shared_limit=5.0), *args)
    assert text.count("custom_call @mosaic_gpu") == 2        # up and down kernels
    assert "wgmma" in text                                     # lowered to the NVVM wgmma ops
  big = MosaicMoeConfig(up_stages=8)                           # 8 x 48 KB: over the SMEM budget
  with pytest.raises(ValueError, match="shared memory"):
    lower_cuda(lambda *a: moe(*a[:6], config=big), *args[:6])
