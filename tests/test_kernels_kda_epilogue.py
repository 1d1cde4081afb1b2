"""The KDA output epilogue inside the verify kernel (KernelCalls.kda_verify_epilogue: kda_verify with o_norm runs
the model's kda_output_gate and hands o_proj its input).

Oracles: the same model with the flag off (the epilogue in XLA, ling_jax.layers.kda.kda_output_gate), for the
demo's plain decode (T = 1) and a NEXTN verify (T = 6, 4 live) after a prefill; the kernel itself against the
model's jnp is tests/test_kernels_kda.py. The kernel count: lowered for CUDA, the demo's KDA block has no rsqrt,
reduce or logistic left between verify and o_proj (o_proj reads the kernel's output), and the shipped demo's
plain and NEXTN5 step programs lose exactly the epilogue's rsqrt and logistic per KDA pass. Interpret mode on CPU.
"""
import collections
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import from_hf_config
from ling_jax.kernel_calls import KDA_EPILOGUE_MAX_HEAD, KernelCalls
from ling_jax.layers.kda import kda_verify_block
from ling_jax.model import RuntimeOptions, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import abstract_params, init_params
from tests.conftest import rel_err
from tests.cuda_lowering import S, lower_cuda
from tests.test_kernels_moe_shared_segments import outside_ops
from tests.test_kernels_router_segments import flat_eqns

BF = jnp.bfloat16
DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "ling-demo"
DEMO = from_hf_config(DEMO_DIR)  # KDA heads 5 x 64


def test_demo_decode_and_verify_with_the_epilogue_in_verify_equal_the_xla_epilogue():
  """The demo cut to its first layer group (3 KDA layers, each verify writing into the rows of the ones before,
  then MLA), bf16, after a jnp prefill of 8 tokens: plain decode and a NEXTN verify (T = 6, 4 live) give the same
  greedy tokens and logits within 1e-3 whether the verify kernel or XLA runs the epilogue; the flag
  removes the epilogue's rsqrt and logistic from both programs (3 KDA passes each)."""
  cfg = dataclasses.replace(DEMO, num_hidden_layers=4)
  assert cfg.head_dim <= KDA_EPILOGUE_MAX_HEAD and [cfg.is_mla(i) for i in range(4)] == [False] * 3 + [True]
  params = init_params(cfg, 0, BF)
  toks = jax.random.randint(jax.random.key(1), (1, 14), 0, cfg.vocab_size)
  prefill = jax.jit(lambda p, t, s: forward(p, t, s, cfg, mode="prefill").state)
  state = jax.block_until_ready(prefill(params, toks[:, :8], init_state(cfg, 1, 32, BF)))
  n_valid = jnp.array([4], jnp.int32)

  def logits(p, toks, state, folds=(True, False)):  # (one program: its shared layers compile once)
    out = []
    for fold in folds:
      opts = RuntimeOptions(kernels=KernelCalls(interpret=True, kda_verify_epilogue=fold))
      run = lambda mode, t, n: lm_logits(p, forward(p, t, state, cfg, mode=mode, n_valid=n, opts=opts).hidden)
      out.append((run("decode", toks[:, :1], None), run("verify", toks, n_valid)))
    return out

  def count(fold):
    eqns = flat_eqns(jax.make_jaxpr(lambda *a: logits(*a, folds=(fold,)))(params, toks[:, 8:], state).jaxpr)
    return collections.Counter(e[0] for e in eqns if e[0] in ("rsqrt", "logistic"))

  on, off = count(True), count(False)
  assert off["rsqrt"] - on["rsqrt"] == 6 and off["logistic"] - on["logistic"] == 6, (on, off)
  folded, xla = jax.block_until_ready(jax.jit(logits)(params, toks[:, 8:], state))
  for mode, got, want in zip(("decode", "verify"), folded, xla):
    assert np.isfinite(np.asarray(want, np.float32)).all()
    assert rel_err(got, want) <= 1e-3, (mode, rel_err(got, want))  # the interpreter: 0 (same rounding points)
    live = slice(None) if mode == "decode" else slice(0, 4)
    np.testing.assert_array_equal(np.argmax(np.asarray(got, np.float32)[:, live], -1),
                                  np.argmax(np.asarray(want, np.float32)[:, live], -1), err_msg=mode)


def demo_block(kernels, t):
  """The demo's first KDA block as the step runs it on the stacked states (its input already normed: the input
  norm is no part of the epilogue) and its abstract args."""
  p = abstract_params(DEMO, BF)["layers"][0]["attn"]
  h, k, w = DEMO.num_attention_heads, DEMO.head_dim, DEMO.short_conv_kernel_size

  def block(p, x, conv, rec, residual):
    return kda_verify_block(p, x, conv, rec, DEMO, layer=0, pending=None, kernels=kernels, residual=residual)

  x = S((1, t, DEMO.hidden_size), BF)
  return block, (p, x, S((1, 1, w - 1, 3, h * k), BF), S((1, 1, h, k, k), jnp.float32), x)


@pytest.mark.parametrize("t", [1, 6])
def test_demo_kda_block_lowers_with_no_xla_epilogue(t):
  """Lowered for CUDA: the block is the projections' dots (w_qkvfg, b_proj), kda_verify, o_proj's dot and the
  residual add, nothing else outside the kernel (no rsqrt, reduce, exp or divide), and o_proj's dot reads the
  kernel's output through free reshapes at most. With the flag off the XLA epilogue is back (the norm's reduce and
  rsqrt, the sigmoid's negate / exp / add / divide, the multiplies)."""
  block, args = demo_block(KernelCalls(kda_verify_epilogue=True), t)
  text = lower_cuda(block, *args)
  assert re.findall(r'name = "(\w+)"', text).count("kda_verify") == 1
  assert outside_ops(text) == {"stablehlo.dot_general": 3, "stablehlo.add": 1, "stablehlo.convert": 1}, \
      outside_ops(text)
  eqns = flat_eqns(jax.make_jaxpr(block)(*args).jaxpr)
  made = {v: e for e in eqns for v in e[2]}
  (verify,) = [e for e in eqns if e[0] == "kda_verify"]
  o_proj = [e for e in eqns if e[0] == "dot_general"][-1]
  src = o_proj[1][0]
  while made[src][0] == "reshape":
    src = made[src][1][0]
  assert src is verify[2][0]
  unfolded, _ = demo_block(KernelCalls(), t)
  before = outside_ops(lower_cuda(unfolded, *args))
  assert before["stablehlo.rsqrt"] == before["stablehlo.reduce"] == before["stablehlo.exponential"] == 1, before


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_demo_step_loses_the_epilogue_per_kda_pass(mode):
  """The shipped demo's bench_step programs (plain; NEXTN5: the verify pass and the MTP's): with the flag every
  kda_verify hands o_proj its output, and the step has exactly one rsqrt and one logistic fewer per kda_verify
  call (6 KDA layers a verify pass) and no other primitive more."""
  from compile.stages import Program

  def step(calls):
    prog = Program(DEMO, mode=mode, steps=5, max_len=1024, opts=RuntimeOptions(kernels=calls))
    eqns = flat_eqns(jax.make_jaxpr(prog.fn())(abstract_params(DEMO, BF), prog.abstract_state()).jaxpr)
    return sum(e[0] == "kda_verify" for e in eqns), collections.Counter(e[0] for e in eqns if not e[3])

  n, ops = step(KernelCalls(kda_verify_epilogue=True))
  n_old, old_ops = step(KernelCalls())
  assert n == n_old == 6  # the 6 KDA layers of the one verify pass (the MTP layer is MLA)
  assert old_ops["rsqrt"] - ops["rsqrt"] == n and old_ops["logistic"] - ops["logistic"] == n, (n, ops, old_ops)
  more = {k: ops[k] - old_ops[k] for k in ops if ops[k] > old_ops[k]}
  assert not more, more
