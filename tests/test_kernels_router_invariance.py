"""The router's weights do not depend on the batch a token is in, nor on the router_segments program (issue 11:
on the H200 the "scatter" program's T = 1 weights differed from "onehot"'s, its normalising sum a reduce over a
[1, AP] tile vs a [16, AP] one).

Oracles: a numpy float32 left-to-right sum of each token's picked scores (the model's topk_weight_sum, its
rounding points as ling_jax.layers.moe.route writes them) for the model's route; the model's route itself for
the kernels' weights bitwise where the logits are exact (integer-grid x and gate: every sum order gives the
same logits); the other program and the same token in a larger batch for the invariance. Interpret mode on
CPU, plus the CUDA lowering of both programs at Ling's router dims.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.extend.core import Literal

from ling_jax.config import PRESETS
from ling_jax.layers.moe import route, router_logits
from pallas_kernels import router as R
from pallas_kernels import router_segments as RS
from tests.cuda_lowering import S, lower_cuda
from tests.test_kernels_router_segments import BF, DEMO, inlined_eqns, inputs, route_kw

LING = PRESETS["ling3-flash"]  # E 512 in 8 groups (keep 4), top 8, D 2560
# Ling's router structure at a small D (the programs' selection and tables see only E, G and A; D is the matvec's)
LING_SMALL = dataclasses.replace(LING, hidden_size=128)
SMALL = dataclasses.replace(DEMO, hidden_size=128)  # the demo's router (E 16 in 4 groups, keep 2, top 4): one launch
ONEHOT = R.RouterConfig(block_e=16, block_k=64, interpret=True)  # 2 K tiles at D = 128
SCATTER = dataclasses.replace(ONEHOT, segments="scatter")


def left_to_right(s_picked, scale):
  """numpy float32: s_k / (((s_0 + s_1) + ...) + s_{A-1} + 1e-20) * scale, one IEEE rounding per op."""
  s_picked = np.asarray(s_picked, np.float32)
  total = s_picked[:, 0].copy()
  for a in range(1, s_picked.shape[1]):
    total = total + s_picked[:, a]
  return s_picked / (total + np.float32(1e-20))[:, None] * np.float32(scale)


def test_model_route_sums_the_picks_left_to_right():
  """The model's weights equal the numpy left-to-right oracle bitwise, and the oracle differs from a pairwise
  sum ((s0 + s1) + (s2 + s3)) + ... on some tokens: the test sees the order."""
  cfg = LING
  logits = 2 * jax.random.normal(jax.random.key(0), (256, cfg.num_experts), jnp.float32)
  bias = 0.05 * jax.random.normal(jax.random.key(1), (cfg.num_experts,), jnp.float32)
  ids, w = route(logits, bias, cfg)
  s = np.asarray(jax.nn.sigmoid(logits))
  picked = np.take_along_axis(s, np.asarray(ids), axis=1)
  want = left_to_right(picked, cfg.routed_scaling_factor)
  np.testing.assert_array_equal(np.asarray(w), want)
  pairs = picked.reshape(len(picked), -1, 2).sum(-1, dtype=np.float32)
  while pairs.shape[1] > 1:
    pairs = pairs.reshape(len(pairs), -1, 2).sum(-1, dtype=np.float32)
  tree = picked / (pairs[:, 0] + np.float32(1e-20))[:, None] * np.float32(cfg.routed_scaling_factor)
  assert (tree != want).any(axis=1).mean() > 0.05


def grid_inputs(seed, t, cfg):
  """x (integers in [-3, 3]) and gate_w (multiples of 1/256 below 0.1) in bf16: every product and partial sum of
  the logits is exact in fp32, so the kernels' K-tiled sums equal the model's einsum bitwise."""
  k = jax.random.split(jax.random.key(seed), 3)
  d, e = cfg.hidden_size, cfg.num_experts
  x = jnp.round(jnp.clip(1.5 * jax.random.normal(k[0], (t, d)), -3, 3)).astype(BF)
  gate_w = (jnp.round(jnp.clip(8 * jax.random.normal(k[1], (e, d)), -24, 24)) / 256).astype(BF)
  return x, gate_w, 0.05 * jax.random.normal(k[2], (e,), jnp.float32)


@pytest.mark.parametrize("cfg,t", [(SMALL, 1), (SMALL, 17), (LING_SMALL, 6)])
def test_kernel_weights_equal_the_model_route_at_exact_logits(cfg, t):
  """With the logits exact, both router_segments programs and router.route give the model's ids and weights
  bit for bit: the same sigmoid, the same rounding points, the same order of the normalising sum."""
  x, gate_w, bias = grid_inputs(t, t, cfg)
  logits = router_logits(x, gate_w, fp32_weight=False)
  np.testing.assert_array_equal(logits, x.astype(jnp.float32) @ gate_w.astype(jnp.float32).T)  # exact
  ids, w = route(logits, bias, cfg)
  outs = {rc.segments: RS.route_segments(x, gate_w, bias, **route_kw(cfg), has_shared=True, config=rc)
          for rc in (ONEHOT, SCATTER)}
  outs["route"] = R.route(x, gate_w, bias, **route_kw(cfg), config=ONEHOT)
  for name, out in outs.items():
    np.testing.assert_array_equal(out[0], ids, err_msg=name)
    np.testing.assert_array_equal(out[1], w, err_msg=name)


@pytest.mark.parametrize("cfg,tokens", [(SMALL, (1, 2, 6, 8, 17)), (LING_SMALL, (1, 6))], ids=["demo", "ling"])
def test_programs_are_bitwise_equal_and_batch_invariant(cfg, tokens):
  """At every T of `tokens`: "scatter" == "onehot" on all six outputs bitwise, and each program's ids and weights
  of the first T tokens equal those tokens' in the largest batch (so token 0 alone at decode equals token 0 in a
  verify batch of 6). T' = 16 up to T = 16, then 32; scatter's rows past the product TQ = 1, 2, 8, 8, 32. The
  demo's router: one launch (E == block_e); Ling's E = 512: router_scores, then the program."""
  x, gate_w, bias = inputs(3, max(tokens), cfg.hidden_size, cfg.num_experts)
  call = lambda t, rc: RS.route_segments(x[:t], gate_w, bias, **route_kw(cfg), has_shared=True, config=rc)
  outs = {t: {rc.segments: call(t, rc) for rc in (ONEHOT, SCATTER)} for t in tokens}
  full = outs[max(tokens)]
  for t, out in outs.items():
    for name, a, b in zip(RS.RoutedSegments._fields, out["scatter"], out["onehot"]):
      if a is not None:
        np.testing.assert_array_equal(a, b, err_msg=f"T={t} {name}")
    for prog, o in out.items():
      np.testing.assert_array_equal(o.ids, full[prog].ids[:t], err_msg=f"T={t} {prog} ids")
      np.testing.assert_array_equal(o.weights, full[prog].weights[:t], err_msg=f"T={t} {prog} weights")


def weight_divisors(f, *args):
  """For each pallas_call in f's jaxpr named router_segments / router_topk: the divisors of its f32 divisions of
  a computed numerator (the weights' normalisation; the sigmoid's 1 / (1 + exp(-z)) has a literal numerator),
  each as the left-deep add chain that makes it: [producer of the leftmost operand, of each right operand...]
  (an add whose right operand is itself an add fails: not a left-to-right chain)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call" and eqn.params["name"] in ("router_segments", "router_topk"):
        found.append(eqn.params["jaxpr"])
      for v in eqn.params.values():  # jit bodies (closed jaxprs); the kernel's own body is not walked
        if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns") and eqn.primitive.name != "pallas_call":
          walk(v.jaxpr)

  walk(jax.make_jaxpr(f)(*args).jaxpr)
  chains = []
  for body in found:
    eqns = inlined_eqns(body)
    made = {o: e for e in eqns for o in e[2]}
    name_of = lambda v: "literal" if isinstance(v, Literal) else made[v][0] if v in made else "input"

    def chain(v):
      if name_of(v) != "add":
        return [name_of(v)]
      a, b = made[v][1]
      assert name_of(b) != "add", "a sum added to a sum: not a left-to-right chain"
      return chain(a) + [name_of(b)]

    divs = [e for e in eqns if e[0] == "div" and e[3].outvars[0].aval.dtype == jnp.float32
            and not isinstance(e[1][0], Literal)]
    chains.append([chain(e[1][1]) for e in divs])
  return chains


@pytest.mark.parametrize("cfg,t", [(SMALL, 1), (SMALL, 6), (LING_SMALL, 6)])
def test_kernels_normalise_by_a_left_to_right_chain_of_the_picks(cfg, t):
  """In every router program's body (route_segments' two, router.route's per-token top-k): top_k divisions, each
  of one pick's weight by ((w_0 + w_1) + ...) + w_{A-1} + 1e-20, the w_k the picks' one-hot sums (reduce_sum,
  exact): an explicit chain of elementwise adds, no reduce over the [T', AP] weights, whose association would
  be the GPU lane layout's (before: one reduce_sum over them, then the literal)."""
  x, gate_w, bias = inputs(0, t, cfg.hidden_size, cfg.num_experts)
  want = [["reduce_sum"] * cfg.num_experts_per_tok + ["literal"]] * cfg.num_experts_per_tok
  for rc in (ONEHOT, SCATTER):
    f = lambda x, g, b: RS.route_segments(x, g, b, **route_kw(cfg), has_shared=True, config=rc)
    assert weight_divisors(f, x, gate_w, bias) == [want], rc.segments
  f = lambda x, g, b: R.route(x, g, b, **route_kw(cfg), config=ONEHOT)
  assert weight_divisors(f, x, gate_w, bias) == [want]


@pytest.mark.parametrize("segments", ["onehot", "scatter"])
def test_ling_router_programs_lower_for_cuda(segments):
  """Both programs at Ling's router dims (D 2560, E 512 in 8 groups, top 8: router_scores, then the program) lower
  for CUDA at decode (T = 1), verify (6) and past 16 rows (17), with live rows at 6."""
  rc = R.RouterConfig(segments=segments)
  e, d = LING.num_experts, LING.hidden_size
  for t, n_seq in ((1, 0), (6, 2), (17, 0)):
    f = lambda x, g, b, *lr: RS.route_segments(x, g, b, *lr, **route_kw(LING), has_shared=True,
                                               rows_per_seq=t // n_seq if n_seq else 0, config=rc)
    live = (S((n_seq,), jnp.int32),) if n_seq else ()
    text = lower_cuda(f, S((t, d), BF), S((e, d), BF), S((e,), jnp.float32), *live)
    assert [n for n in re.findall(r'name = "(\w+)"', text) if n.startswith("router")] == \
        ["router_scores", "router_segments"], t
