"""The MoE chain with the expert alignment inside the router (router.route_slots -> moe_mosaic.moe_slots).

Oracles: the model's own functions (ling_jax.layers.moe: router_logits + route + borrow_routing for the ids and
weights, moe_layer with kernels=None for the layer) and the XLA slot tables the Mosaic kernel used before
(moe_mosaic._align, fed the model's routing). Interpret mode on CPU: the Triton router in the Pallas interpreter,
the Mosaic GPU kernels in the Mosaic interpreter (small shapes). The CUDA-lowering test at Ling-3.0-flash size
pins what runs outside the custom calls of a MoE layer pass: only the split-K sum and the residual add (one
elementwise fusion), where the chain of before had ~10 kernels of alignment (reductions, gathers, concatenates,
the pad).
"""
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import PRESETS
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.moe import borrow_routing, moe_layer, route, router_logits
from pallas_kernels import router as R
from pallas_kernels.moe_mosaic import _align
from tests.cuda_lowering import S, lower_cuda

BF = jnp.bfloat16
# E = 64 in 8 groups, keep 4, top 8: Ling's routing structure at a size the Triton interpreter runs fast.
ROUTE_CFG = dataclasses.replace(PRESETS["ling-demo-v2"], num_experts=64, num_experts_per_tok=8, n_group=8,
                                topk_group=4)
# The layer test: D 256, I 128 (the Mosaic interpreter's tiles; v2's D 320 is not a multiple of 128), the shipped
# ling-demo v2's routing (E 16 in 4 groups, keep 2, top 4).
LAYER_CFG = dataclasses.replace(PRESETS["ling-demo-v2"], hidden_size=256, moe_intermediate_size=128,
                                moe_shared_expert_intermediate_size=128)
RC = R.RouterConfig(block_e=16, block_k=128, interpret=True)


def route_kw(cfg, **kw):
  return dict(n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
              routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob, **kw)


def router_inputs(seed, t, d, e):
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (t, d), jnp.float32).astype(BF)
  gate_w = (jax.random.normal(k[1], (e, d), jnp.float32) * d ** -0.5).astype(BF)
  return x, gate_w, jax.random.normal(k[2], (e,), jnp.float32) * 0.05


@pytest.mark.parametrize("t,live,n", [(1, None, 16), (18, (9, 4), 64)])  # 18 rows: 2 sequences of 9
def test_route_slots_matches_model_routing(t, live, n):
  """ids equal the model's route (borrowed past each sequence's live rows), weights within 1e-6 (fp32 sum
  order of the logits); meta equals and wc matches the XLA slot tables built from the model's routing."""
  cfg = ROUTE_CFG
  x, gate_w, bias = router_inputs(t, t, 256, cfg.num_experts)  # 2 K steps: x_pad copied by programs 0 and 1
  live_rows = None if live is None else jnp.asarray(live, jnp.int32)
  rps = 0 if live is None else t // len(live)
  out = R.route_slots(x, gate_w, bias, live_rows, **route_kw(cfg, n_tokens=n, has_shared=True, rows_per_seq=rps),
                      config=RC)
  ids, w = route(router_logits(x, gate_w, fp32_weight=False), bias, cfg)
  if live is not None:
    ids, w = borrow_routing(ids, w, live_rows, (len(live), rps))
    assert not np.array_equal(ids, route(router_logits(x, gate_w, fp32_weight=False), bias, cfg)[0])
  np.testing.assert_array_equal(out.ids, ids)
  np.testing.assert_allclose(out.weights, w, rtol=1e-6, atol=1e-7)
  meta, wc = _align(ids, w, n, True)
  np.testing.assert_array_equal(out.meta, meta)
  np.testing.assert_allclose(out.wc, wc, rtol=1e-6, atol=1e-7)
  assert 0 < int(out.meta[0]) <= t * cfg.num_experts_per_tok
  np.testing.assert_array_equal(np.asarray(out.x_pad[:t], np.float32), np.asarray(x, np.float32))
  assert not np.any(np.asarray(out.x_pad[t:], np.float32))
  # The entry for a caller with its own logits: the same tables.
  logits = router_logits(x, gate_w, fp32_weight=False)
  alt = R.slots_from_logits(logits, bias, live_rows, **route_kw(cfg, n_tokens=n, has_shared=True,
                                                                 rows_per_seq=rps), config=RC)
  np.testing.assert_array_equal(alt.ids, ids)
  np.testing.assert_array_equal(alt.meta, meta)
  np.testing.assert_allclose(alt.wc, wc, rtol=1e-6, atol=1e-7)


def layer_params(seed, cfg):
  d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  k = jax.random.split(jax.random.key(seed), 8)
  nrm = lambda kk, s, fan: (jax.random.normal(kk, s, jnp.float32) * fan ** -0.5).astype(BF)
  return dict(gate_w=nrm(k[0], (e, d), d), expert_bias=jax.random.normal(k[1], (e,), jnp.float32) * 0.05,
              w_gate=nrm(k[2], (e, i, d), d), w_up=nrm(k[3], (e, i, d), d), w_down=nrm(k[4], (e, d, i), i),
              shared=dict(gate_proj=nrm(k[5], (i, d), d), up_proj=nrm(k[6], (i, d), d),
                          down_proj=nrm(k[7], (d, i), i)))


def test_moe_layer_through_slots_matches_model():
  """moe_layer through the new chain vs the model's jnp moe_layer (bf16, <= 1e-2), bitwise equal to the chain
  of before (router, XLA alignment, moe), the same expert load, and batch-invariant (a row alone = in the
  batch); rows past live_rows borrow routing as the model's do."""
  cfg, t = LAYER_CFG, 6
  p = layer_params(0, cfg)
  x = jax.random.normal(jax.random.key(1), (1, t, cfg.hidden_size), jnp.float32).astype(BF)
  live = jnp.array([4], jnp.int32)
  kw = dict(routed_limit=0.5, shared_limit=0.7, router_fp32=False, live_rows=live)
  slots = KernelCalls(interpret=True, moe_impl="mosaic", moe_n_tokens=16, moe_slots=True)
  before = dataclasses.replace(slots, moe_slots=False)
  y, load = moe_layer(p, x, cfg, kernels=slots, return_load=True, **kw)
  ref, ref_load = moe_layer(p, x, cfg, kernels=None, return_load=True, **kw)
  old = jax.block_until_ready(moe_layer(p, x, cfg, kernels=before, **kw))
  assert y.shape == x.shape and y.dtype == BF
  err = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
  assert err <= 1e-2, err
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(old, np.float32))
  np.testing.assert_array_equal(load, ref_load)
  alone = moe_layer(p, x[:, 2:3], cfg, kernels=slots, **{**kw, "live_rows": None})
  np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(y[:, 2:3], np.float32))


def test_slots_chain_is_refused_where_it_does_not_apply():
  """moe_slots off, or the Triton MoE serving the call: routed_moe says None and the layer routes itself."""
  cfg = LAYER_CFG
  p = layer_params(0, cfg)
  x = jnp.zeros((3, cfg.hidden_size), BF)
  args = (x, p["gate_w"], p["expert_bias"], cfg, (p["w_gate"], p["w_up"], p["w_down"]),
          tuple(p["shared"][k] for k in ("gate_proj", "up_proj", "down_proj")))
  lim = dict(limit=0.0, shared_limit=0.0)
  assert KernelCalls(interpret=True, moe_impl="mosaic", moe_slots=False).routed_moe(*args, **lim) is None
  # the Triton MoE serves interpret mode: its own chain (moe_router_tables) or none
  assert KernelCalls(interpret=True, moe_slots=True, moe_router_tables=False).routed_moe(*args, **lim) is None
  with pytest.raises(ValueError, match="moe_n_tokens=48"):
    KernelCalls(moe_n_tokens=48)
  with pytest.raises(ValueError, match="T=17 tokens exceed n_tokens=16"):
    R.route_slots(jnp.zeros((17, 128), BF), jnp.zeros((64, 128), BF), jnp.zeros((64,)),
                  **route_kw(ROUTE_CFG, n_tokens=16, has_shared=True), config=RC)


# What may run outside the custom calls of a MoE layer pass (x -> residual + moe(x)): the split-K partial sum,
# the slice to T columns, its transpose, the casts and the residual add -- elementwise, one XLA fusion.
# Reshapes are bitcasts. Anything else (reduce, gather, compare, select, iota, pad, concatenate, sort) is a
# kernel of alignment that came back.
OUTSIDE = {"stablehlo.slice": 4, "stablehlo.add": 3, "stablehlo.transpose": 1, "stablehlo.convert": 3}


def test_moe_layer_lowers_for_cuda_with_no_alignment_kernels():
  cfg = PRESETS["ling3-flash"]
  d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  p = dict(gate_w=S((e, d), BF), expert_bias=S((e,), jnp.float32), w_gate=S((e, i, d), BF),
           w_up=S((e, i, d), BF), w_down=S((e, d, i), BF),
           shared=dict(gate_proj=S((i, d), BF), up_proj=S((i, d), BF), down_proj=S((d, i), BF)))
  for t, n in ((1, 16), (6, 64)):
    kernels = KernelCalls(moe_n_tokens=n, moe_slots=True)

    def layer(p, x, residual, live):
      return residual + moe_layer(p, x, cfg, routed_limit=4.0, shared_limit=5.0, router_fp32=False,
                                  kernels=kernels, live_rows=live)

    text = lower_cuda(layer, p, S((1, t, d), BF), S((1, t, d), BF), S((1,), jnp.int32))
    assert re.findall(r"custom_call @([\w$.]+)", text).count("__gpu$xla.gpu.triton") == 2  # scores, top-k+slots
    assert text.count("custom_call @mosaic_gpu") == 2                                          # up, down
    ops = collections.Counter(re.findall(r"= (stablehlo\.[a-z_]+)", text))
    outside = {k: v for k, v in ops.items() if k not in ("stablehlo.custom_call", "stablehlo.reshape")}
    assert outside == OUTSIDE, outside
