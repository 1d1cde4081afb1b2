"""Continuous batching in process (ling_jax.batching): requests decoded together in slots give what each gives
alone through the batch-1 Generator (greedy tokens; seeded samples; logprobs), whatever joins or leaves."""

from __future__ import annotations

import concurrent.futures
import functools
import re
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile.stages import slice_config
from ling_jax.batching import _END, BatchGenerator, _Row, _Turns, row_buckets
from ling_jax.config import get_preset
from ling_jax.model import Numerics, RuntimeOptions
from ling_jax.runner import GenerationStats, Generator, count_compiles, warm_up
from ling_jax.sampling import SamplingOptions
from ling_jax.slots import cat_rows, join_rows, put_row, split_rows, take_rows
from ling_jax.spec import SpecConfig, deterministic_rows, spec_init
from ling_jax.weights import init_params


# test-tiny's first 3 layers (KDA + dense, KDA + MoE, MLA + MoE, then the MTP layer): every layer kind
CFG = slice_config(get_preset("test-tiny"), 3)


@functools.lru_cache(maxsize=None)
def params():
    return init_params(CFG, 0, jnp.float32)  # drawn once: every init_params call compiles its ~20 draw programs


@pytest.fixture(scope="module")
def gens():
    spec = SpecConfig("NEXTN", 3)
    opts = RuntimeOptions(numerics=Numerics(target_rows=deterministic_rows(spec.draft_tokens)))
    gen = Generator(CFG, params(), spec=spec, max_len=96, chunked_prefill_size=16, dtype=jnp.float32, opts=opts)
    # the batcher runs the batch-1 Generator's own programs for its prefills and a lone slot (as the server does);
    # a batch of 2 rows runs the row-bucket program, which the one-at-a-time oracle never compiles
    return gen, BatchGenerator(gen, max_running=2)


def concurrently(bg, requests):
    """Run each (prompt, kwargs) as its own stream in its own thread, started together; -> [(tokens, stats)]."""
    results = [None] * len(requests)

    def one(i, prompt, kw):
        results[i] = bg.generate(prompt, **kw)

    threads = [threading.Thread(target=one, args=(i, p, kw)) for i, (p, kw) in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def _concurrently(bg, requests):
    """concurrently with no stop tokens: every request runs to its max_new_tokens."""
    return concurrently(bg, [(p, dict(kw, stop_token_ids=())) for p, kw in requests])


def _requests(cfg, n, **kw):
    rng = np.random.default_rng(7)
    return [(rng.integers(2, cfg.vocab_size, int(rng.integers(3, 30))).tolist(),
             dict(max_new_tokens=int(rng.integers(5, 20)), **kw)) for _ in range(n)]


def test_buckets_and_join_split_round_trip():
    assert row_buckets(8) == (1, 2, 4, 8) and row_buckets(6) == (1, 2, 4, 6) and row_buckets(1) == (1,)
    cfg = get_preset("test-tiny")
    states = [spec_init(SamplingOptions(temperature=0.1 * i, logit_bias=((i, 1.0),)).device(cfg.vocab_size),
                        jax.random.key(i), cfg, batch=1, slots=8, steps=2, is_greedy=False, dtype=jnp.float32)
              for i in range(3)]
    states = [s.replace(target=s.target.replace(lengths=s.target.lengths + i)) for i, s in enumerate(states)]
    joined = join_rows(states)
    assert joined.target.mla_cache.shape[1] == 3 and joined.sampling.logit_bias.shape == (3, cfg.vocab_size)
    assert joined.target.lengths.tolist() == [0, 1, 2] and joined.accept_hist.shape == (3, 3)
    for a, b in zip(states, split_rows(joined, 3)):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(jax.tree.map(_data, a)), jax.tree.leaves(jax.tree.map(_data, b))):
            np.testing.assert_array_equal(x, y)


def test_group_row_edits_equal_joins_of_the_rows():
    """put_row / take_rows / cat_rows (the group's membership changes) against join_rows of the batch-1 states."""
    cfg = get_preset("test-tiny")
    states = [spec_init(SamplingOptions(temperature=0.1 * i, logit_bias=((i, 1.0),)).device(cfg.vocab_size),
                        jax.random.key(i), cfg, batch=1, slots=8, steps=2, is_greedy=False, dtype=jnp.float32)
              for i in range(4)]
    states = [s.replace(target=s.target.replace(lengths=s.target.lengths + i),
                        draft_cache=s.draft_cache + i) for i, s in enumerate(states)]
    a, b, c, d = states
    _assert_same(jax.jit(put_row)(join_rows([a, b, c]), np.int32(1), d), join_rows([a, d, c]))
    _assert_same(take_rows(cat_rows(join_rows([a, b]), join_rows([c])), np.array([2, 0, 0])), join_rows([c, a, a]))


def _assert_same(x, y):
    assert jax.tree.structure(x) == jax.tree.structure(y)
    for u, v in zip(jax.tree.leaves(jax.tree.map(_data, x)), jax.tree.leaves(jax.tree.map(_data, y))):
        assert u.shape == v.shape
        np.testing.assert_array_equal(u, v)


def _main_args(fn, *args) -> int:
    """How many buffers the lowered program's entry takes (unused arguments are pruned)."""
    text = fn.lower(*args).as_text()
    sig = text[text.index("func.func public @main("):]
    return len(set(re.findall(r"%arg\d+", sig[: sig.index("{")])))


def test_group_step_takes_one_state_whatever_the_rows(gens):
    """The group's step program takes the weights and ONE state's buffers at 1, 2 and 8 rows; the per-slot
    formulation it replaced (a tuple of batch-1 states joined inside) takes a state's buffers per row."""
    _, bg = gens
    one = bg.fresh_slot()
    counts = [_main_args(bg.batch_step_fn(1, True, False), bg.gen.params, one)]
    counts += [_main_args(bg.batch_step_fn(b, True, False), bg.gen.params, join_rows([one] * b)) for b in (2, 8)]
    assert counts[0] == counts[1] == counts[2] <= len(jax.tree.leaves((bg.gen.params, one))), counts
    step = bg.gen.step(True, False)
    per_slot = _main_args(jax.jit(lambda p, states: step(p, join_rows(states))), bg.gen.params, (one,) * 8)
    assert per_slot >= counts[2] + 7 * len(jax.tree.leaves(one)) // 2, (per_slot, counts)


def _data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def test_greedy_and_seeded_batches_match_one_at_a_time(gens):
    gen, bg = gens
    cfg = gen.cfg
    reqs = _requests(cfg, 4) + [(p, dict(kw, temperature=0.8, top_p=0.9, seed=11 + i))
                                for i, (p, kw) in enumerate(_requests(cfg, 3))]
    reqs[1][1]["top_logprobs"] = 2
    reqs[5][1].update(top_k=7, repetition_penalty=1.3, logit_bias=((5, 2.0),))
    alone = [gen.generate(p, stop_token_ids=(), **kw) for p, kw in reqs]
    together = _concurrently(bg, reqs)
    for (a, sa), (b, sb), (_, kw) in zip(alone, together, reqs):
        assert b == a, kw
        assert len(b) == kw["max_new_tokens"] and sb.finish_reason == "length"
    np.testing.assert_allclose(together[1][1].token_logprobs, alone[1][1].token_logprobs, rtol=1e-5, atol=1e-5)
    assert [t for t, _ in together[1][1].top_logprobs[0]] == [t for t, _ in alone[1][1].top_logprobs[0]]


def test_joining_leaving_and_closing_change_nothing_for_the_others(gens):
    gen, bg = gens
    long_req = _requests(gen.cfg, 1)[0]
    long_req[1]["max_new_tokens"] = 40
    expect, _ = gen.generate(long_req[0], stop_token_ids=(), **long_req[1])
    got = []
    started = threading.Event()

    def long_stream():
        for chunk in bg.stream(long_req[0], stop_token_ids=(), **long_req[1]):
            got.extend(chunk)
            started.set()

    t = threading.Thread(target=long_stream)
    t.start()
    started.wait(120)
    short = _requests(gen.cfg, 3, temperature=1.0, seed=3)
    aborted = bg.stream(short[0][0], stop_token_ids=(), **short[0][1])
    next(aborted)
    aborted.close()  # leaves mid-flight
    outs = _concurrently(bg, short[1:])
    t.join(300)
    assert got == expect
    for (p, kw), (b, _) in zip(short[1:], outs):
        assert b == gen.generate(p, stop_token_ids=(), **kw)[0]
    # nothing of the earlier requests lingers in the slots
    assert bg.generate(long_req[0], stop_token_ids=(), **long_req[1])[0] == expect


class TurnDriver:
    """The scheduler's turns driven from the test's thread: sizes holds the group's positions after each turn."""

    def __init__(self, bg: BatchGenerator):
        self.turns, self.sizes = _Turns(bg), []

    def admit(self, row: _Row):
        """Queue `row`, run the turn that admits it (its prefill goes to the stager thread; the group's turns go on
        meanwhile) and wait for the stager's chunk (compiling the start program, on a CPU, outlasts a row's 60
        tokens)."""
        self.turns.waiting.append(row)
        self.turns.turn()
        if self.turns.staged is not None:
            concurrent.futures.wait([self.turns.staged])

    def run_until(self, done):
        while not done():
            self.turns.turn()
            self.sizes.append(len(self.turns.members))


def test_group_membership_changes_keep_every_row_exact(gens):
    """The scheduler driven turn by turn: A decodes alone (the batch-1 state), B joins (re-formed into a 2-row
    group) and ends, sampled C is put into B's dead position, C ends and the group is compacted back to A alone;
    every row's tokens are what it gives alone."""
    gen, bg = gens
    prompts = [[5 + 3 * i for i in range(8)], [7, 11, 13, 2, 9], [4, 8, 15, 16, 23, 42]]
    kws = [dict(max_new_tokens=60), dict(max_new_tokens=3), dict(max_new_tokens=4, temperature=1.0, seed=5)]
    alone = [gen.generate(p, stop_token_ids=(), **kw)[0] for p, kw in zip(prompts, kws)]
    a, b, c = [_Row(p, kw["max_new_tokens"], frozenset(), None,
                    SamplingOptions(**{k: v for k, v in kw.items() if k == "temperature"}), kw.get("seed", 0),
                    GenerationStats()) for p, kw in zip(prompts, kws)]
    drive = TurnDriver(bg)
    turns, sizes, run_until = drive.turns, drive.sizes, drive.run_until

    turns.waiting.append(a)
    run_until(lambda: a.emitted > 1)
    assert turns.members == [a] and not turns.group.key.shape  # alone: the batch-1 state
    drive.admit(b)
    run_until(lambda: b.done)
    assert turns.members == [a, b] and not a.done
    drive.admit(c)
    run_until(lambda: c.done)
    assert turns.members == [a, c] and not a.done  # C took B's position: put there, not re-formed
    run_until(lambda: a.done)
    assert turns.members == [a] and sizes[-1] == 1 and 2 in sizes  # compacted back to the batch-1 state
    for row, expect in zip((a, b, c), alone):
        got = []
        while (item := row.out.get_nowait()) is not _END:
            got.extend(item)
        assert got == expect


def test_a_lone_request_starts_as_at_batch_1_and_the_next_joins_in_the_same_turn(gens, monkeypatch):
    """Two requests waiting together, the scheduler driven turn by turn. A (nothing decodes yet): its prefill is
    dispatched in the scheduler's own thread, its state written over the staging slot's buffers, and its first token
    reaches its consumer before its first step is dispatched (Generator.stream's order). In the turn A joins, B's
    first chunk already goes to the stager thread (overlapping A's step), and B joins at the next turn. Both give
    what they give alone."""
    gen, bg = gens
    (pa, ka), (pb, kb) = [(p[:12], k) for p, k in _requests(gen.cfg, 2)]  # one prefill chunk each (16)
    alone = [gen.generate(p, stop_token_ids=(), **k)[0] for p, k in ((pa, ka), (pb, kb))]
    a, b = [_Row(p, k["max_new_tokens"], frozenset(), None, SamplingOptions(), 0, GenerationStats())
            for p, k in ((pa, ka), (pb, kb))]
    drive = TurnDriver(bg)
    turns = drive.turns
    if bg.staging is None:  # an earlier test's lone group was not recycled into the slot
        bg.staging = bg.fresh_slot()
    slot = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(bg.staging)]
    threads, emitted_at_dispatch = [], []
    real_chunk, real_step_fn = bg._prefill_chunk, bg.batch_step_fn

    def chunk(*args):
        threads.append(threading.current_thread())
        return real_chunk(*args)

    def step_fn(rows, *key):
        emitted_at_dispatch.append(a.emitted)
        return real_step_fn(rows, *key)

    monkeypatch.setattr(bg, "_prefill_chunk", chunk)
    monkeypatch.setattr(bg, "batch_step_fn", step_fn)
    turns.waiting.extend([a, b])
    turns.turn()
    assert turns.members == [a] and threads[0] is threading.current_thread()
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(turns.group)] == slot  # in place of the slot
    assert emitted_at_dispatch == [1]  # A's first token was handed out before its first step's dispatch
    assert turns.prefilling is b and turns.staged is not None  # staged in A's turn, not the next one
    concurrent.futures.wait([turns.staged])
    assert threads[1] is not threading.current_thread()  # B's chunk: the stager's, while A decodes
    turns.turn()
    assert turns.members == [a, b] and turns.prefilling is None
    drive.run_until(lambda: a.done and b.done)
    for row, expect in zip((a, b), alone):
        got = []
        while (item := row.out.get_nowait()) is not _END:
            got.extend(item)
        assert got == expect


def test_a_turn_releases_the_dispatch_it_read_after_its_flush(gens):
    """A lone row driven turn by turn with a flush (the server's hand-off to its event loop): at every flush the
    device outputs of the dispatch that turn read are still alive, and they are gone once the turn returned.
    Freeing a jax Array releases the GIL, so the loop the flush woke takes the GIL there, between two dispatches,
    as at batch 1 (Generator.stream drops its read outputs after its consumer took the chunk), not inside the next
    dispatch; the tokens are what the row gives alone."""
    gen, bg = gens
    prompt = [5 + 3 * i for i in range(8)]
    alone = gen.generate(prompt, max_new_tokens=24, stop_token_ids=())[0]
    alive_at_flush = []
    row = _Row(prompt, 24, frozenset(), None, SamplingOptions(), 0, GenerationStats(),
               flush=lambda: alive_at_flush.append([r() is not None for r in refs]))
    turns, refs, read = _Turns(bg), [], 0
    turns._queue(row)
    while not row.done:
        refs = [weakref.ref(a) for a in jax.tree.leaves(turns.in_flight[0])] if turns.in_flight else []
        turns.turn()
        if refs:
            read += 1
            assert alive_at_flush[-1] == [True] * len(refs)
            assert [r() for r in refs] == [None] * len(refs)
    assert read >= 3 and len(alive_at_flush) >= read
    got = []
    while (item := row.out.get_nowait()) is not _END:
        got.extend(item)
    assert got == alone


def test_stop_token_ends_one_row(gens):
    gen, bg = gens
    prompt, kw = _requests(gen.cfg, 1)[0]
    kw["max_new_tokens"] = 30
    full, _ = gen.generate(prompt, stop_token_ids=(), **kw)
    stop = full[6]
    other = _requests(gen.cfg, 2)[1]
    (a, sa), (b, _) = _concurrently(bg, [(prompt, kw), other])  # stop_token_ids=() there: no stop
    out, st = bg.generate(prompt, stop_token_ids=(stop,), **kw)
    assert out == full[: full.index(stop) + 1] and st.finish_reason == "stop"
    assert a == full and b == gen.generate(other[0], stop_token_ids=(), **other[1])[0]


def test_plain_decoding_batches_match_one_at_a_time():
    """Without speculation (PlainState slots): 2 greedy rows (one with logprobs) and a seeded sampled row."""
    cfg = CFG
    gen = Generator(cfg, params(), max_len=64, chunked_prefill_size=16, dtype=jnp.float32)
    bg = BatchGenerator(gen, max_running=2)
    reqs = _requests(cfg, 2) + [(p, dict(k, temperature=1.0, seed=4, min_p=0.05)) for p, k in _requests(cfg, 1)]
    reqs[0][1]["top_logprobs"] = 1
    alone = [gen.generate(p, stop_token_ids=(), **k) for p, k in reqs]
    together = _concurrently(bg, reqs)
    assert [t for t, _ in together] == [a for a, _ in alone]
    np.testing.assert_allclose(together[0][1].token_logprobs, alone[0][1].token_logprobs, rtol=1e-5, atol=1e-5)


def test_a_failed_prefill_chunk_fails_its_request_and_the_next_ones_decode_exactly(gens, monkeypatch):
    """A chunk that raises (dispatched in the scheduler's thread: no row decodes) reaches the request as the error
    (the scheduler fails the rows in flight and starts over on a fresh staging slot); the next request decodes as
    it does alone."""
    gen, bg = gens
    (prompt, kw), = _requests(gen.cfg, 1)
    alone, _ = gen.generate(prompt, stop_token_ids=(), **kw)
    real = bg._prefill_chunk

    def broken(*a):
        raise FloatingPointError("a chunk that fails")

    monkeypatch.setattr(bg, "_prefill_chunk", broken)
    with pytest.raises(RuntimeError, match="batched decoding failed: a chunk that fails"):
        bg.generate(prompt, stop_token_ids=(), **kw)
    monkeypatch.setattr(bg, "_prefill_chunk", real)
    assert bg.generate(prompt, stop_token_ids=(), **kw)[0] == alone


def test_a_warmed_batcher_compiles_nothing_alone_after_alone_or_together(gens):
    """After the server's warm-up (runner.warm_up, then warm_up_batches): a lone greedy request, a lone sampled one
    after it (its prefill starts in the first one's recycled buffers), then two together (a re-form, steps of the
    2-row bucket, a compaction) compile no program, and each gives what it gives alone."""
    gen, _ = gens
    bg = BatchGenerator(gen, max_running=2)
    warm_up(gen)
    bg.warm_up_batches()
    (pa, ka), (pb, kb) = _requests(gen.cfg, 2)
    kb = dict(kb, temperature=0.9, seed=3)
    alone = [gen.generate(p, stop_token_ids=(), **k)[0] for p, k in ((pa, ka), (pb, kb))]
    with count_compiles() as compiled:
        first = bg.generate(pa, stop_token_ids=(), **ka)[0]
        second = bg.generate(pb, stop_token_ids=(), **kb)[0]
        together = [t for t, _ in _concurrently(bg, [(pa, ka), (pb, kb)])]
    assert compiled == [], compiled
    assert [first, second] == alone and together == alone
