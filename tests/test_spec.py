"""NEXTN speculative relay: lossless greedy, planted-mismatch acceptance and committed state, no state
pollution across requests, speculative sampling's distribution, and the run-ahead dispatch order."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ling_jax.runner as runner_mod
from ling_jax.config import get_preset
from ling_jax.decode import plain_step
from ling_jax.runner import Generator
from ling_jax.sampling import SamplingOptions, sampled_verdict
from ling_jax.spec import SpecConfig, spec_step_with_drafts
from ling_jax.weights import init_params
from tests.conftest import rel_err

MAX_LEN = 320
PROMPTS = [[3, 7, 1, 9, 4], [11, 2, 2, 5, 8, 10, 6, 1, 3]]


@functools.lru_cache(maxsize=None)
def small_vocab_model(name: str, seed: int):
    """A random model with a 12-token vocabulary: a random draft then agrees with the target often enough to
    exercise partial acceptance (with 512 tokens it would reject every draft)."""
    cfg = get_preset(name).replace(vocab_size=12, eos_token_id=1, pad_token_id=0)
    return cfg, init_params(cfg, seed, jnp.float32)


@functools.lru_cache(maxsize=None)
def generator(name: str, seed: int, steps: int):
    cfg, params = small_vocab_model(name, seed)
    spec = SpecConfig("NEXTN", steps) if steps else SpecConfig("NONE")
    return Generator(cfg, params, spec=spec, max_len=MAX_LEN, chunked_prefill_size=16, dtype=jnp.float32)


# Every draft length (1, 3, 5) on test-tiny; the other presets (other widths, heads, MoE shapes) at 3 drafts, whose
# generators the later tests reuse: steps 1 and 5 there ran the same relay again at the cost of two more compiles.
@pytest.mark.parametrize("name,seed,steps", [("test-tiny", 0, 1), ("test-tiny", 0, 3), ("test-tiny", 0, 5),
                                             ("test-qlora", 1, 3), ("test-wide", 2, 3)])
def test_nextn_greedy_equals_plain_greedy_256_tokens(name, seed, steps):
    accepts = []
    for prompt in PROMPTS[(seed + steps) % 2 :][:1]:  # one prompt per case, both prompts across the cases
        plain, _ = generator(name, seed, 0).generate(prompt, max_new_tokens=256, stop_token_ids=())
        spec, stats = generator(name, seed, steps).generate(prompt, max_new_tokens=256, stop_token_ids=())
        assert spec == plain, f"first divergence at {next(i for i, (a, b) in enumerate(zip(spec, plain)) if a != b)}"
        assert len(spec) == 256 and stats.finish_reason == "length"
        accepts += stats.accept_lengths
    assert 1 <= np.mean(accepts) <= steps + 1
    assert max(accepts) > 1, "no draft was ever accepted: the test would not exercise acceptance"


def test_eos_stops_and_drops_tokens_past_it():
    gen = generator("test-tiny", 0, 3)
    full, _ = gen.generate(PROMPTS[1], max_new_tokens=64, stop_token_ids=())
    stop = full[10]
    out, stats = gen.generate(PROMPTS[1], max_new_tokens=64, stop_token_ids=(stop,))
    assert out == full[: full.index(stop) + 1] and stats.finish_reason == "stop"


# ---- (b) planted mismatch: exact acceptance and committed KDA state -----------------------------------------


@pytest.mark.parametrize("name,seed", [("test-tiny", 3), ("test-wide", 4)])
def test_planted_mismatch_accepts_exactly_j_and_commits_plain_state(name, seed):
    cfg = get_preset(name)
    params = init_params(cfg, seed, jnp.float32)
    K, prompt = 5, np.array([PROMPTS[1]], np.int32)
    sp, key = SamplingOptions().device(cfg.vocab_size), jax.random.key(0)
    kw = dict(max_len=128, chunked_prefill_size=16, dtype=jnp.float32)

    # plain greedy: the continuation and the committed state after every length
    pstate, first, _ = Generator(cfg, params, **kw).prefill(PROMPTS[1], sp, key, True)
    pstep = jax.jit(functools.partial(plain_step, cfg=cfg, is_greedy=True))
    tokens, plain_states = [int(first[0])], {int(pstate.target.lengths[0]): pstate.target}
    for _ in range(40):
        pstate, out = pstep(params, pstate)
        tokens.append(int(out.tokens[0, 0]))
        plain_states[int(pstate.target.lengths[0])] = pstate.target

    state, bonus, _ = Generator(cfg, params, spec=SpecConfig("NEXTN", K), **kw).prefill(PROMPTS[1], sp, key, True)
    step = jax.jit(functools.partial(spec_step_with_drafts, cfg=cfg, is_greedy=True))
    emitted = [int(bonus[0])]
    for j in [0, 3, 5, 1, 2, 4]:  # j = the first wrong draft (5 = all correct)
        pos = len(emitted)  # index in `tokens` of the token after the bonus
        drafts = np.array(tokens[pos : pos + K], np.int32)
        if j < K:
            drafts[j] = (drafts[j] + 1) % cfg.vocab_size
        state, out = step(params, state, jnp.asarray(drafts[None]), None, state.draft_cache)
        n_emit = int(out.n_emit[0])
        assert n_emit == j + 1, (j, n_emit)
        emitted += [int(t) for t in out.tokens[0, :n_emit]]
        assert emitted == tokens[: len(emitted)]
        L = int(state.target.lengths[0])
        assert L == prompt.shape[1] + len(emitted) - 1  # the bonus is emitted but not yet fed
        want = plain_states[L]
        # equal up to fp32 rounding (verify rows and decode rows take different matmul shapes)
        assert rel_err(state.target.kda_recurrent, want.kda_recurrent) <= 1e-5
        assert rel_err(state.target.kda_conv, want.kda_conv) <= 1e-5
        assert rel_err(state.target.mla_cache[:, :, :L], want.mla_cache[:, :, :L]) <= 1e-5
    # the on-device accept histogram counted each planted verdict once: accepted 0, 3, 5, 1, 2, 4
    assert state.accept_hist.tolist() == [1, 1, 1, 1, 1, 1]


# ---- (c) no state pollution ------------------------------------------------------------------------------------


def test_greedy_rerun_after_sampled_requests_is_identical_and_sampling_is_seeded():
    """Also the sampled relay's seeding (once its own test on test-tiny, merged here: the same Generator.generate
    path, one Generator fewer to compile): the same seed gives the same output, another seed alone changes it."""
    gen = generator("test-qlora", 1, 3)
    first, _ = gen.generate(PROMPTS[0], max_new_tokens=48, stop_token_ids=())
    sampled = [gen.generate(PROMPTS[1], max_new_tokens=40, temperature=t, top_p=p, seed=s, stop_token_ids=())[0]
               for t, p, s in [(0.8, 1.0, 1), (1.3, 0.9, 2), (0.8, 1.0, 1), (0.8, 1.0, 6)]]
    again, _ = gen.generate(PROMPTS[0], max_new_tokens=48, stop_token_ids=())
    assert again == first
    assert sampled[0] == sampled[2], "same seed, same sampled output"
    assert sampled[0] != sampled[1] and sampled[0] != sampled[3], "another seed, another sampled output"


# ---- (d) speculative sampling reproduces the target distribution -----------------------------------------------


def test_sampled_verdict_reproduces_target_distribution():
    """Rows are independent trials: d_j ~ q_j, then the verdict. The first emitted token must follow p_0 and,
    when d_1 was accepted, the second must follow p_1. With N = 200k trials each frequency has standard
    deviation <= sqrt(0.25 / N) = 0.0011; we allow 0.006 (over 5 sigma) per token."""
    V, K, N = 6, 3, 200_000
    ks = jax.random.split(jax.random.key(0), 4)
    logits = 2 * jax.random.normal(ks[0], (1, K + 1, V))
    p = jax.nn.softmax(logits, axis=-1)
    q = jax.nn.softmax(logits[:, :K] + jax.random.normal(ks[1], (1, K, V)), axis=-1)  # a draft near the target
    p, q = jnp.broadcast_to(p, (N, K + 1, V)), jnp.broadcast_to(q, (N, K, V))
    drafts = jax.random.categorical(ks[2], jnp.log(q), axis=-1).astype(jnp.int32)
    n, bonus = jax.jit(sampled_verdict)(ks[3], drafts, q, p)
    emitted = jnp.where(jnp.arange(K + 1)[None] < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
    first = np.bincount(np.asarray(emitted[:, 0]), minlength=V) / N
    assert np.max(np.abs(first - np.asarray(p[0, 0]))) < 0.006, (first, p[0, 0])
    accepted = np.asarray(n) >= 1
    second = np.bincount(np.asarray(emitted[accepted, 1]), minlength=V) / accepted.sum()
    assert accepted.sum() > N // 4
    assert np.max(np.abs(second - np.asarray(p[0, 1]))) < 0.006 * np.sqrt(N / accepted.sum())
    # and the draft is not simply ignored: acceptance happens at the rate sum_x min(p, q)
    expect = float(jnp.minimum(p[0, 0], q[0, 0]).sum())
    assert abs(accepted.mean() - expect) < 0.006


# ---- (e) run-ahead -----------------------------------------------------------------------------------------------


def test_run_ahead_dispatches_next_step_before_reading_previous(monkeypatch):
    """Step k+1 is dispatched before step k's outputs are read, and the dispatch path makes no transfer
    (the Generator dispatches under jax.transfer_guard("disallow"), so any implicit transfer would raise)."""
    gen = generator("test-tiny", 0, 3)
    gen.generate(PROMPTS[0], max_new_tokens=8, stop_token_ids=())  # compile
    events, outs = [], []  # outs keeps every step's outputs alive, so identity is unambiguous
    real_step = gen.step_fn(True)

    def step(params, state):
        state, out = real_step(params, state)
        outs.append(out)
        events.append(("dispatch", len(outs) - 1))
        return state, out

    real_get = runner_mod.jax.device_get

    def device_get(x):  # the loop reads (tokens, n_emit) of one step's output
        for k, o in enumerate(outs):
            if isinstance(x, tuple) and x and x[0] is o.tokens:
                events.append(("read", k))
        return real_get(x)

    monkeypatch.setattr(gen, "step_fn", lambda is_greedy, with_logprobs=False, adjusts_logits=True: step)
    monkeypatch.setattr(runner_mod.jax, "device_get", device_get)
    out, stats = gen.generate(PROMPTS[0], max_new_tokens=40, stop_token_ids=())
    assert len(out) == 40
    reads = [k for kind, k in events if kind == "read"]
    assert reads == list(range(stats.verify_steps)) and len(reads) >= 5
    for k in reads:
        if k + 1 < len(outs):  # every read but possibly the last: step k+1 was already dispatched
            assert events.index(("dispatch", k + 1)) < events.index(("read", k))


def test_while_loop_generation_equals_host_loop():
    """The benchmark variant (every step inside one lax.while_loop) emits the host loop's greedy tokens."""
    from ling_jax.runner import generate_on_device

    gen = generator("test-wide", 2, 3)
    host, _ = generator("test-wide", 2, 0).generate(PROMPTS[0], max_new_tokens=60, stop_token_ids=())
    state, first, _ = gen.prefill(PROMPTS[0], SamplingOptions().device(gen.cfg.vocab_size), jax.random.key(0), True)
    run = generate_on_device(gen.cfg, gen.spec, n_steps=12)
    _, buf, count = run(gen.params, state)
    emitted = [int(first[0])] + [int(t) for t in np.asarray(buf[0, : int(count[0])])]
    assert 12 <= int(count[0]) <= 48
    assert emitted == host[: len(emitted)]
