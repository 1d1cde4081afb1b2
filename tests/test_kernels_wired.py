"""The model with its Pallas kernels (interpreter) equals the model with its jnp layers: the wiring is right."""

import jax
import jax.numpy as jnp

from ling_jax.config import get_preset
from ling_jax.kernel_calls import KernelCalls
from ling_jax.model import RuntimeOptions, commit, forward, lm_logits
from ling_jax.state import init_state
from ling_jax.weights import init_params
from tests.conftest import rel_err


def test_verify_commit_decode_with_interpreted_kernels_match_jnp():
    cfg = get_preset("test-wide")  # D 256, experts of width 32, 4 heads of 64: tiles divide
    params = init_params(cfg, 0, jnp.float32)
    toks = jax.random.randint(jax.random.key(1), (1, 14), 0, cfg.vocab_size)
    base = forward(params, toks[:, :8], init_state(cfg, 1, 64, jnp.float32), cfg, mode="prefill").state
    results = {}
    choices = {"reference": "reference", "chain": KernelCalls(interpret=True, kda_impl="chain"),
               "verify": KernelCalls(interpret=True, kda_impl="verify")}
    for name, kernels in choices.items():
        o = RuntimeOptions(kernels=kernels)
        v = forward(params, toks[:, 8:], base, cfg, mode="verify", opts=o)
        c = commit(v.state, v.pending, jnp.array([4], jnp.int32), o)
        d = forward(params, toks[:, 8:9], base, cfg, mode="decode", opts=o)
        results[name] = (lm_logits(params, v.hidden), c.kda_recurrent, c.kda_conv, lm_logits(params, d.hidden),
                          d.state.kda_recurrent, d.state.kda_conv)
    for impl in ("chain", "verify"):
        for ref, got in zip(results["reference"], results[impl]):
            assert rel_err(got, ref) <= 1e-5, impl


def test_prefill_and_fused_decode_with_interpreted_kernels_match_jnp():
    """Prefill through the Pallas chunked KDA kernel (T not a chunk multiple, padded tail) and decode through the
    fused one-kernel KDA decode equal the jnp model."""
    cfg = get_preset("test-wide")
    params = init_params(cfg, 0, jnp.float32)
    toks = jax.random.randint(jax.random.key(2), (1, 12), 0, cfg.vocab_size)
    n = jnp.array([11], jnp.int32)
    out = {}
    for name, o in (("reference", RuntimeOptions(kernels="reference")),
                    ("interpret", RuntimeOptions(kernels=KernelCalls(interpret=True, kda_impl="verify",
                                                                  kda_fused_decode=True, kda_pallas_prefill=True)))):
        p = forward(params, toks, init_state(cfg, 1, 64, jnp.float32), cfg, mode="prefill", n_valid=n, opts=o)
        d = forward(params, toks[:, 11:12], p.state, cfg, mode="decode", opts=o)
        out[name] = (lm_logits(params, p.hidden[:, :11]), p.state.kda_recurrent, lm_logits(params, d.hidden),
                     d.state.kda_recurrent, d.state.kda_conv)
    for ref, got in zip(out["reference"], out["interpret"]):
        assert rel_err(got, ref) <= 1e-5


def test_kernel_choices_that_cannot_apply_are_rejected():
    """A choice the chosen path would ignore is an error, not a silent no-op."""
    import pytest

    with pytest.raises(ValueError, match="kda_fused_decode=True needs kda_impl='verify'"):
        KernelCalls(kda_impl="chain", kda_fused_decode=True)
    with pytest.raises(ValueError, match="kda_impl='fused'"):
        KernelCalls(kda_impl="fused")
    with pytest.raises(ValueError, match="interpret=True"):
        KernelCalls(interpret=True, moe_impl="mosaic").moe_kernel(jnp.zeros((1, 8)), jnp.zeros((2, 4, 8)))
