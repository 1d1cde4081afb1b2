"""Pallas (Triton) router in interpret mode vs the model's router (ling_jax.layers.moe: router_logits + route,
through tests/kernel_oracles.py); tie rule; CUDA lowering.

Ids must equal the model's exactly (same order: descending score, lowest index first among
equal scores); weights within 1e-6 (fp32 sum order and 1/(1+exp(-z)) vs XLA's logistic).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.router import RouterConfig, route
from tests import kernel_oracles

CFG = RouterConfig(block_e=16, block_k=128, interpret=True)


def inputs(seed, t, d, e, dtype):
  ks = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(ks[0], (t, d), jnp.float32).astype(dtype)
  gate = (jax.random.normal(ks[1], (e, d), jnp.float32) * d ** -0.5).astype(dtype)
  bias = jax.random.normal(ks[2], (e,), jnp.float32) * 0.05
  return x, gate, bias


CASES = [  # (t, d, e, n_group, topk_group, top_k, dtype, norm); E = 512 / 8 groups is ling3-flash
    (1, 256, 512, 8, 4, 8, jnp.bfloat16, True),
    (17, 256, 512, 8, 4, 8, jnp.bfloat16, True),
    (5, 128, 64, 4, 2, 6, jnp.float32, False),
]


@pytest.mark.parametrize("t,d,e,g,kg,k,dtype,norm", CASES)
def test_route_matches_reference(t, d, e, g, kg, k, dtype, norm):
  x, gate, bias = inputs(t + e, t, d, e, dtype)
  kw = dict(n_group=g, topk_group=kg, top_k=k, routed_scaling_factor=2.5, norm_topk_prob=norm)
  ids, w = route(x, gate, bias, config=CFG, **kw)
  rids, rw = kernel_oracles.route(x, gate, bias, **kw)
  assert ids.shape == (t, k) and ids.dtype == jnp.int32 and w.dtype == jnp.float32
  np.testing.assert_array_equal(ids, rids)
  np.testing.assert_allclose(w, rw, rtol=1e-6, atol=1e-7)


def test_route_tie_rule():
  """Exact ties at every stage: zero gate rows give equal scores, the bias repeats per group.
  Expected (lax.top_k's rule, lowest index first): groups 0..3 tie on the group score and are
  kept over 4..7; inside, the top 2 of each kept group tie, so the 8 ids are in index order."""
  t, d, e, g = 3, 128, 64, 8
  x = jax.random.normal(jax.random.key(0), (t, d), jnp.float32)
  gate = jnp.zeros((e, d), jnp.float32)                               # every score = 0.5
  # group j's biases: [0.3, 0.3, 0.1, 0.1, ...] for j < 4, [0.3, 0.2, ...] for j >= 4
  per = np.full((g, e // g), 0.1, np.float32)
  per[:, 0] = 0.3
  per[:4, 1] = 0.3
  per[4:, 1] = 0.2
  per[4:, 2] = 0.3
  bias = jnp.asarray(per.reshape(e))
  kw = dict(n_group=g, topk_group=4, top_k=8, routed_scaling_factor=1.0)
  ids, w = route(x, gate, bias, config=CFG, **kw)
  rids, _ = kernel_oracles.route(x, gate, bias, **kw)
  want = np.array([0, 1, 8, 9, 16, 17, 24, 25])
  np.testing.assert_array_equal(rids, np.tile(want, (t, 1)))        # the model's rule
  np.testing.assert_array_equal(ids, rids)
  np.testing.assert_allclose(w, np.full((t, 8), 1 / 8), rtol=1e-6)


def test_route_lowers_for_cuda():
  """Ling-3.0-flash shapes (D 2560, E 512, 8 groups, keep 4, top 8): two Triton kernels."""
  h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", num_cores=132, platform="cuda"))
  s = jax.ShapeDtypeStruct
  f = lambda x, gw, b: route(x, gw, b, n_group=8, topk_group=4, top_k=8,
                             routed_scaling_factor=2.5)
  for t in (1, 17, 32):
    with jax.sharding.use_abstract_mesh(h200):
      text = jax.jit(f).trace(s((t, 2560), jnp.bfloat16), s((512, 2560), jnp.bfloat16),
                              s((512,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
