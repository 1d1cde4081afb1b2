"""A shared expert of width n x I inside the Triton MoE kernels (KernelCalls.moe_shared_segments; the v2 demo's
shared width 192 = 3 x its I = 64).

Oracles: the model's own jnp (ling_jax.layers.moe: moe_experts through tests/kernel_oracles.moe for the kernels,
moe_layer with kernels=None for the layer), fp32 <= 1e-5 and bf16 <= 1e-2; the routed part bitwise equal to the
kernels without the shared expert plus nothing else (the chunks only add their rows). The kernel count: lowered
for CUDA, the demo's MoE pass has no dot left outside the custom calls (before: the shared expert's 3), and the
shipped demo's plain and NEXTN5 step programs lose exactly the shared expert's 3 dots per MoE pass.
Interpret mode on CPU.
"""
import collections
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.moe import shared_expert
from pallas_kernels import moe as M
from pallas_kernels import router as R
from pallas_kernels import router_segments as RS
from tests.cuda_lowering import lower_cuda
from tests.kernel_oracles import moe as moe_model
from tests.test_kernels_router_segments import (DEMO, OUTSIDE, demo_layer_pass, demo_moe_layer, flat_eqns, inputs,
                                                pallas_names, route_kw)

BF = jnp.bfloat16
TILES = M.MoeConfig(block_i=32, block_k=64, block_d=64, block_kd=32, interpret=True)
RC = R.RouterConfig(block_e=16, block_k=64, segments="scatter", interpret=True)


def rel_err(y, ref):
  y, ref = jnp.asarray(y, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


def experts_of(seed, e, i, d, si, dtype):
  k = jax.random.split(jax.random.key(seed), 6)
  nrm = lambda kk, s, fan: (jax.random.normal(kk, s, jnp.float32) * fan ** -0.5).astype(dtype)
  experts = nrm(k[0], (e, i, d), d), nrm(k[1], (e, i, d), d), nrm(k[2], (e, d, i), i)
  shared = nrm(k[3], (si, d), d), nrm(k[4], (si, d), d), nrm(k[5], (d, si), si)
  return experts, shared


@pytest.mark.parametrize("dtype,t,n_chunks,tol", [(BF, 1, 3, 1e-2), (BF, 6, 3, 1e-2), (jnp.float32, 5, 2, 1e-5),
                                                  (jnp.float32, 3, 1, 1e-5)])
def test_moe_segments_with_shared_chunks_matches_model(dtype, t, n_chunks, tol):
  """moe_segments on the router's tables with a shared expert of n_chunks x I vs the model's moe_experts; the
  same tables through `moe` (its own align) bitwise equal; a token alone gives its row of the batch bitwise."""
  cfg, d, e, i = DEMO, DEMO.hidden_size, DEMO.num_experts, 32
  x, gate_w, bias = inputs(11 + t, t, d, e, dtype)
  experts, shared = experts_of(12 + t, e, i, d, n_chunks * i, dtype)
  kw = dict(limit=0.5, shared=shared, shared_limit=0.7, config=TILES)

  def chain(x):
    r = RS.route_segments(x, gate_w, bias, **route_kw(cfg), has_shared=True, config=RC)
    return M.moe_segments(x, r.order, r.seg, r.tok, r.w_rows, *experts, **kw), r

  y, r = chain(x)
  ref = moe_model(x, r.ids, r.weights, *experts, limit=0.5, shared=shared, shared_limit=0.7)
  assert y.shape == (t, d) and y.dtype == dtype
  err = rel_err(y, ref)
  assert err <= tol, err
  # the shared expert matters at this scale (the test would see a chunk left out)
  assert rel_err(moe_model(x, r.ids, r.weights, *experts, limit=0.5), ref) > 20 * tol
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(M.moe(x, r.ids, r.weights, *experts, **kw), np.float32))
  np.testing.assert_array_equal(np.asarray(chain(x[-1:])[0], np.float32), np.asarray(y[-1:], np.float32))


def test_moe_shared_width_not_a_multiple_of_i_is_refused():
  d, e, i = DEMO.hidden_size, DEMO.num_experts, 32
  x, gate_w, bias = inputs(3, 2, d, e)
  experts, shared = experts_of(4, e, i, d, 48, BF)
  ids, w = R.route(x, gate_w, bias, **route_kw(DEMO), config=RC)
  with pytest.raises(ValueError, match="multiple of I"):
    M.moe(x, ids, w, *experts, limit=0.5, shared=shared, shared_limit=0.7, config=TILES)


SEGMENTS = KernelCalls(interpret=True, moe_shared_segments=True)
XLA_SHARED = KernelCalls(interpret=True)


@pytest.mark.parametrize("dtype,t,live,tol", [(BF, 1, None, 1e-2), (BF, 6, (4,), 1e-2), (jnp.float32, 3, None, 1e-5)])
def test_moe_layer_with_shared_segments_matches_model(dtype, t, live, tol):
  """moe_layer at the v2 demo's dims (shared 192 = 3 x I 64) with moe_shared_segments: router_segments, up and
  down only, vs the model's jnp moe_layer (fp32 <= 1e-5, bf16 <= 1e-2) and the same expert load; the kernels'
  routed part equals the default chain's (the shared expert through XLA) minus its shared expert, within the
  shared expert's one bf16 rounding."""
  p, x, layer = demo_moe_layer(dtype, t, live)
  assert pallas_names(layer(SEGMENTS), p, x) == ["router_segments", "moe_up_swiglu", "moe_down"]
  y, load = layer(SEGMENTS)(p, x)
  ref, ref_load = layer(None)(p, x)
  assert y.shape == x.shape and y.dtype == dtype
  err = rel_err(y, ref)
  assert err <= tol, err
  np.testing.assert_array_equal(load, ref_load)
  old, _ = layer(XLA_SHARED)(p, x)
  assert rel_err(y, old) <= tol
  sh = p["shared"]
  no_shared = rel_err(old.astype(jnp.float32) - shared_expert(x, (sh["gate_proj"], sh["up_proj"], sh["down_proj"]),
                                                                0.7), ref)
  assert no_shared > 20 * tol  # the shared expert is a visible part of the output


def test_kernel_calls_moe_runs_shared_chunks_in_the_kernels():
  """KernelCalls.moe (the chain without router tables) takes the chunked shared expert into the Triton kernels:
  no dot outside them, and the model's moe_experts within bf16 tolerance."""
  cfg, d, e, i = DEMO, DEMO.hidden_size, DEMO.num_experts, DEMO.moe_intermediate_size
  x, gate_w, bias = inputs(5, 4, d, e)
  experts, shared = experts_of(6, e, i, d, cfg.moe_shared_expert_intermediate_size, BF)
  ids, w = R.route(x, gate_w, bias, **route_kw(cfg), config=RC)
  call = lambda kc: lambda x, ids, w: kc.moe(x, ids, w, *experts, limit=0.5, shared=shared, shared_limit=0.7)
  eqns = flat_eqns(jax.make_jaxpr(call(SEGMENTS))(x, ids, w).jaxpr)
  assert "dot_general" not in {n for n, *_ in eqns}
  assert "dot_general" in {n for n, *_ in flat_eqns(jax.make_jaxpr(call(XLA_SHARED))(x, ids, w).jaxpr)}
  ref = moe_model(x, ids, w, *experts, limit=0.5, shared=shared, shared_limit=0.7)
  assert rel_err(call(SEGMENTS)(x, ids, w), ref) <= 1e-2


def outside_ops(text):
  ops = collections.Counter(re.findall(r'(?:= |")(stablehlo\.[a-z_]+)', text))
  return {k: v for k, v in ops.items() if k not in ("stablehlo.custom_call", "stablehlo.reshape", "stablehlo.constant",
                                                    "stablehlo.broadcast_in_dim")}


@pytest.mark.parametrize("t", [1, 6])
def test_demo_moe_pass_lowers_with_no_dot_outside_the_kernels(t):
  """Lowered for CUDA, the demo's MoE pass with moe_shared_segments: router_segments, up, down and, outside them,
  only the combine (the slices of y: the pairs and 3 chunks; the sum over A, the chunks' adds, the converts) and
  the residual add: none of the shared expert's 3 dots, SwiGLU, clamps and converts of the default pass (OUTSIDE)."""
  layer, args = demo_layer_pass(KernelCalls(moe_shared_segments=True), t)
  text = lower_cuda(layer, *args)
  names = re.findall(r'name = "(\w+)"', text)
  assert [n for n in names if n.startswith(("router", "moe"))] == ["router_segments", "moe_up_swiglu", "moe_down"]
  assert outside_ops(text) == {"stablehlo.slice": 4, "stablehlo.reduce": 1, "stablehlo.add": 4,
                               "stablehlo.convert": 3}, outside_ops(text)
  assert OUTSIDE["stablehlo.dot_general"] == 3  # the default pass's shared expert, for comparison
  default, _ = demo_layer_pass(KernelCalls(), t)
  assert outside_ops(lower_cuda(default, *args)) == OUTSIDE


@pytest.mark.parametrize("mode,passes", [("plain", 7), ("nextn", 12)])
def test_demo_step_loses_the_shared_experts_dots(mode, passes):
  """The shipped v2 demo's bench_step programs (plain; NEXTN5: the verify pass and the MTP's 5): with
  moe_shared_segments every MoE pass keeps its three kernels, and the step has exactly 3 x passes fewer
  dot_generals outside the kernels (the shared expert's gate, up and down per pass) and nothing else more."""
  from compile.stages import Program
  from ling_jax.config import from_hf_config
  from ling_jax.model import RuntimeOptions
  from ling_jax.weights import abstract_params

  cfg = from_hf_config(Path(__file__).resolve().parents[1] / "models" / "ling-demo")

  def step(calls):
    prog = Program(cfg, mode=mode, steps=5, max_len=8192 + 1024, opts=RuntimeOptions(kernels=calls))
    eqns = flat_eqns(jax.make_jaxpr(prog.fn())(abstract_params(cfg, jnp.bfloat16), prog.abstract_state()).jaxpr)
    return ([n for n, _, _, k in eqns if k and n.startswith(("router", "moe"))],
            collections.Counter(n for n, _, _, k in eqns if not k))

  kernels, ops = step(KernelCalls(moe_shared_segments=True))
  old_kernels, old_ops = step(KernelCalls())
  assert kernels == old_kernels == ["router_segments", "moe_up_swiglu", "moe_down"] * passes
  assert old_ops["dot_general"] - ops["dot_general"] == 3 * passes
  more = {k: ops[k] - old_ops[k] for k in ops if ops[k] > old_ops[k]}
  assert set(more) <= {"slice", "add"}, more  # the chunks' rows of y and their adds in the combine
