"""serve.engine (no model, no server): the two ways a request's chunks reach the engine give the same replies.
Batch 1: Generator.stream, consumed in an engine thread; batched: BatchGenerator.submit with the request's
Decoding as consumer, run in the scheduler's thread on each chunk, with no thread of the engine's own.
Fakes stand in for the generators and hand over fixed chunks: a stop string, a stop token id, the length limit
and a failed generator each end both the same way, after the same chunk."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from ling_jax.batching import _END
from ling_jax.tokenizer import load_tokenizer
from serve.engine import Engine, Metrics
from serve.protocol import GenRequest, ModelLimits
from tests.serve_helpers import make_model_dir

TEXT = "The quick brown fox jumps over the lazy dog."


class FakeGenerator:
    """Generator.stream: yields `chunks` (then raises `error`, if any); records how many it yielded."""

    max_running = 1

    def __init__(self, chunks, error=None):
        self.chunks, self.error, self.handed = chunks, error, 0

    def stream(self, prompt, **kw):
        for c in self.chunks:
            self.handed += 1
            yield list(c)
        if self.error is not None:
            raise self.error


class FakeBatcher(FakeGenerator):
    """BatchGenerator.submit: a scheduler thread hands `chunks` to the consumer until it closes the row (then,
    or at the end, the row's _END), as ling_jax.batching._Row.put / end do, each turn ending with `flush`. Records the threads that appeared
    besides the scheduler while it handed chunks over."""

    max_running = 2

    def submit(self, prompt, out, flush=None, **kw):
        row, before = SimpleNamespace(closed=False), set(threading.enumerate())
        self.new_threads = set()

        def scheduler():
            for c in self.chunks:  # a turn per chunk, each ending with the flush
                if row.closed:
                    break
                self.handed += 1
                if out.put(list(c)):
                    row.closed = True
                flush()
                self.new_threads |= set(threading.enumerate()) - before - {threading.current_thread()}
            if self.error is not None and not row.closed:
                out.put(self.error)
            out.put(_END)
            flush()

        threading.Thread(target=scheduler, name="fake-scheduler").start()
        return row


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_model_dir(str(tmp_path_factory.mktemp("tok"))))


def reply(tok, generator, gen: GenRequest) -> list[tuple]:
    """The outputs the engine queues for one request: (token ids, text, finished, finish reason) each."""
    limits = ModelLimits("m", 320, 512, 8, tok, (0,))

    async def run():
        engine = Engine(generator, limits, Metrics("m"), seed=0)
        engine.start()
        req = engine.submit(gen)
        outs = [await req.queue.get()]
        while not outs[-1].finished:
            outs.append(await req.queue.get())
        while engine.running:  # the running place is freed after the reply
            await asyncio.sleep(0)
        await engine.stop()
        return [(o.token_ids, o.text, o.finished, o.finish_reason) for o in outs]

    return asyncio.run(run())


def both(tok, chunks, error=None, **kw) -> tuple[list, list, FakeGenerator, FakeBatcher]:
    gen = GenRequest(input_ids=[1, 2, 3], **kw)
    one, batched = FakeGenerator(chunks, error), FakeBatcher(chunks, error)
    got = reply(tok, one, gen), reply(tok, batched, gen)
    assert not batched.new_threads, "the batched path started threads of its own"
    assert one.handed == batched.handed, "the row closed after another chunk than the stream"
    return *got, one, batched


def chunks_of(ids):
    """Steps' worth of ids, as a speculative step hands them over: 1, 3, 2, 3, 1, 3, 2, 3, ..."""
    out, i = [], 0
    while i < len(ids):
        n = (1, 3, 2, 3)[len(out) % 4]
        out.append(ids[i : i + n])
        i += n
    return out


def test_stop_string_cuts_the_same(tok):
    ids = tok.encode(TEXT)
    one, batched, g, _ = both(tok, chunks_of(ids), max_new_tokens=100, stop=("fox",))
    assert one == batched
    assert "".join(o[1] for o in one) == "The quick brown "
    assert one[-1][2:] == (True, {"type": "stop", "matched": "fox"})
    assert g.handed < len(chunks_of(ids))  # closed at the stop, not read to the end


def test_stop_token_and_length_end_the_same(tok):
    ids = tok.encode(TEXT)  # a generator's chunks end at a stop id, and at max_new_tokens
    one, batched, _, _ = both(tok, chunks_of(ids[:6]), max_new_tokens=100, stop_token_ids=(ids[5],))
    assert one == batched and one[-1][3] == {"type": "stop", "matched": ids[5]}
    assert [t for o in one for t in o[0]] == ids[:6]  # the stop id is the last output id; its text is dropped
    assert "".join(o[1] for o in one) == tok.tok.decode(ids[:5])
    one, batched, _, _ = both(tok, chunks_of(ids[:6]), max_new_tokens=6)
    assert one == batched and one[-1][3] == {"type": "length", "length": 6}
    assert [t for o in one for t in o[0]] == ids[:6]


def test_a_failed_generator_answers_the_same(tok):
    ids = tok.encode(TEXT)
    one, batched, _, _ = both(tok, chunks_of(ids[:4]), error=RuntimeError("boom"), max_new_tokens=100)
    assert one == batched
    assert one[-1][3] == {"type": "abort", "message": "internal error: boom", "status_code": 500}


def test_observe_n_records_what_n_observations_record():
    """serve.engine.observe_n (the per-token ITL in one call per chunk) against n observe calls on a twin histogram:
    the same bucket counts and count, the sum within rounding, whatever bucket the value falls in."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from serve.engine import _LATENCY_BUCKETS, observe_n

    def hist():
        r = CollectorRegistry()
        return r, Histogram("itl", "x", ["m"], registry=r, buckets=_LATENCY_BUCKETS).labels(m="m")

    (ra, a), (rb, b) = hist(), hist()
    for value, n in ((0.0003, 3), (0.0011, 1), (0.0011, 4), (0.05, 2), (70.0, 5), (0.0, 2)):
        observe_n(a, value, n)
        for _ in range(n):
            b.observe(value)
    lines = lambda r: [ln for ln in generate_latest(r).decode().splitlines() if not ln.startswith("#")
                       and "_created" not in ln]
    got, want = lines(ra), lines(rb)
    assert [ln for ln in got if "_sum" not in ln] == [ln for ln in want if "_sum" not in ln]
    assert 'itl_bucket{le="0.0005",m="m"} 5.0' in got and 'itl_bucket{le="+Inf",m="m"} 17.0' in got
    s = lambda ls: float(next(ln for ln in ls if "_sum" in ln).split()[-1])
    assert abs(s(got) - s(want)) < 1e-9
