"""The demo model (models/ling-demo, bf16) with KernelCalls.norm_linear_triton and linear_residual_triton on
against the same kernels with them off (interpret mode): verify over 6 rows and a decode, logits and states. The
only difference between the programs is who computes the projections (the Triton kernels vs the model's jnp, XLA
on CPU), so they agree to bf16 accumulation-order noise; the census of calls pins that the kernels took every
single-input normed projection of each pass: 6 KDA (w_qkvfg | b_proj), 2 MLA (q | kv_a | g_proj), layer 0's
dense gate | up (the MTP's [enorm | hnorm] eh_proj is not theirs: two inputs), and every output projection with
its residual: 6 KDA o_proj, 2 MLA dense, layer 0's down_proj."""

import os

import jax
import jax.numpy as jnp
import pytest

from ling_jax.config import load_config
from ling_jax.kernel_calls import KernelCalls
from ling_jax.model import RuntimeOptions, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import load_params
from tests.conftest import rel_err

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "ling-demo")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "model.safetensors.index.json")),
                                reason="models/ling-demo is not checked out")
TRACED: list = []  # (call, projection kinds, whether the Triton kernel took it), appended at trace time


class Census(KernelCalls):
    """KernelCalls that records which projection calls the Triton kernels took."""

    def _norm_linear_small(self, h, projections):
        out = super()._norm_linear_small(h, projections)
        TRACED.append(("norm_linear", tuple(p.kind for p in projections), out is not None))
        return out

    def _linear_residual_small(self, o, w, residual):
        out = super()._linear_residual_small(o, w, residual)
        TRACED.append(("linear_residual", ("linear",), out is not None))
        return out


def passes(cfg, toks, opts):
    def f(params, base):
        v = forward(params, toks, base, cfg, mode="verify", opts=opts)
        d = forward(params, toks[:, :1], base, cfg, mode="decode", opts=opts)
        return lm_logits(params, v.hidden), lm_logits(params, d.hidden), d.state.kda_recurrent, v.state.mla_cache
    return f


def test_demo_logits_with_triton_projections_match_without():
    cfg = load_config(MODEL)
    params = load_params(cfg, MODEL, dtype=jnp.bfloat16)
    toks = jax.random.randint(jax.random.key(0), (1, 14), 2, cfg.vocab_size)
    prefill = jax.jit(lambda p, t, s: forward(p, t, s, cfg, mode="prefill", opts=RuntimeOptions(kernels=None)))
    base = jax.block_until_ready(prefill(params, toks[:, :8], init_state(cfg, 1, 32, jnp.bfloat16)).state)
    run = lambda calls: jax.block_until_ready(
        jax.jit(passes(cfg, toks[:, 8:], RuntimeOptions(kernels=calls)))(params, base))
    TRACED.clear()
    on = run(Census(interpret=True, norm_linear_triton=True, linear_residual_triton=True))
    # per pass (verify, decode): 6 KDA + 2 MLA input projections and layer 0's dense MLP, their 9 output
    # projections, all taken
    norm = [kinds for call, kinds, took in TRACED if call == "norm_linear" and took]
    assert len(TRACED) == 2 * 18 and all(t[-1] for t in TRACED), TRACED
    assert sorted(norm[:9]) == sorted([("linear", "linear")] * 6 + [("linear", "linear", "sigmoid")] * 2
                                      + [("swiglu",)]), norm
    off = run(KernelCalls(interpret=True))
    names = ("verify logits", "decode logits", "decode KDA state", "verify MLA cache")
    for name, a, b in zip(names, on, off):
        assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))
    for a, b in zip(on[:2], off[:2]):  # the next token: the same greedy choice at every row
        assert (jnp.argmax(a, -1) == jnp.argmax(b, -1)).mean() >= 5 / 6, (jnp.argmax(a, -1), jnp.argmax(b, -1))
