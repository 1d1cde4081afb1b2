"""The post-attention RMSNorm in the router's program (router_segments.route_segments with a norm weight;
KernelCalls.moe_router_norm with moe_router_tables).

Oracles: the model's own ling_jax.layers.norms.rms_norm for the normed rows, and the chain without the norm
(route_segments fed rms_norm's rows, as KernelCalls ran it before) for the ids, weights and tables; for the model,
the same step with moe_router_norm=False (the XLA norm). Interpret mode on CPU, plus the CUDA lowering.
"""
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import from_hf_config
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.linear import Normed
from ling_jax.layers.moe import moe_layer
from ling_jax.layers.norms import rms_norm
from ling_jax.model import RuntimeOptions, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import init_params
from pallas_kernels import router_segments as RS
from tests.cuda_lowering import S, lower_cuda
from tests.test_kernels_router_segments import BF, DEMO, RC, SCATTER, demo_moe_params, flat_eqns, inputs, route_kw

EPS = 1e-6
DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "ling-demo"


def residual_rows(seed, t, dtype, w_dtype):
  """x [T, D] of the residual stream's scale (not unit rows), a norm weight around 1, the gate in xn's dtype."""
  x, gate_w, bias = inputs(seed, t, DEMO.hidden_size, DEMO.num_experts, dtype)
  w = (1 + 0.2 * jax.random.normal(jax.random.key(seed + 100), (DEMO.hidden_size,), jnp.float32)).astype(w_dtype)
  return 3 * x, gate_w.astype(jnp.result_type(w, x)), bias, w


def bits(a):
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}")


def ulps(a, b):
  """|a - b| in units of the last place of b (fp32)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return np.abs(a - b) / np.spacing(np.abs(b))


F32 = jnp.float32


@pytest.mark.parametrize("dtype,w_dtype,t,live", [(BF, BF, 1, None), (F32, F32, 6, (2, 3)), (BF, F32, 17, (13,)),
                                                  (BF, BF, 32, (8, 3, 8, 1))])  # (each T once: ~5 s per case)
def test_route_segments_norm_equals_rms_norm_then_router(dtype, w_dtype, t, live):
  """xn equals the model's rms_norm (bf16 x: bitwise, with a bf16 weight (xn bf16) and an fp32 one (xn fp32: the
  bf16-rounded normed rows times w in fp32); fp32 x: within 3 ulps, the one sum's order is not XLA's, whose CPU
  reduction of [6, 320] is a tree over 32-column windows), and ids, weights and the tables equal the chain
  without the norm fed those rows bitwise (bf16 x: rms_norm's; fp32 x: the kernel's own xn); the "scatter"
  program's seven outputs equal these bitwise."""
  x, gate_w, bias, w = residual_rows(t, t, dtype, w_dtype)
  live_rows = None if live is None else jnp.asarray(live, jnp.int32)
  kw = dict(**route_kw(DEMO), has_shared=True, rows_per_seq=0 if live is None else t // len(live), config=RC)
  out = RS.route_segments(x, gate_w, bias, live_rows, w, eps=EPS, **kw)
  xn = rms_norm(x, w, EPS)
  assert out.xn.shape == x.shape and out.xn.dtype == xn.dtype == jnp.result_type(w, x)
  if dtype == BF:
    np.testing.assert_array_equal(bits(out.xn), bits(xn))
  else:
    assert ulps(out.xn, xn).max() <= 3  # r within an ulp, then x * r and w * normed each rounded
  chain = RS.route_segments(xn if dtype == BF else out.xn, gate_w, bias, live_rows, **kw)
  assert chain.xn is None
  for name, got, want in zip(RS.RoutedSegments._fields, out[:6], chain[:6]):
    np.testing.assert_array_equal(got, want, err_msg=name)
  scatter = RS.route_segments(x, gate_w, bias, live_rows, w, eps=EPS, **{**kw, "config": SCATTER})
  for name, got, want in zip(RS.RoutedSegments._fields, scatter, out):  # the "scatter" program: the same bits
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=name)


def test_route_segments_norm_is_refused_where_the_matvec_is_not_in_the_program():
  """E = 64 (router_scores first): no norm there (the caller norms in XLA); takes_norm says so."""
  x, _, _, w = residual_rows(0, 4, BF, BF)
  gate_w = jnp.zeros((64, DEMO.hidden_size), BF)
  assert RS.takes_norm(4, DEMO.hidden_size, 16, RC) and not RS.takes_norm(4, DEMO.hidden_size, 64, RC)
  with pytest.raises(ValueError, match="no RMSNorm in the program"):
    RS.route_segments(x, gate_w, jnp.zeros((64,)), None, w, eps=EPS, n_group=8, topk_group=4, top_k=8,
                      routed_scaling_factor=1.0, has_shared=False, config=RC)


def demo_cfg(layers=2):
  """The shipped demo (models/ling-demo) cut to its first two layers: a dense KDA layer, then a MoE KDA layer."""
  return dataclasses.replace(from_hf_config(DEMO_DIR), num_hidden_layers=layers)


def test_demo_decode_and_verify_logits_bitwise_with_and_without_the_norm_in_the_router():
  """The demo's plain decode (T = 1) and a NEXTN verify (T = 6, 4 live: the padding rows borrow) with
  moe_router_tables: the same logits bitwise whether the router's program or XLA computes the MoE input norm.
  Compiled with xla_allow_excess_precision=False: by default XLA may skip the program's bf16 roundings (on CPU it
  keeps the residual stream in f32 between layers where no kernel reads it as bf16), and then the two programs
  differ by those roundings, not by the norm."""
  cfg = demo_cfg()
  params = init_params(cfg, 0, jnp.bfloat16)
  toks = jax.random.randint(jax.random.key(1), (1, 6), 0, cfg.vocab_size)
  state = init_state(cfg, 1, 16, jnp.bfloat16)
  n_valid = jnp.array([4], jnp.int32)

  def logits(p, toks, state, folds=(True, False)):  # (one program: its shared layers compile once)
    out = []
    for fold in folds:
      opts = RuntimeOptions(kernels=KernelCalls(interpret=True, moe_router_tables=True, moe_router_norm=fold))
      run = lambda mode, t, n: lm_logits(p, forward(p, t, state, cfg, mode=mode, n_valid=n, opts=opts).hidden)
      out.append((run("decode", toks[:, :1], None), run("verify", toks, n_valid)))
    return out

  rsqrts = lambda fold: sum(e[0] == "rsqrt" for e in flat_eqns(
      jax.make_jaxpr(lambda *a: logits(*a, folds=(fold,)))(params, toks, state).jaxpr))
  assert rsqrts(False) - rsqrts(True) == 2  # the MoE pass's norm, in decode and verify: in the router's kernel
  exact = {"xla_allow_excess_precision": False}
  folded, xla_norm = jax.jit(logits).lower(params, toks, state).compile(compiler_options=exact)(params, toks, state)
  for mode, got, want in zip(("decode", "verify"), folded, xla_norm):
    assert np.isfinite(np.asarray(want)).all()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=mode)


def demo_pass(kernels, t):
  """One MoE layer pass of the demo as `ffn` runs it: x -> x + moe_layer(Normed(x, post_norm)), abstract args."""
  cfg = DEMO

  def layer(p, post_norm, x):
    h = Normed(x, post_norm, cfg.rms_norm_eps)
    return x + moe_layer(p, h, cfg, routed_limit=4.0, shared_limit=5.0, router_fp32=False, kernels=kernels)

  return layer, (demo_moe_params(cfg), S((cfg.hidden_size,), BF), S((1, t, cfg.hidden_size), BF))


@pytest.mark.parametrize("t,scatter", [(6, False), (32, False), (6, True)])
def test_demo_pass_lowers_for_cuda_with_no_xla_norm(t, scatter):
  """Lowered for CUDA (the Triton lowering of the norm variant): router_segments -> up -> down, the up kernel
  and the shared expert read the router's xn output, and no rsqrt or row reduce of the norm is left outside the
  kernels; with moe_router_norm=False the norm's XLA ops are back (rsqrt; the reduce of the sum of squares)."""
  layer, args = demo_pass(KernelCalls(moe_router_tables=True, moe_router_norm=True, moe_router_scatter=scatter), t)
  text = lower_cuda(layer, *args)
  names = re.findall(r'name = "(\w+)"', text)
  assert [n for n in names if n.startswith(("router", "moe"))] == ["router_segments", "moe_up_swiglu", "moe_down"]
  assert "stablehlo.rsqrt" not in text
  eqns = flat_eqns(jax.make_jaxpr(layer)(*args).jaxpr)
  (router,) = [e for e in eqns if e[0] == "router_segments"]
  (up,) = [e for e in eqns if e[0] == "moe_up_swiglu"]
  xn = router[2][6]  # (ids, w, order, seg, tok, w_rows, xn)
  assert len(router[2]) == 7 and up[1][2] is xn  # up(seg, tok, x, ...): x is the router's xn, nothing between
  shared_dots = [e for e in eqns if e[0] == "dot_general" and e[1][0] is xn]
  assert len(shared_dots) == 2, "the shared expert's gate and up read the router's xn"
  assert "rsqrt" not in {e[0] for e in eqns}
  unfused, _ = demo_pass(KernelCalls(moe_router_tables=True, moe_router_norm=False), t)
  before = lower_cuda(unfused, *args)
  assert before.count("stablehlo.rsqrt") == 1
