"""The sampling fields on device (ling_jax/sampling.py) under plain decoding and NEXTN speculation: the transform
against a numpy transcription of SGLang's formulas, each field's effect, logprobs and penalised greedy tokens
against a direct full-sequence forward, speculative sampling's distribution with a transform, and greedy output
unchanged after sampled requests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile.stages import slice_config
from ling_jax.config import get_preset
from ling_jax.model import forward, lm_logits
from ling_jax.runner import Generator
from ling_jax.sampling import SamplingOptions, TokenHistory, adjust_logits, probs
from ling_jax.spec import SpecConfig, spec_init, spec_prefill_chunk, spec_step
from ling_jax.state import init_state
from ling_jax.weights import init_params

V = 12  # a small vocabulary: tokens repeat (penalties bite) and distributions are estimable
PROMPT = [3, 7, 1, 9, 4, 4, 7, 2]
PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4, logit_bias=((4, 1.5),))


@functools.lru_cache(maxsize=None)
def model():
    """test-tiny's first 3 layers (KDA + dense, KDA + MoE, MLA + MoE, then the MTP layer): every layer kind; the
    sampling fields act on the logits, whatever the depth."""
    cfg = slice_config(get_preset("test-tiny"), 3).replace(vocab_size=V, eos_token_id=1, pad_token_id=0)
    return cfg, init_params(cfg, 5, jnp.float32)


@functools.lru_cache(maxsize=None)
def generator(steps: int) -> Generator:
    cfg, params = model()
    spec = SpecConfig("NEXTN", steps) if steps else SpecConfig("NONE")
    return Generator(cfg, params, spec=spec, max_len=64, chunked_prefill_size=16, dtype=jnp.float32)


def transform_oracle(logits, prompt_ids, output_ids, *, repetition_penalty=1.0, presence_penalty=0.0,
                     frequency_penalty=0.0, logit_bias=()):
    """SGLang's penalties and logit bias, written out in numpy for one row."""
    x = np.array(logits, np.float64)
    counts = np.bincount(np.asarray(output_ids, int), minlength=len(x))
    seen = (np.bincount(np.asarray(prompt_ids, int), minlength=len(x)) > 0) | (counts > 0)
    x = np.where(seen, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    x = x - frequency_penalty * counts - presence_penalty * (counts > 0)
    for t, b in logit_bias:
        x[t] += b
    return x


def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@functools.lru_cache(maxsize=None)
def full_forward(cfg, T: int):
    """Logits of every position of one sequence in ONE prefill pass (no chunks, no decode steps): the oracle."""
    def f(params, tokens):
        out = forward(params, tokens, init_state(cfg, tokens.shape[0], T, jnp.float32), cfg, mode="prefill")
        return lm_logits(params, out.hidden)

    return jax.jit(f)


# ---- the transform itself --------------------------------------------------------------------------------------


def test_transform_matches_formula_and_filters():
    rng = np.random.default_rng(0)
    logits = 3 * rng.standard_normal((2, V)).astype(np.float32)
    prompt, output = [[1, 2, 2], [5]], [[2, 6, 6, 6], []]
    opts = SamplingOptions(**PENALTIES)
    pad = lambda rows, n: (jnp.asarray([r + [0] * (n - len(r)) for r in rows], jnp.int32),
                           jnp.asarray([[i < len(r) for i in range(n)] for r in rows]))
    h = TokenHistory.empty(2, V).add_prompt(*pad(prompt, 3)).add_output(*pad(output, 4))
    got = adjust_logits(jnp.asarray(logits), opts.device(V), h.prompt, h.output)
    want = [transform_oracle(logits[b], prompt[b], output[b], **PENALTIES) for b in range(2)]
    np.testing.assert_allclose(got, np.array(want), rtol=1e-6, atol=1e-6)

    p = np.exp(logits[0] / 0.8 - logits[0].max() / 0.8)
    p /= p.sum()
    order = np.argsort(-p)
    dist = lambda **kw: np.asarray(probs(jnp.asarray(logits[0]), SamplingOptions(temperature=0.8, **kw).device(V)))
    top3 = np.zeros(V)
    top3[order[:3]] = p[order[:3]]
    np.testing.assert_allclose(dist(top_k=3), top3 / top3.sum(), rtol=1e-5, atol=1e-7)
    kept = np.where(p >= 0.2 * p.max(), p, 0)
    np.testing.assert_allclose(dist(min_p=0.2), kept / kept.sum(), rtol=1e-5, atol=1e-7)
    n_nucleus = int(np.searchsorted(np.cumsum(p[order]), 0.5) + 1)  # smallest prefix holding mass 0.5
    assert np.count_nonzero(dist(top_p=0.5)) == n_nucleus
    # a top_p that underflows to 0 in float32 keeps the top token (greedy), not an empty distribution
    assert np.float32(1e-50) == 0
    np.testing.assert_allclose(dist(top_p=1e-50), np.eye(V)[order[0]], rtol=1e-6)


# ---- through the generator, plain and NEXTN ----------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, 3])
def test_field_effects_and_greedy_unchanged(steps):
    g = generator(steps)
    run = lambda **kw: g.generate(PROMPT, max_new_tokens=24, stop_token_ids=(), **kw)[0]
    greedy = run()
    assert run(temperature=1.0, top_k=1, seed=0) == greedy == run(temperature=1.3, top_k=1, seed=1)
    assert run(temperature=1.0, top_p=1e-50, seed=3) == greedy
    sampled = run(temperature=1.0, seed=2)
    assert sampled != greedy and run(temperature=1.0, seed=2) == sampled
    banned = max(set(greedy), key=greedy.count)
    assert banned not in run(logit_bias=((banned, -100.0),))
    assert banned not in run(temperature=1.0, seed=4, logit_bias=((banned, -100.0),))
    assert run(temperature=1.0, seed=2, top_k=3, min_p=0.05, **PENALTIES) != sampled
    assert run() == greedy, "greedy output changed after sampled requests"


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_and_penalised_tokens_match_a_direct_forward(steps, temperature):
    """Every emitted token's logprob (and top 5) equals log_softmax(transform(logits) / T) of one full forward over
    prompt + output, the transform using the output before that token; greedy tokens are its argmax."""
    cfg, params = model()
    out, stats = generator(steps).generate(PROMPT, max_new_tokens=16, stop_token_ids=(), top_logprobs=5,
                                           temperature=temperature, seed=1, **PENALTIES)
    assert len(out) == len(stats.token_logprobs) == len(stats.top_logprobs) == 16
    seq = PROMPT + out
    logits = np.asarray(full_forward(cfg, len(seq))(params, jnp.asarray([seq], jnp.int32)))[0]
    for i, tok in enumerate(out):
        adjusted = transform_oracle(logits[len(PROMPT) - 1 + i], PROMPT, out[:i], **PENALTIES)
        lp = log_softmax(adjusted / (temperature or 1.0))
        if temperature == 0:
            assert tok == int(np.argmax(adjusted)), f"token {i}"
        assert stats.token_logprobs[i] <= 0
        assert abs(stats.token_logprobs[i] - lp[tok]) < 2e-4, (i, stats.token_logprobs[i], lp[tok])
        top_ids = [t for t, _ in stats.top_logprobs[i]]
        assert top_ids == list(np.argsort(-lp, kind="stable")[:5])
        np.testing.assert_allclose([v for _, v in stats.top_logprobs[i]], lp[top_ids], atol=2e-4)
    if temperature == 0:
        plain, _ = generator(steps).generate(PROMPT, max_new_tokens=16, stop_token_ids=())
        assert plain != out, "the penalties had no effect: the test would not exercise them"


def test_speculative_sampling_with_a_transform_is_lossless():
    """B independent rows of one prompt, sampled with penalties, top_k and a bias: prefill draws the bonus b, one
    NEXTN step emits e1 (always) and e2 (when d1 was accepted). Given what precedes them, b, e1 and e2 must follow
    the transformed TARGET distribution p(. | prompt + output so far), the transform using that output; the draft
    only changes the acceptance. Pearson chi-square over every context with enough rows; tokens outside the
    top_k set never occur."""
    cfg, params = model()
    B, K, T = 4096, 3, 0.9
    fields = dict(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.3, logit_bias=((4, 1.0),))
    opts = SamplingOptions(temperature=T, top_k=8, **fields)
    state = spec_init(opts.device(V), jax.random.key(7), cfg, batch=B, slots=32, steps=K, is_greedy=False,
                      dtype=jnp.float32)
    tokens = jnp.asarray(np.tile(np.pad(PROMPT, (0, 16 - len(PROMPT))), (B, 1)), jnp.int32)
    prefill = jax.jit(functools.partial(spec_prefill_chunk, cfg=cfg, is_greedy=False))
    state, bonus, _ = prefill(params, state, tokens, jnp.zeros((B,), jnp.int32), jnp.full((B,), len(PROMPT)))
    state, step = jax.jit(functools.partial(spec_step, cfg=cfg, steps=K, is_greedy=False))(params, state)
    b, e, n_emit = np.asarray(bonus), np.asarray(step.tokens), np.asarray(step.n_emit)

    def check(contexts, observed):
        """observed[i] ~ transformed target after PROMPT + contexts[i] (contexts int [N, c])."""
        uniq, inv = np.unique(contexts, axis=0, return_inverse=True)
        seqs = np.concatenate([np.tile(PROMPT, (len(uniq), 1)), uniq], axis=1)
        logits = np.asarray(full_forward(cfg, seqs.shape[1])(params, jnp.asarray(seqs, jnp.int32)))[:, -1]
        stat, dof = 0.0, 0
        for u, ctx in enumerate(uniq):
            obs = np.bincount(observed[inv.ravel() == u], minlength=V)
            n = obs.sum()
            if n < 20:
                continue
            p = np.asarray(probs(jnp.asarray(transform_oracle(logits[u], PROMPT, list(ctx), **fields), jnp.float32),
                                 opts.device(V)), np.float64)
            assert obs[p == 0].sum() == 0, f"sampled a token outside the kept set after {ctx}"
            big = n * p >= 5  # Pearson's bins: tokens expected >= 5 times, the rest pooled
            expect, got = np.append(n * p[big], n * p[~big].sum()), np.append(obs[big], obs[~big].sum())
            used = expect > 0
            stat += float(np.sum((got[used] - expect[used]) ** 2 / expect[used]))
            dof += int(used.sum()) - 1
        assert dof >= 5, "too few contexts with enough rows"
        assert stat < dof + 6 * np.sqrt(2 * dof), (stat, dof)

    check(np.zeros((B, 0), int), b)
    check(b[:, None], e[:, 0])
    accepted = n_emit >= 2
    assert accepted.sum() > B // 5
    check(np.stack([b, e[:, 0]], axis=1)[accepted], e[accepted, 1])
