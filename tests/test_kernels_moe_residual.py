"""The MoE layer's residual add in the Triton MoE's down launch (pallas_kernels/moe.py moe_segments(residual=...),
`moe_down_residual`; KernelCalls.moe_residual_epilogue).

Oracles: the model's own jnp (ling_jax.layers.moe: moe_experts through tests/kernel_oracles.moe, rounded to the
activation dtype as moe_layer rounds it, then the residual add; moe_layer with kernels=None for the layer), fp32
<= 1e-5 and bf16 <= 1e-2 (not bitwise: the kernels keep g, u, silu(g) and each expert's product in fp32 where the
model rounds them to bf16). The rounding points bitwise: the same kernels' fused combine without the residual
(the same fp32 sum in the same order, rounded to the activation dtype) plus the model's add. Batch invariance: row
0 alone (T = 1) equals row 0 of T = 6 bitwise. The demo model with the field on vs off (logits and states), NEXTN
greedy equal to plain greedy with it on, and the kernels of the demo's MoE pass lowered for CUDA (nothing left
outside the three custom calls; at Ling-3.0-flash's dims too). Interpret mode on CPU.
"""
import collections
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.moe import moe_layer
from pallas_kernels import moe as M
from pallas_kernels import router_segments as RS
from tests.cuda_lowering import S, lower_cuda
from tests.kernel_oracles import moe as moe_model
from tests.test_kernels_moe_shared_segments import RC, experts_of
from tests.test_kernels_router_segments import DEMO, demo_moe_params, inputs, layer_params, pallas_names, route_kw

BF, F32 = jnp.bfloat16, jnp.float32
TILES = M.MoeConfig(block_i=32, block_k=64, block_d=64, block_kd=32, interpret=True)  # block_dc 16: 20 programs
MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "ling-demo")
has_demo = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "model.safetensors.index.json")),
                              reason="models/ling-demo is not checked out")


def rel_err(y, ref):
  y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def f32(a):
  return np.asarray(a, np.float32)


def demo_call(t, dtype, seed=0, n_chunks=3):
  """The demo's MoE dims (D 320, E 16 top 4, I 64, a shared expert of n_chunks x I): x [t, D], a residual, the
  router's tables and run(x, residual, config) -> moe_segments on them."""
  d, e, i = DEMO.hidden_size, DEMO.num_experts, DEMO.moe_intermediate_size
  x, gate_w, bias = inputs(21 + seed, t, d, e, dtype)
  experts, shared = experts_of(22 + seed, e, i, d, n_chunks * i, dtype)
  residual = (3 * jax.random.normal(jax.random.key(23 + seed), (t, d), F32)).astype(dtype)

  def tables(x):
    return RS.route_segments(x, gate_w, bias, **route_kw(DEMO), has_shared=True, config=RC)

  def run(x, residual=None, config=TILES):
    r = tables(x)
    return M.moe_segments(x, r.order, r.seg, r.tok, r.w_rows, *experts, limit=0.5, shared=shared, shared_limit=0.7,
                          residual=residual, config=config)

  ref = lambda x, residual: residual + moe_model(x, tables(x).ids, tables(x).weights, *experts, limit=0.5,
                                                 shared=shared, shared_limit=0.7)
  return x, residual, run, ref


@pytest.mark.parametrize("t", [1, 6, 17])
def test_moe_residual_matches_model_fp32(t):
  """fp32: residual + the MoE from the down launch vs the model's moe_experts + add, <= 1e-5."""
  x, residual, run, ref = demo_call(t, F32)
  out = run(x, residual)
  assert out.shape == (t, DEMO.hidden_size) and out.dtype == F32
  err = rel_err(out, ref(x, residual))
  assert err <= 1e-5, err
  # the MoE is a visible part of the output at this scale (a dropped slot or chunk would fail the bound)
  assert rel_err(residual, ref(x, residual)) > 100 * 1e-5


@pytest.mark.parametrize("t", [1, 6, 17])
def test_moe_residual_bf16_rounding_points(t):
  """bf16: within 1e-2 of the model (not bitwise, see the module docstring), and BITWISE equal to the model's
  rounding points applied to the kernels' own fp32 sum: round(f32(residual) + f32(round(moe))) where round(moe)
  is the fused combine's output (the same slots in the same order) and the add is the model's bf16 `x + y`."""
  x, residual, run, ref = demo_call(t, BF)
  out = run(x, residual)
  assert out.shape == (t, DEMO.hidden_size) and out.dtype == BF
  err = rel_err(out, ref(x, residual))
  assert err <= 1e-2, err
  combined = run(x, config=dataclasses.replace(TILES, fuse_combine=True))  # [T, D] bf16: round(moe)
  np.testing.assert_array_equal(f32(out), f32(residual + combined))
  # v1 (moe_down + the sum over A in XLA): the same products summed in another order, an fp32 rounding apart
  v1 = run(x)
  assert rel_err(out, residual + v1) <= 2e-3


@pytest.mark.parametrize("dtype", [F32, BF])
def test_moe_residual_is_batch_invariant(dtype):
  """Row 0 alone (T = 1) equals row 0 among 6 rows, bitwise: its slots' order depends on its own experts only."""
  x, residual, run, _ = demo_call(6, dtype, seed=3)
  np.testing.assert_array_equal(f32(run(x[:1], residual[:1])[0]), f32(run(x, residual)[0]))


def test_moe_residual_refuses_what_it_cannot_add_once():
  x, residual, run, _ = demo_call(2, BF)
  with pytest.raises(ValueError, match="combine_split"):
    run(x, residual, config=dataclasses.replace(TILES, combine_split=2))
  with pytest.raises(ValueError, match=r"must be \[T, D\]"):
    run(x, residual[:1])


# ---- the layer, through KernelCalls -------------------------------------------------------------------------------

ON = KernelCalls(interpret=True, moe_shared_segments=True, moe_residual_epilogue=True)
OFF = KernelCalls(interpret=True, moe_shared_segments=True)


def layer_fn(kernels, live=None):
  kw = dict(routed_limit=0.5, shared_limit=0.7, router_fp32=False, return_load=True,
            live_rows=None if live is None else jnp.asarray(live, jnp.int32))
  return lambda p, x, residual: moe_layer(p, x, DEMO, kernels=kernels, residual=residual, **kw)


@pytest.mark.parametrize("dtype,t,live,tol", [(BF, 1, None, 1e-2), (BF, 6, (4,), 1e-2), (F32, 6, None, 1e-5)])
def test_moe_layer_with_residual_epilogue_matches_model(dtype, t, live, tol):
  """moe_layer(residual=x) at the demo's dims: router_segments, up and moe_down_residual only, vs the model's jnp
  moe_layer + add (fp32 <= 1e-5, bf16 <= 1e-2) and the same expert load; vs the same kernels without the field
  (moe_down + the model's add) an fp32 rounding apart."""
  p = layer_params(0, DEMO, dtype)
  x = jax.random.normal(jax.random.key(1), (1, t, DEMO.hidden_size), F32).astype(dtype)
  residual = (2 * jax.random.normal(jax.random.key(2), x.shape, F32)).astype(dtype)
  assert pallas_names(layer_fn(ON, live), p, x, residual) == ["router_segments", "moe_up_swiglu", "moe_down_residual"]
  assert pallas_names(layer_fn(OFF, live), p, x, residual) == ["router_segments", "moe_up_swiglu", "moe_down"]
  y, load = layer_fn(ON, live)(p, x, residual)
  ref, ref_load = layer_fn(None, live)(p, x, residual)
  assert y.shape == x.shape and y.dtype == dtype
  err = rel_err(y, ref)
  assert err <= tol, err
  np.testing.assert_array_equal(load, ref_load)
  old, _ = layer_fn(OFF, live)(p, x, residual)
  assert rel_err(y, old) <= (1e-6 if dtype == F32 else 2e-3)


def test_moe_layer_without_the_shared_expert_in_the_kernels_adds_after():
  """A shared expert the kernels do not run (the demo's 192 without moe_shared_segments: XLA's dots after the
  MoE kernels) cannot take the add in the down launch: moe_down, then the model's add, bitwise the chain
  without the field."""
  p = layer_params(4, DEMO, BF)
  x = jax.random.normal(jax.random.key(5), (1, 6, DEMO.hidden_size), F32).astype(BF)
  on = KernelCalls(interpret=True, moe_residual_epilogue=True)
  assert pallas_names(layer_fn(on), p, x, x) == ["router_segments", "moe_up_swiglu", "moe_down"]
  np.testing.assert_array_equal(f32(layer_fn(on)(p, x, x)[0]), f32(layer_fn(KernelCalls(interpret=True))(p, x, x)[0]))


def outside_ops(text):
  ops = collections.Counter(re.findall(r'(?:= |")(stablehlo\.[a-z_]+)', text))
  return {k: v for k, v in ops.items() if k not in ("stablehlo.custom_call", "stablehlo.reshape", "stablehlo.constant",
                                                    "stablehlo.broadcast_in_dim")}


@pytest.mark.parametrize("t", [1, 6, 17])
def test_demo_moe_pass_lowers_with_nothing_outside_the_kernels(t):
  """Lowered for CUDA, the demo's MoE pass x -> x + moe(x) with the field: router_segments, up, moe_down_residual
  and no op outside them (without it: the combine's slices, the sum over A, the chunks' adds, the converts and
  the residual add)."""
  def layer(kernels):
    return lambda p, x, residual: moe_layer(p, x, DEMO, routed_limit=4.0, shared_limit=5.0, router_fp32=False,
                                            kernels=kernels, residual=residual)

  x = S((1, t, DEMO.hidden_size), BF)
  args = (demo_moe_params(), x, x)
  text = lower_cuda(layer(KernelCalls(moe_shared_segments=True, moe_residual_epilogue=True)), *args)
  names = re.findall(r'name = "(\w+)"', text)
  assert [n for n in names if n.startswith(("router", "moe"))] == ["router_segments", "moe_up_swiglu",
                                                                   "moe_down_residual"]
  assert outside_ops(text) == {}, outside_ops(text)
  before = outside_ops(lower_cuda(layer(KernelCalls(moe_shared_segments=True)), *args))
  assert before == {"stablehlo.slice": 4, "stablehlo.reduce": 1, "stablehlo.add": 4, "stablehlo.convert": 3}, before


@pytest.mark.parametrize("t", [1, 17])
def test_moe_residual_lowers_for_cuda_at_flash_dims(t):
  """Ling-3.0-flash's MoE dims (D 2560, E 512 top 8, I 768, shared width I): the residual path is one Triton
  launch after up (2 in all on the router's tables), nothing else but reshapes."""
  d, e, i, a = 2560, 512, 768, 8
  p = t * a
  args = (S((t, d), BF), S((p,), jnp.int32), S((3, p + 1), jnp.int32), S((p + t,), jnp.int32), S((p + t,), F32),
          S((e, i, d), BF), S((e, i, d), BF), S((e, d, i), BF), S((i, d), BF), S((i, d), BF), S((d, i), BF),
          S((t, d), BF))
  f = lambda x, o, sg, tk, w, wg, wu, wd, sg_, su, sd, r: M.moe_segments(
      x, o, sg, tk, w, wg, wu, wd, limit=4.0, shared=(sg_, su, sd), shared_limit=5.0, residual=r)
  text = lower_cuda(f, *args)
  assert text.count("__gpu$xla.gpu.triton") == 2
  assert [n for n in re.findall(r'name = "(\w+)"', text) if n.startswith("moe")] == ["moe_up_swiglu",
                                                                                       "moe_down_residual"]
  assert outside_ops(text) == {}, outside_ops(text)


# ---- the demo model ----------------------------------------------------------------------------------------------

@has_demo
def test_demo_model_with_the_residual_epilogue_matches_without():
  """models/ling-demo in bf16 (the kernels of the 2026-12-07 census: KDA verify epilogue, shared segments,
  router norm, the Triton projections) with moe_residual_epilogue on vs off: verify over 6 rows and a decode,
  logits and states. The programs differ only in the MoE's fp32 combine order and who adds the residual; every MoE
  pass (7 per forward) took the add. (Measured 2026-12-07 on this input: bitwise equal; the bound allows the
  order's fp32 roundings to flip a bf16 rounding somewhere.)"""
  from ling_jax.config import load_config
  from ling_jax.model import RuntimeOptions, forward, lm_logits
  from ling_jax.state import init_state
  from ling_jax.weights import load_params

  cfg = load_config(MODEL)
  params = load_params(cfg, MODEL, dtype=BF)
  toks = jax.random.randint(jax.random.key(0), (1, 14), 2, cfg.vocab_size)
  prefill = jax.jit(lambda p, t, s: forward(p, t, s, cfg, mode="prefill", opts=RuntimeOptions(kernels=None)))
  base = jax.block_until_ready(prefill(params, toks[:, :8], init_state(cfg, 1, 32, BF)).state)

  def passes(calls):
    opts = RuntimeOptions(kernels=calls)

    def f(params, base):
      v = forward(params, toks[:, 8:], base, cfg, mode="verify", opts=opts)
      d = forward(params, toks[:, 8:9], base, cfg, mode="decode", opts=opts)
      return lm_logits(params, v.hidden), lm_logits(params, d.hidden), d.state.kda_recurrent, v.state.mla_cache
    return f

  kw = dict(interpret=True, kda_verify_epilogue=True, moe_shared_segments=True, moe_router_norm=True,
            norm_linear_triton=True, linear_residual_triton=True)
  on_f, off_f = passes(KernelCalls(moe_residual_epilogue=True, **kw)), passes(KernelCalls(**kw))
  moe_kernels = lambda f: [n for n in pallas_names(f, params, base) if n.startswith("moe_down")]
  assert moe_kernels(on_f) == ["moe_down_residual"] * 14  # 7 MoE layers, verify and decode: every one took the add
  assert moe_kernels(off_f) == ["moe_down"] * 14
  on = jax.block_until_ready(jax.jit(on_f)(params, base))
  off = jax.block_until_ready(jax.jit(off_f)(params, base))

  for name, a, b in zip(("verify logits", "decode logits", "decode KDA state", "verify MLA cache"), on, off):
    assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))
  for a, b in zip(on[:2], off[:2]):  # the next token: the same greedy choice at (nearly) every row
    assert (jnp.argmax(a, -1) == jnp.argmax(b, -1)).mean() >= 5 / 6, (jnp.argmax(a, -1), jnp.argmax(b, -1))


@has_demo
@pytest.mark.parametrize("dtype", [F32, BF])
def test_demo_nextn_greedy_equals_plain_greedy_with_the_residual_epilogue(dtype):
  """models/ling-demo with moe_residual_epilogue (and moe_shared_segments, which it needs there): NEXTN (steps 3)
  emits plain greedy's tokens, drafts accepted. fp32: no target_rows, so decode runs the kernel at T = 1 and
  verify at T = 4 (the kernel's batch invariance and fp32 agreement carry it); bf16: every target pass 4 rows
  (Numerics.target_rows, the GPU's deterministic mode). The steps run with the kernels, the prompt's prefill in
  jnp."""
  from ling_jax.config import load_config
  from ling_jax.model import Numerics, RuntimeOptions
  from ling_jax.weights import load_params
  from tests.conftest import greedy_emissions

  cfg = load_config(MODEL)
  params = load_params(cfg, MODEL, dtype=dtype)
  numerics = Numerics(target_rows=4) if dtype == BF else Numerics()
  opts = RuntimeOptions(numerics=numerics, kernels=ON)
  from ling_jax.tokenizer import load_tokenizer
  prompt = load_tokenizer(MODEL).encode("    def _read_status(self):\n        line = str(self.fp.readline(")
  emitted = greedy_emissions(cfg, params, prompt, opts, ((0, 24), (3, 8)), max_len=64, chunk=16, dtype=dtype)
  plain, nextn = emitted[0], emitted[3]
  assert len(nextn) > 1 + 8 + 4, "few drafts accepted: the test would hardly exercise acceptance"
  n = min(len(plain), len(nextn))
  assert nextn[:n] == plain[:n], (plain, nextn)


def test_sharded_calls_refuse_the_residual_epilogue_and_bench_step_takes_it():
  """Under TP the MoE's partial sums are all-reduced before the add: ShardedKernelCalls rejects the field and
  kernel_calls_for turns it off on more than one device (the rest carries over). bench_step's flag reaches the
  KernelCalls and --baseline-set takes it."""
  from bench import bench_step
  from compile.sharding import ShardedKernelCalls, kernel_calls_for
  from ling_jax.model import RuntimeOptions

  with pytest.raises(ValueError, match="moe_residual_epilogue=True"):
    ShardedKernelCalls(interpret=True, mesh=jax.make_mesh((1,), ("tp",)), moe_residual_epilogue=True)
  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  sharded = kernel_calls_for(RuntimeOptions(kernels=ON), mesh).calls
  assert isinstance(sharded, ShardedKernelCalls) and not sharded.moe_residual_epilogue
  assert sharded.moe_shared_segments
  ap = bench_step.build_parser()
  a = ap.parse_args(["--model", "models/ling-demo", "--moe-residual-epilogue"])
  assert a.moe_residual_epilogue
  assert bench_step.parse_baseline_set(ap, a, "moe_residual_epilogue=0") == {"moe_residual_epilogue": False}
