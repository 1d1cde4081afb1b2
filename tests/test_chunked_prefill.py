"""Chunked prefill: one compiled program serves every prompt length (counted with jax's compile events), a
multi-chunk prefill continues like a single full forward, and the default context length follows memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.memory import bytes_per_slot, default_context_length, fixed_bytes
from ling_jax.runner import Generator, count_compiles, prefill_buckets, prefill_schedule, warm_up
from ling_jax.sampling import SamplingOptions
from ling_jax.spec import SpecConfig
from tests.test_sampling_fields import full_forward, model


@pytest.mark.parametrize("steps", [0, 3])
def test_prompt_at_the_context_limit_compiles_nothing(steps):
    cfg, params = model()
    spec = SpecConfig("NEXTN", steps) if steps else SpecConfig("NONE")
    gen = Generator(cfg, params, spec=spec, max_len=80, chunked_prefill_size=16, dtype=jnp.float32)
    with count_compiles() as warm:  # the server's warm-up: every prefill bucket and step variant, greedy and sampled
        warm_up(gen)
    assert gen.buckets == (8, 16)
    assert len(warm) >= 10, warm  # init, 2 prefill buckets, step with and without logprobs: the counter counts
    longest = gen.max_len - 2 * gen.rows_per_step - 1
    rng = np.random.default_rng(steps)
    with count_compiles() as compiled:
        for n, temperature, lp in [(longest, 0.0, None), (longest, 1.0, 2), (17, 0.0, 0), (33, 1.0, None),
                                   (3, 1.0, None), (9, 0.0, 1)]:
            out, _ = gen.generate(rng.integers(0, cfg.vocab_size, n).tolist(), max_new_tokens=gen.max_len - n - 2
                                  * gen.rows_per_step, temperature=temperature, top_k=5, repetition_penalty=1.2,
                                  stop_token_ids=(), top_logprobs=lp)
            assert len(out) == gen.max_len - n - 2 * gen.rows_per_step
    assert compiled == [], f"requests compiled {compiled}"


def test_prefill_buckets_and_schedule():
    assert prefill_buckets(512) == (32, 128, 512) and prefill_buckets(16) == (8, 16) and prefill_buckets(4) == (4,)
    b = (32, 128, 512)
    assert prefill_schedule(2, b) == [(0, 32)]
    assert prefill_schedule(33, b) == [(0, 128)]
    assert prefill_schedule(512, b) == [(0, 512)]
    assert prefill_schedule(1100, b) == [(0, 512), (512, 512), (1024, 128)]


@pytest.mark.parametrize("steps", [0, 3])
def test_multi_chunk_prefill_continues_like_one_forward(steps):
    """A 40-token prompt in chunks of 16 (the last one partial): greedy tokens and logprobs equal a single full
    forward's over prompt + output; NEXTN's draft state equals that of a one-chunk prefill."""
    cfg, params = model()
    spec = SpecConfig("NEXTN", steps) if steps else SpecConfig("NONE")
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, 40).tolist()
    chunked = Generator(cfg, params, spec=spec, max_len=96, chunked_prefill_size=16, dtype=jnp.float32)
    out, stats = chunked.generate(prompt, max_new_tokens=8, stop_token_ids=(), top_logprobs=0)
    seq = prompt + out
    logits = np.asarray(full_forward(cfg, len(seq))(params, jnp.asarray([seq], jnp.int32)))[0, len(prompt) - 1 : -1]
    assert out == list(np.argmax(logits, axis=-1))
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    np.testing.assert_allclose(stats.token_logprobs, logp[np.arange(len(out)), out], atol=2e-4)
    if steps:
        whole = Generator(cfg, params, spec=spec, max_len=96, chunked_prefill_size=64, dtype=jnp.float32)
        sp, key = SamplingOptions().device(cfg.vocab_size), jax.random.key(0)
        a, _, _ = chunked.prefill(prompt, sp, key, True)
        b, _, _ = whole.prefill(prompt, sp, key, True)
        assert int(a.seed[0]) == int(b.seed[0]) and int(a.bonus[0]) == int(b.bonus[0])
        np.testing.assert_allclose(a.draft_cache[:, :40], b.draft_cache[:, :40], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(a.draft_hidden, b.draft_hidden, rtol=1e-4, atol=1e-5)


def test_default_context_length_follows_memory():
    cfg, _ = model()
    dt, chunk = jnp.bfloat16, 16
    fixed, per_slot = fixed_bytes(cfg, dt), bytes_per_slot(cfg, dt, chunk)
    assert default_context_length(cfg, dt, chunk, device_bytes=10 * fixed + 10**12) == cfg.max_position_embeddings
    budget = int((fixed + 1000.5 * per_slot) / 0.85) + 1
    assert default_context_length(cfg, dt, chunk, device_bytes=budget) == 1000 // chunk * chunk
    with pytest.raises(ValueError, match="fewer than one prefill chunk"):
        default_context_length(cfg, dt, chunk, device_bytes=int(fixed / 0.85) + 1)
