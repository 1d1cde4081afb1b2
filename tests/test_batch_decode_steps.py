"""Continuous batching with decode_steps = N > 1 (--num-continuous-decode-steps): each dispatch runs N batched
steps in one program; rows that end inside a dispatch are cut there (their later steps' tokens are dropped, never
committed). Batched greedy rows give exactly the tokens, accept lengths and finish reasons of one request at a time
through the batch-1 Generator at N = 1; a row whose EOS comes mid-dispatch stops at that token."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from compile.stages import slice_config
from ling_jax.batching import BatchGenerator
from ling_jax.config import get_preset
from ling_jax.model import Numerics, RuntimeOptions
from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig, deterministic_rows
from ling_jax.weights import init_params
from tests.test_batching import concurrently

# a 12-token vocabulary (as tests/test_continuous_steps.py): drafts are accepted often enough for accept lengths
# to vary, and EOS (id 1) comes up within a few dozen tokens; 3 layers: every layer kind
CFG = slice_config(get_preset("test-tiny"), 3).replace(vocab_size=12, eos_token_id=1, pad_token_id=0)
SPEC = SpecConfig("NEXTN", 3)


@functools.lru_cache(maxsize=None)
def params():
    return init_params(CFG, 5, jnp.float32)


@functools.lru_cache(maxsize=None)
def generator(decode_steps: int) -> Generator:
    # deterministic verify rows: a row's numbers do not depend on how many rows share the step (batch invariance)
    opts = RuntimeOptions(numerics=Numerics(target_rows=deterministic_rows(SPEC.draft_tokens)))
    return Generator(CFG, params(), spec=SPEC, max_len=128, chunked_prefill_size=16, dtype=jnp.float32, opts=opts,
                     decode_steps=decode_steps)


@functools.lru_cache(maxsize=None)
def batcher(decode_steps: int) -> BatchGenerator:
    return BatchGenerator(generator(decode_steps), max_running=2)


REQUESTS = [([3, 7, 1, 9, 4, 11, 2], dict(max_new_tokens=23)), ([5, 2, 8], dict(max_new_tokens=9)),
            ([10, 4, 4, 6, 2, 9, 3, 3, 7, 5, 8], dict(max_new_tokens=30)), ([6, 11], dict(max_new_tokens=14))]


@pytest.mark.parametrize("n", [2, 4])
def test_batched_n_steps_equal_one_at_a_time(n):
    """4 greedy requests, 2 rows at a time (joins, a row put into a dead position, compaction), max tokens that are
    not multiples of n: tokens, accept lengths (the steps past a row's end are not counted), finish reasons."""
    alone = [generator(1).generate(p, stop_token_ids=(), **kw) for p, kw in REQUESTS]
    got = concurrently(batcher(n), [(p, dict(kw, stop_token_ids=())) for p, kw in REQUESTS])
    for (a, sa), (b, sb), (_, kw) in zip(alone, got, REQUESTS):
        assert b == a and len(b) == kw["max_new_tokens"] and sb.finish_reason == "length"
        assert sb.accept_lengths == sa.accept_lengths and sb.verify_steps == sa.verify_steps
    assert max(x for _, s in got for x in s.accept_lengths) > 1  # drafts were accepted: rows advance unevenly


def _mid_dispatch_eos(n: int):
    """A request whose greedy output has EOS before the last token of its step, at a step that is not the last of
    its n-step dispatch: (prompt, its output without stops, EOS's index); found among a few prompts by the
    batch-1 N = 1 Generator."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        prompt = rng.integers(2, CFG.vocab_size, int(rng.integers(3, 12))).tolist()
        full, st = generator(1).generate(prompt, max_new_tokens=40, stop_token_ids=())
        if CFG.eos_token_id not in full[1:]:
            continue
        k = full.index(CFG.eos_token_id, 1)  # the first token (prefill's) is not a step's
        ends = np.cumsum(st.accept_lengths) + 1  # the first token is the prefill's: step s emits [ends[s-1], ends[s])
        step = int(np.searchsorted(ends, k, side="right"))  # the decode step that emitted token k
        # later steps of its dispatch ran, not in the first dispatch, and its own step emitted tokens after it
        if step % n != n - 1 and step >= n and k < ends[step] - 1:
            return prompt, full, k
    raise AssertionError("no prompt with a mid-dispatch EOS")


def test_eos_inside_a_dispatch_stops_that_row_only():
    n = 4
    prompt, full, k = _mid_dispatch_eos(n)
    other = REQUESTS[2]
    (a, sa), (b, _) = concurrently(batcher(n), [(prompt, dict(max_new_tokens=40)),  # default stops: EOS
                                            (other[0], dict(other[1], stop_token_ids=()))])
    assert a == full[: k + 1] and sa.finish_reason == "stop" and a[-1] == CFG.eos_token_id
    assert b == generator(1).generate(other[0], stop_token_ids=(), **other[1])[0]
    one, s1 = generator(1).generate(prompt, max_new_tokens=40)
    assert sa.accept_lengths == s1.accept_lengths  # counted up to the EOS step, not the dispatch's later steps
