"""The demo model (models/ling-demo) with KernelCalls.mla_triton on against the same kernels with it off (interpret
mode): verify over 6 rows and a decode, logits and states, in bf16 and fp32; and NEXTN greedy equal to plain greedy
with it on. The only difference between the programs is who computes each MLA layer's absorbed attention (the
Triton attend + combine over the live prefix vs the model's jnp over every slot, XLA on CPU): bf16 logits agree to
rounding noise (the kernel's sums are f32, XLA CPU's bf16 q_lat einsum sums in bf16: tests/test_kernels_mla_triton
.py), fp32 to 1e-5. The census of calls pins that the kernel took the attention of both target MLA layers
(3 and 7) of each pass, with q_nope W_uk and the q rope in its prologue (the demo's W_uk is 80 KiB). The prompt
(270 tokens, through the jnp prefill) puts the new rows past slot 256: the combine sums 2 splits of the cache."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.config import load_config
from ling_jax.kernel_calls import KernelCalls
from ling_jax.model import RuntimeOptions, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import load_params
from tests.conftest import greedy_emissions, rel_err

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "ling-demo")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "model.safetensors.index.json")),
                                reason="models/ling-demo is not checked out")
TRACED: list = []  # (rows T, whether the Triton kernel took the call, whether it got the unrotated heads)
PROMPT, MAX_LEN = 270, 320


class Census(KernelCalls):
    """KernelCalls that records, at trace time, which MLA attention calls the Triton kernel took."""

    def mla_attention(self, q_lat, q_rope, cache, positions, kv_b, **kw):
        out = super().mla_attention(q_lat, q_rope, cache, positions, kv_b, **kw)
        TRACED.append((q_lat.shape[1], out is not None, kw.get("q_heads") is not None))
        return out


def passes(cfg, toks, opts):
    def f(params, base):
        v = forward(params, toks, base, cfg, mode="verify", opts=opts)
        d = forward(params, toks[:, :1], base, cfg, mode="decode", opts=opts)
        return (lm_logits(params, v.hidden), lm_logits(params, d.hidden), d.state.kda_recurrent, v.state.mla_cache,
                d.state.mla_cache)
    return f


NAMES = ("verify logits", "decode logits", "decode KDA state", "verify MLA cache", "decode MLA cache")


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)], ids=["bf16", "f32"])
def test_demo_logits_and_states_with_triton_mla_match_without(dtype, tol):
    cfg = load_config(MODEL)
    params = load_params(cfg, MODEL, dtype=dtype)
    toks = jax.random.randint(jax.random.key(0), (1, PROMPT + 6), 2, cfg.vocab_size)
    prefill = jax.jit(lambda p, t, s: forward(p, t, s, cfg, mode="prefill", opts=RuntimeOptions(kernels=None)))
    base = jax.block_until_ready(prefill(params, toks[:, :PROMPT], init_state(cfg, 1, MAX_LEN, dtype)).state)
    run = lambda calls: jax.block_until_ready(
        jax.jit(passes(cfg, toks[:, PROMPT:], RuntimeOptions(kernels=calls)))(params, base))
    TRACED.clear()
    on = run(Census(interpret=True, mla_triton=True))
    assert len(cfg.mla_layers) == 2
    assert sorted(TRACED) == [(1, True, True)] * 2 + [(6, True, True)] * 2, TRACED   # decode + verify, 2 layers
    TRACED.clear()
    off = run(Census(interpret=True))
    assert sorted(TRACED) == [(1, False, True)] * 2 + [(6, False, True)] * 2, TRACED  # the field off: jnp
    for name, a, b in zip(NAMES, on, off):
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    for a, b in zip(on[:2], off[:2]):  # the next token: the same greedy choice at every row
        assert (jnp.argmax(a, -1) == jnp.argmax(b, -1)).mean() >= 5 / 6, (jnp.argmax(a, -1), jnp.argmax(b, -1))


def test_nextn_greedy_equals_plain_greedy_with_triton_mla():
    """fp32 (the checkpoint upcast, as tests/test_demo_model.py's lossless test: 1-row decode and multi-row verify
    agree to rounding there), no target_rows: plain decode runs the kernel at T = 1, NEXTN (steps 3) verify at
    T = 4 and the MTP's drafts at T = 1; the tokens are plain greedy's, drafts accepted. The prompt through the jnp
    prefill (one state for both relays), then the steps with the kernel."""
    cfg = load_config(MODEL)
    params = load_params(cfg, MODEL, dtype=jnp.float32)
    opts = RuntimeOptions(kernels=KernelCalls(interpret=True, mla_triton=True))
    prompt = [int(t) for t in jax.random.randint(jax.random.key(2), (40,), 2, cfg.vocab_size)]
    emitted = greedy_emissions(cfg, params, prompt, opts, ((0, 12), (3, 4)), max_len=128, chunk=64,
                               dtype=jnp.float32)
    plain, nextn = emitted[0], emitted[3]
    assert len(plain) == 13
    assert len(nextn) > 1 + 4, "no draft was accepted: the test would not exercise acceptance"
    n = min(len(plain), len(nextn))
    assert nextn[:n] == plain[:n], (plain, nextn)
