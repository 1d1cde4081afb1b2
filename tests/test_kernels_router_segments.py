"""The Triton MoE chain with the expert alignment inside the router's launch (router_segments.route_segments ->
moe.moe_segments; KernelCalls.moe_router_tables).

Oracles: the model's own functions (ling_jax.layers.moe: router_logits + route + borrow_routing for the ids and
weights, moe_layer with kernels=None for the layer), the XLA alignment the Triton MoE ran before on those ids
(moe._rows: sort + nonzero + gathers) for the tables, and the chain of before (router.route, XLA alignment,
moe.moe: KernelCalls(moe_router_tables=False)) for bitwise equality. Interpret mode on CPU. The glue count: in
the jaxpr of a MoE layer pass at the v2 demo's dims, and of every pass of the shipped demo's plain and NEXTN
steps, the primitives on the paths from the pass's router kernels to its up kernel's operands (before: ~70, the
sort, gathers, cumsums and scatter-add of the alignment; now none), and the CUDA lowering of one pass (what is
left outside the custom calls: the shared expert's XLA ops and the combine).
"""
import collections
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal, Var

from ling_jax.config import PRESETS
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.moe import borrow_routing, moe_layer, route, router_logits
from pallas_kernels import moe as M
from pallas_kernels import router as R
from pallas_kernels import router_segments as RS
from tests.cuda_lowering import S, lower_cuda
from tests.kernel_oracles import moe as moe_model

BF = jnp.bfloat16
DEMO = PRESETS["ling-demo-v2"]  # models/ling-demo: D 320, E 16 in 4 groups (keep 2), top 4, I 64, shared 192
WIDE = dataclasses.replace(DEMO, num_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4)  # Ling's structure


def route_kw(cfg):
  return dict(n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
              routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)


def pallas_names(f, *args):
  """The router and MoE kernels (pallas_call names) in f's jaxpr, in order."""
  return kernel_names(flat_eqns(jax.make_jaxpr(f)(*args).jaxpr))


def inlined_eqns(jaxpr, env=None):
  """The primitive applications of jaxpr with its jit calls inlined: [(primitive name, inputs, outputs, eqn)],
  values as fresh tokens per application (a cached jit's inner jaxpr, the same Var objects, is inlined at every
  call), literals as Literal."""
  env = {} if env is None else env
  out = []
  for eqn in jaxpr.eqns:
    ins = [env.get(v, v) if isinstance(v, Var) else v for v in eqn.invars]
    if eqn.primitive.name in ("jit", "pjit", "closed_call"):
      inner = eqn.params["jaxpr"].jaxpr
      sub = dict(zip(inner.invars, ins))
      out += inlined_eqns(inner, sub)
      env.update({o: sub.get(io, io) if isinstance(io, Var) else io for o, io in zip(eqn.outvars, inner.outvars)})
    else:
      outs = [object() for _ in eqn.outvars]
      env.update(zip(eqn.outvars, outs))
      out.append((eqn.primitive.name, ins, outs, eqn))
  return out


def flat_eqns(jaxpr):
  """jaxpr's primitive applications with its jit calls inlined (inlined_eqns): [(name, input values, output
  values, is a kernel)], a pallas_call named by its kernel, literal inputs left out."""
  return [(eqn.params["name"] if name == "pallas_call" else name, [v for v in ins if not isinstance(v, Literal)],
           outs, name == "pallas_call") for name, ins, outs, eqn in inlined_eqns(jaxpr)]


def glue_per_pass(eqns):
  """For each moe_up_swiglu call: the names of the non-kernel primitives on the paths from its own router
  launches (the router kernels since the previous up) to its operands (the walks stop at kernels)."""
  made = {v: i for i, e in enumerate(eqns) for v in e[2]}
  passes, prev = [], -1
  for up in [i for i, e in enumerate(eqns) if e[0] == "moe_up_swiglu"]:
    src = {i for i in range(prev + 1, up) if eqns[i][0].startswith("router")}
    after = set(src)
    for i in range(min(src), up):
      if not eqns[i][3] and any(made.get(v) in after for v in eqns[i][1]):
        after.add(i)
    before, todo = set(), [up]
    while todo:
      for v in eqns[todo.pop()][1]:
        if (j := made.get(v)) is not None and j not in before:
          before.add(j)
          if not eqns[j][3]:
            todo.append(j)
    passes.append(sorted(eqns[i][0] for i in (after & before) - src))
    prev = up
  return passes


def kernel_names(eqns):
  return [e[0] for e in eqns if e[3] and e[0].startswith(("router", "moe"))]


def inputs(seed, t, d, e, dtype=BF):
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (t, d), jnp.float32).astype(dtype)
  gate_w = (jax.random.normal(k[1], (e, d), jnp.float32) * d ** -0.5).astype(dtype)
  return x, gate_w, jax.random.normal(k[2], (e,), jnp.float32) * 0.05


CASES = [  # (cfg, t, live, has_shared, dtype, kernels): one launch where E == block_e (16), else scores first
    (DEMO, 18, (9, 4), True, BF, ["router_segments"]),                       # 2 sequences of 9, one padded
    (WIDE, 5, None, False, jnp.float32, ["router_scores", "router_segments"]),
]
RC = R.RouterConfig(block_e=16, block_k=64, interpret=True)
SCATTER = dataclasses.replace(RC, segments="scatter")
# the "scatter" program on the same cases, and at T = 6 (its rows past the product cut from T' = 16 to 8)
PROGRAM_CASES = [(*c, RC) for c in CASES] + [(*c, SCATTER) for c in CASES] + [
    (DEMO, 6, (2, 3), False, BF, ["router_segments"], SCATTER)]


@pytest.mark.parametrize("cfg,t,live,has_shared,dtype,kernels,rc", PROGRAM_CASES)
def test_route_segments_matches_model_routing_and_align(cfg, t, live, has_shared, dtype, kernels, rc):
  """ids equal the model's route (borrowed past each sequence's live rows), weights equal the Pallas router's
  of before bitwise (within 1e-6 of the model's: fp32 sum order of the logits); order / seg / tok / w_rows equal
  the XLA alignment of before, fed those ids. Both programs (RouterConfig.segments)."""
  x, gate_w, bias = inputs(t, t, cfg.hidden_size, cfg.num_experts, dtype)
  live_rows = None if live is None else jnp.asarray(live, jnp.int32)
  rps = 0 if live is None else t // len(live)
  seg_route = lambda x, g, b, lr: RS.route_segments(x, g, b, lr, **route_kw(cfg), has_shared=has_shared,
                                                    rows_per_seq=rps, config=rc)
  assert pallas_names(seg_route, x, gate_w, bias, live_rows) == kernels
  out = seg_route(x, gate_w, bias, live_rows)
  ids, w = route(router_logits(x, gate_w, fp32_weight=False), bias, cfg)
  old_w = R.route(x, gate_w, bias, **route_kw(cfg), config=RC)[1]
  if live is not None:
    borrow = lambda ids, w: borrow_routing(ids, w, live_rows, (len(live), rps))
    own_ids = ids
    (ids, w), old_w = borrow(ids, w), borrow(own_ids, old_w)[1]
    assert not np.array_equal(ids, own_ids)  # some rows do borrow
  np.testing.assert_array_equal(out.ids, ids)
  np.testing.assert_array_equal(out.weights, old_w)
  np.testing.assert_allclose(out.weights, w, rtol=1e-6, atol=1e-7)
  for got, want, name in zip(out[2:], M._rows(ids, old_w, M.MoeConfig(), has_shared), ("order", "seg", "tok", "w")):
    np.testing.assert_array_equal(got, want, err_msg=name)


def test_moe_segments_matches_moe_and_model():
  """The shared expert of width I as slot P of the router's tables: moe_segments equals moe on the router's ids
  (bitwise) and the model's experts (bf16, <= 1e-2); a token alone gives its row in the batch bitwise."""
  cfg, t, d, e, i = DEMO, 3, DEMO.hidden_size, DEMO.num_experts, 32
  x, gate_w, bias = inputs(7, t, d, e)
  k = jax.random.split(jax.random.key(8), 6)
  nrm = lambda kk, s, fan: (jax.random.normal(kk, s, jnp.float32) * fan ** -0.5).astype(BF)
  experts = nrm(k[0], (e, i, d), d), nrm(k[1], (e, i, d), d), nrm(k[2], (e, d, i), i)
  shared = nrm(k[3], (i, d), d), nrm(k[4], (i, d), d), nrm(k[5], (d, i), i)
  kw = dict(limit=0.5, shared=shared, shared_limit=0.7,
            config=M.MoeConfig(block_i=32, block_k=64, block_d=64, block_kd=32, interpret=True))

  def chain(x):
    r = RS.route_segments(x, gate_w, bias, **route_kw(cfg), has_shared=True, config=RC)
    return M.moe_segments(x, r.order, r.seg, r.tok, r.w_rows, *experts, **kw), r

  y, r = chain(x)
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(M.moe(x, r.ids, r.weights, *experts, **kw), np.float32))
  ref = moe_model(x, r.ids, r.weights, *experts, limit=0.5, shared=shared, shared_limit=0.7)
  err = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
  assert err <= 1e-2, err
  np.testing.assert_array_equal(np.asarray(chain(x[1:2])[0], np.float32), np.asarray(y[1:2], np.float32))


def layer_params(seed, cfg, dtype=BF):
  d, e, i, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
  k = jax.random.split(jax.random.key(seed), 8)
  nrm = lambda kk, s, fan: (jax.random.normal(kk, s, jnp.float32) * fan ** -0.5).astype(dtype)
  return dict(gate_w=nrm(k[0], (e, d), d), expert_bias=jax.random.normal(k[1], (e,), jnp.float32) * 0.05,
              w_gate=nrm(k[2], (e, i, d), d), w_up=nrm(k[3], (e, i, d), d), w_down=nrm(k[4], (e, d, i), i),
              shared=dict(gate_proj=nrm(k[5], (si, d), d), up_proj=nrm(k[6], (si, d), d),
                          down_proj=nrm(k[7], (d, si), si)))


TABLES = KernelCalls(interpret=True, moe_router_tables=True, moe_router_scatter=False)
BEFORE = KernelCalls(interpret=True, moe_router_tables=False)
TABLES_SCATTER = KernelCalls(interpret=True, moe_router_tables=True, moe_router_scatter=True)


def demo_moe_layer(dtype, t: int, live):
  """A demo MoE layer's params, an input of t rows (live: the live rows or None) and layer(kernels) -> the
  (params, x) -> (y, expert load) function with those kernels (None: the model's jnp)."""
  p = layer_params(0, DEMO, dtype)
  x = jax.random.normal(jax.random.key(1), (1, t, DEMO.hidden_size), jnp.float32).astype(dtype)
  live_rows = None if live is None else jnp.asarray(live, jnp.int32)
  kw = dict(routed_limit=0.5, shared_limit=0.7, router_fp32=False, live_rows=live_rows, return_load=True)
  return p, x, lambda kernels: lambda p, x: moe_layer(p, x, DEMO, kernels=kernels, **kw)


@pytest.mark.parametrize("dtype,t,live,tol,tables", [(BF, 6, (4,), 1e-2, TABLES), (jnp.float32, 3, None, 1e-5, TABLES),
                                                     (BF, 6, (4,), 1e-2, TABLES_SCATTER)])
def test_moe_layer_through_router_tables_matches_model(dtype, t, live, tol, tables):
  """moe_layer at the v2 demo's dims (shared width 192 != I 64: the shared expert through the model's XLA) through
  router_segments -> up -> down, vs the model's jnp moe_layer (bf16 <= 1e-2, fp32 <= 1e-5), bitwise equal to the
  chain of before, the same expert load. Both router_segments programs (KernelCalls.moe_router_scatter)."""
  p, x, layer = demo_moe_layer(dtype, t, live)
  assert pallas_names(layer(tables), p, x) == ["router_segments", "moe_up_swiglu", "moe_down"]
  assert pallas_names(layer(BEFORE), p, x) == ["router_scores", "router_topk", "moe_up_swiglu", "moe_down"]
  y, load = layer(tables)(p, x)
  ref, ref_load = layer(None)(p, x)
  old, old_load = layer(BEFORE)(p, x)
  assert y.shape == x.shape and y.dtype == dtype
  err = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
  assert err <= tol, err
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(old, np.float32))
  np.testing.assert_array_equal(load, ref_load)
  np.testing.assert_array_equal(load, old_load)


def demo_moe_params(cfg=DEMO):
  """A demo MoE layer's params (router, routed and shared experts) as abstract args."""
  d, e, i, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
  return dict(gate_w=S((e, d), BF), expert_bias=S((e,), jnp.float32), w_gate=S((e, i, d), BF),
              w_up=S((e, i, d), BF), w_down=S((e, d, i), BF),
              shared=dict(gate_proj=S((si, d), BF), up_proj=S((si, d), BF), down_proj=S((d, si), BF)))


def demo_layer_pass(kernels, t):
  """One MoE layer pass of the v2 demo as the step runs it (x -> residual + moe(x)) and its abstract args."""
  cfg = DEMO

  def layer(p, x, residual):
    return residual + moe_layer(p, x, cfg, routed_limit=4.0, shared_limit=5.0, router_fp32=False, kernels=kernels)

  x = S((1, t, cfg.hidden_size), BF)
  return layer, (demo_moe_params(cfg), x, x)


# What runs outside the custom calls of the pass now: the shared expert (3 dots, SwiGLU + clamp, converts), the
# combine (the slice of y to P rows, the sum over A) and the adds; reshapes are bitcasts.
OUTSIDE = {"stablehlo.dot_general": 3, "stablehlo.convert": 11, "stablehlo.negate": 1, "stablehlo.exponential": 1,
           "stablehlo.add": 3, "stablehlo.divide": 1, "stablehlo.multiply": 2, "stablehlo.minimum": 2,
           "stablehlo.maximum": 1, "stablehlo.slice": 1, "stablehlo.reduce": 1}


@pytest.mark.parametrize("t,scatter", [(1, False), (6, False), (17, False), (1, True), (6, True), (17, True)])
def test_demo_moe_pass_has_no_alignment_glue(t, scatter):
  """In the jaxpr of the pass, no primitive between the router and the up kernel (before: the XLA alignment),
  and no gather / scatter / sort anywhere; lowered for CUDA: router, up, down, and only the shared expert's and
  the combine's ops outside them. Both router_segments programs."""
  layer, args = demo_layer_pass(KernelCalls(moe_router_tables=True, moe_router_scatter=scatter), t)
  eqns = flat_eqns(jax.make_jaxpr(layer)(*args).jaxpr)
  assert glue_per_pass(eqns) == [[]]
  assert not {"gather", "scatter", "scatter-add", "sort"} & {e[0] for e in eqns}
  old_layer, _ = demo_layer_pass(KernelCalls(moe_router_tables=False), t)
  (before,) = glue_per_pass(flat_eqns(jax.make_jaxpr(old_layer)(*args).jaxpr))  # the XLA alignment: ~70
  assert len(before) > 50 and {"sort", "gather", "scatter-add", "cumsum"} <= set(before), before
  text = lower_cuda(layer, *args)
  names = re.findall(r'name = "(\w+)"', text)
  assert [n for n in names if n.startswith(("router", "moe"))] == ["router_segments", "moe_up_swiglu", "moe_down"]
  ops = collections.Counter(re.findall(r'(?:= |")(stablehlo\.[a-z_]+)', text))
  outside = {k: v for k, v in ops.items() if k not in ("stablehlo.custom_call", "stablehlo.reshape",
                                                        "stablehlo.constant", "stablehlo.broadcast_in_dim")}
  assert outside == OUTSIDE, outside


@pytest.mark.parametrize("segments", ["onehot", "scatter"])
def test_route_segments_lowers_for_cuda_from_scores_and_with_live_rows(segments):
  """The programs' CUDA lowering where the demo's passes do not reach: E = 64 (router_scores first, the
  program reads its scores) with live rows, and the demo's one-launch program with live rows at T = 6."""
  rc = R.RouterConfig(block_e=16, block_k=64, segments=segments)
  for cfg, t, kernels in ((WIDE, 6, ["router_scores", "router_segments"]), (DEMO, 6, ["router_segments"])):
    d, e = cfg.hidden_size, cfg.num_experts
    f = lambda x, g, b, lr: RS.route_segments(x, g, b, lr, **route_kw(cfg), has_shared=True, rows_per_seq=3, config=rc)
    text = lower_cuda(f, S((t, d), BF), S((e, d), BF), S((e,), jnp.float32), S((2,), jnp.int32))
    assert [n for n in re.findall(r'name = "(\w+)"', text) if n.startswith("router")] == kernels


@pytest.mark.parametrize("mode,passes", [("plain", 7), ("nextn", 12)])
def test_demo_step_moe_passes_have_no_alignment_glue(mode, passes):
  """The shipped v2 demo's bench_step program (compile.stages.Program at context 8192; NEXTN: the verify pass at
  T = 6 and the MTP's 5 passes): every MoE pass is router_segments -> up -> down with nothing between the router
  and up, and no sort left in the step; with moe_router_tables off, two router launches and the XLA alignment
  per pass (as the H200 HLO dump of 2026-12-02: sort, gather, scatter-add, stack per pass)."""
  from compile.stages import Program
  from ling_jax.config import from_hf_config
  from ling_jax.model import RuntimeOptions
  from ling_jax.weights import abstract_params

  cfg = from_hf_config(Path(__file__).resolve().parents[1] / "models" / "ling-demo")

  def step(calls):
    prog = Program(cfg, mode=mode, steps=5, max_len=8192 + 1024, opts=RuntimeOptions(kernels=calls))
    return flat_eqns(jax.make_jaxpr(prog.fn())(abstract_params(cfg, jnp.bfloat16), prog.abstract_state()).jaxpr)

  eqns = step(KernelCalls(moe_router_tables=True))
  assert kernel_names(eqns) == ["router_segments", "moe_up_swiglu", "moe_down"] * passes
  assert glue_per_pass(eqns) == [[]] * passes
  assert "sort" not in {e[0] for e in eqns}
  old = step(KernelCalls(moe_router_tables=False))
  assert kernel_names(old) == ["router_scores", "router_topk", "moe_up_swiglu", "moe_down"] * passes
  assert all(len(g) > 50 and "sort" in g for g in glue_per_pass(old))
