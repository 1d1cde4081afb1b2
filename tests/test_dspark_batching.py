"""DSpark block drafting in continuous batching (ling_jax.batching over DSparkState rows): the joined step against
each row's batch-1 step (tokens, keys, per-row accept / verify-length histograms), the slots' round trips, and
requests decoded together through a BatchGenerator giving what each gives alone through the batch-1 Generator
(greedy tokens, seeded samples, logprobs), across a re-form, a put into a dead position and a compaction.

The tiny target and random block-4 draft of tests/test_dspark.py; the confidence schedule, so the rows' proposed
lengths differ from step to step and from row to row."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax import dspark
from ling_jax.batching import _END, BatchGenerator, _Row
from ling_jax.dspark_step import DSparkState, dspark_init
from ling_jax.runner import GenerationStats, Generator, count_compiles, warm_up
from ling_jax.sampling import SamplingOptions
from ling_jax.slots import cat_rows, join_rows, put_row, split_rows, take_rows
from ling_jax.spec import SpecConfig
from tests.test_batching import TurnDriver
from tests.test_dspark import draft_config, model

BLOCK = 4


@pytest.fixture(scope="module")
def gens():
    cfg, params = model()
    dcfg = draft_config(cfg, BLOCK)
    spec = SpecConfig("DSPARK", BLOCK, dspark_verify="confidence", confidence_threshold=0.3)
    gen = Generator(cfg, params, spec=spec, draft=(dcfg, dspark.init_params(dcfg, BLOCK)), max_len=128,
                    chunked_prefill_size=16, dtype=jnp.float32)
    return gen, BatchGenerator(gen, max_running=2)


def _data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _assert_same(x, y, rtol=0.0):
    assert jax.tree.structure(x) == jax.tree.structure(y)
    for u, v in zip(jax.tree.leaves(jax.tree.map(_data, x)), jax.tree.leaves(jax.tree.map(_data, y))):
        assert u.shape == v.shape and u.dtype == v.dtype
        if rtol and jnp.issubdtype(u.dtype, jnp.floating):
            np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol)
        else:
            np.testing.assert_array_equal(u, v)


def _states(n):
    """n batch-1 DSpark states of distinct contents in every leaf kind (no model run)."""
    cfg, _ = model()
    dcfg = draft_config(cfg, BLOCK)
    out = []
    for i in range(n):
        sp = SamplingOptions(temperature=0.1 * i, top_k=3 + i, logit_bias=((i, 1.0),)).device(cfg.vocab_size)
        s = dspark_init(sp, jax.random.key(i), cfg, dcfg, batch=1, slots=16, dtype=jnp.float32)
        out.append(s.replace(target=s.target.replace(lengths=s.target.lengths + i, mla_cache=s.target.mla_cache + i),
                             bonus=s.bonus + i, ctx_k=s.ctx_k + i, ctx_v=s.ctx_v - i,
                             accept_hist=s.accept_hist.at[i % (BLOCK + 1)].set(i + 1),
                             length_hist=s.length_hist.at[BLOCK - i].set(2 * i + 1),
                             history=s.history.add_output(jnp.array([[i]]), jnp.ones((1, 1), bool))))
    return out


def test_dspark_slots_round_trip_and_row_edits():
    """join_rows / split_rows, put_row, take_rows and cat_rows on DSparkState: the draft context K/V joined on its
    batch axis 1 ([Ld, B, S, Hk, Dh]), key / sampling / histograms stacked per request."""
    a, b, c, d = _states(4)
    joined = join_rows([a, b, c])
    assert isinstance(joined, DSparkState)
    assert joined.ctx_k.shape == a.ctx_k.shape[:1] + (3,) + a.ctx_k.shape[2:] and joined.key.shape == (3,)
    assert joined.accept_hist.shape == joined.length_hist.shape == (3, BLOCK + 1)
    assert joined.sampling.top_k.tolist() == [3, 4, 5] and joined.bonus.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(joined.ctx_v[:, :, 0, 0, 0], [[0.0, -1.0, -2.0]])
    for x, y in zip((a, b, c), split_rows(joined, 3)):
        _assert_same(x, y)
    _assert_same(jax.jit(put_row)(joined, np.int32(1), d), join_rows([a, d, c]))
    _assert_same(take_rows(cat_rows(join_rows([a, b]), join_rows([c, d])), np.array([3, 0, 0])), join_rows([d, a, a]))


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def test_joined_step_is_each_rows_batch1_step(gens):
    """A greedy and a sampled (penalised) request prefilled alone, joined, stepped 6 times by the 2-row sampled
    program: each row emits what its batch-1 program (greedy / sampled) emits, and ends in its batch-1 state
    (keys and per-row accept / verify-length histograms exactly, caches to fp32 rounding)."""
    gen, _ = gens
    vocab = gen.cfg.vocab_size
    requests = [([3, 7, 1, 9, 4], SamplingOptions(), 0),
                ([11, 2, 2, 5, 8, 10, 6], SamplingOptions(temperature=0.9, repetition_penalty=1.2), 5)]
    alone, emitted = [], []
    for prompt, opts, seed in requests:
        state, _, _ = gen.prefill(prompt, opts.device(vocab), jax.random.key(seed), opts.is_greedy)
        alone.append(state)
    group = join_rows([_copy(s) for s in alone])
    for i, (_, opts, _) in enumerate(requests):
        step, out = gen.step_fn(opts.is_greedy, False), []
        for _ in range(6):
            alone[i], o = step(gen.run_params, alone[i])
            out.append((np.asarray(o.tokens[0]), int(o.n_emit[0])))
        emitted.append(out)
    step = jax.jit(gen.step(False, False))
    for k in range(6):
        group, o = step(gen.run_params, group)
        for i in range(2):
            tokens, n = emitted[i][k]
            assert int(o.n_emit[i]) == n, (i, k)
            np.testing.assert_array_equal(np.asarray(o.tokens[i, :n]), tokens[:n])
    for x, y in zip(split_rows(group, 2), alone):
        _assert_same(x, y, rtol=1e-5)
    # the oracle's histograms are the batch-1 ones (summed into [G+1]); the schedule proposed fewer than G somewhere
    assert [int(h.sum()) for h in group.accept_hist] == [6, 6] and group.length_hist[:, :BLOCK].sum() > 0


def _row(prompt, max_new, top_logprobs=None, **sampling):
    seed = sampling.pop("seed", 0)
    return _Row(prompt, max_new, frozenset(), top_logprobs, SamplingOptions(**sampling), seed, GenerationStats())


def test_membership_changes_keep_every_dspark_row_exact(gens):
    """The scheduler turn by turn: greedy A decodes alone (the batch-1 state), greedy B joins (re-formed into a
    2-row group, greedy steps without logprobs) and ends, sampled C with top_logprobs is put into B's dead position
    (sampled steps with logprobs), C ends and the group is compacted back to A alone; every row's tokens are what
    it gives alone, C's logprobs too."""
    gen, bg = gens
    prompts = [[5 + i % 7 for i in range(8)], [7, 11, 3, 2, 9], [4, 8, 10, 6, 2, 1]]
    kws = [dict(max_new_tokens=70), dict(max_new_tokens=3),
           dict(max_new_tokens=6, temperature=1.0, seed=5, top_logprobs=2)]
    alone = [gen.generate(p, stop_token_ids=(), **kw) for p, kw in zip(prompts, kws)]
    a, b, c = [_row(p, kw.pop("max_new_tokens"), kw.pop("top_logprobs", None), **kw) for p, kw in zip(prompts, kws)]
    drive = TurnDriver(bg)
    turns, sizes, run_until = drive.turns, drive.sizes, drive.run_until

    turns.waiting.append(a)
    run_until(lambda: a.emitted > 1)
    assert turns.members == [a] and not turns.group.key.shape  # alone: the batch-1 state
    drive.admit(b)
    run_until(lambda: b.done)
    assert turns.members == [a, b] and not a.done and isinstance(turns.group, DSparkState)
    drive.admit(c)
    run_until(lambda: c.done)
    assert turns.members == [a, c] and not a.done  # C took B's position: put there, not re-formed
    run_until(lambda: a.done)
    assert turns.members == [a] and sizes[-1] == 1 and 2 in sizes  # compacted back to the batch-1 state
    for row, (expect, stats) in zip((a, b, c), alone):
        got = []
        while (item := row.out.get_nowait()) is not _END:
            got.extend(item)
        assert got == expect and row.stats.finish_reason == "length"
    assert len(c.stats.token_logprobs) == 6
    np.testing.assert_allclose(c.stats.token_logprobs, alone[2][1].token_logprobs, rtol=1e-5, atol=1e-5)
    assert [[t for t, _ in top] for top in c.stats.top_logprobs] == [[t for t, _ in top]
                                                                      for top in alone[2][1].top_logprobs]
    assert max(a.stats.accept_lengths) > 1  # drafts were accepted in the group


def test_concurrent_dspark_requests_match_one_at_a_time(gens):
    """After the server's warm-up (runner.warm_up, then BatchGenerator.warm_up_batches on the (target, draft)
    pair), three requests at once through max_running=2 (the third waits for a position): greedy with
    top_logprobs, seeded sampled with penalties and top_p, greedy; each gives exactly what it gives alone, and
    batching them compiles nothing."""
    gen, bg = gens
    warm_up(gen)
    bg.warm_up_batches()
    rng = np.random.default_rng(3)
    reqs = [(rng.integers(2, gen.cfg.vocab_size, int(rng.integers(3, 20))).tolist(),
             dict(max_new_tokens=int(rng.integers(8, 30)))) for _ in range(3)]
    reqs[0][1]["top_logprobs"] = 2
    reqs[1][1].update(temperature=0.8, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.2, seed=11)
    alone = [gen.generate(p, stop_token_ids=(), **kw) for p, kw in reqs]
    results = [None] * len(reqs)

    def one(i, prompt, kw):
        results[i] = bg.generate(prompt, stop_token_ids=(), **kw)

    threads = [threading.Thread(target=one, args=(i, p, kw)) for i, (p, kw) in enumerate(reqs)]
    with count_compiles() as compiled:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert compiled == [], compiled
    for (a, sa), (b, sb), (_, kw) in zip(alone, results, reqs):
        assert b == a, kw
        assert len(b) == kw["max_new_tokens"] and sb.finish_reason == "length"
    np.testing.assert_allclose(results[0][1].token_logprobs, alone[0][1].token_logprobs, rtol=1e-5, atol=1e-5)
    assert [t for t, _ in results[0][1].top_logprobs[3]] == [t for t, _ in alone[0][1].top_logprobs[3]]
