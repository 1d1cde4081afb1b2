"""Continuous batching: up to `max_running` requests decode together, each in its own slot of device state.

Slots. A slot holds one request's whole state (KDA state, MLA and draft caches, sampling state: a batch-1
SpecState / PlainState), allocated once at start: max_running + 1 of them (the spare pads a bucket while a prefill
holds a slot), each --context-length rows (ling_jax.memory.serving_budget checks they fit). A request is prefilled
into a free slot by the batch-1 prefill programs, one chunk per scheduler turn, while the other slots keep decoding.

Steps. Each turn runs ONE step program over the slots that still decode:
  * one slot: the batch-1 step program itself, on the slot's state in place (a lone request runs exactly the
    program it ran before batching; nothing is copied);
  * b > 1 slots: the program of the smallest row bucket (2, 4, 8, ..., max_running) >= b. It joins the bucket's
    slot states into one [bucket]-row state (ling_jax.slots), runs the step and splits the rows back; the rows
    past b are free slots, their results never read. Per row: lengths, accept lengths, sampling fields, keys
    (row b draws from its own key as it would alone) and greedy-or-sampled (a batch with a sampled row runs the
    sampled program; its temperature-0 rows take the argmax and the greedy verdict there).
Trade-off of joining (vs indexing the slot rows in place inside the layers): the bucket's states are copied in and
out every step, 2 x bucket x (KDA state + caches) bytes. At ling-demo size (KDA 0.4 MB + 0.94 MB of latent caches
per 1k context, per row) that is ~40 MB per step at 8 rows x 2k context, ~10 us of H200 bandwidth against a
~1 ms step; at Ling-3.0-flash size (KDA 73 MB per row, ~46 KB of caches per position) it would dominate, and the
step should gather/scatter slot rows by index instead. Batch 1 pays nothing either way.

Host. One scheduler thread: admit -> one prefill chunk -> dispatch the step -> read the previous step's outputs
and the new rows' first tokens (one step late, as Generator.stream: the device is busy with the step just
queued) -> hand each row its tokens. EOS / stop ids / max tokens / a closed stream end a row at that read; the
step already dispatched for it runs on masked (its outputs are dropped, never committed to the request) and its
slot is free for the next prefill, whose init overwrites every leaf.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from ling_jax.runner import GenerationStats, Generator, _record_logprobs, collect
from ling_jax.sampling import SamplingOptions
from ling_jax.slots import join_rows, split_rows

log = logging.getLogger("ling_jax.batching")
_END = object()  # a row's last queue item


def row_buckets(max_running: int) -> tuple[int, ...]:
    """The compiled step batch sizes: powers of two below max_running, and max_running."""
    if max_running < 1:
        raise ValueError(f"max_running_requests must be >= 1, got {max_running}")
    return tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_running) + (max_running,)


@dataclass(eq=False)
class _Row:
    """One request as the scheduler sees it. emitted: tokens handed out; unread: dispatched outputs (its first
    token, a step) not yet read."""

    prompt: list[int]
    max_new: int
    stops: frozenset
    top_logprobs: int | None
    options: SamplingOptions
    seed: int
    stats: GenerationStats
    out: queue.Queue = field(default_factory=queue.Queue)
    t0: float = field(default_factory=time.perf_counter)
    closed: bool = False  # the consumer closed its stream
    done: bool = False
    slot: int = -1
    chunks: list = field(default_factory=list)  # prefill chunks not yet dispatched
    emitted: int = 0
    unread: int = 0

    def end(self, reason: str | None):
        if not self.done:
            self.done = True
            self.stats.finish_reason = self.stats.finish_reason or reason
            self.stats.total_s = time.perf_counter() - self.t0
            self.out.put(_END)


class BatchGenerator:
    """Generator.stream's interface over continuous batching (thread-safe: each request's stream is consumed in
    its own thread; one scheduler thread runs the device). Other attributes come from the wrapped Generator."""

    def __init__(self, gen: Generator, max_running: int):
        if gen.decode_steps != 1 or gen.spec.is_dspark:
            raise ValueError(f"continuous batching steps NEXTN or plain decoding one step per dispatch (got "
                             f"decode_steps={gen.decode_steps}, algorithm {gen.spec.algorithm})")
        self.gen, self.max_running = gen, max_running
        self.row_buckets = row_buckets(max_running)
        self.n_slots = max_running + 1
        self.inbox: queue.Queue[_Row] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self.slots = self._fresh_slots()

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def _fresh_slots(self) -> list:
        """Every slot's state, in the sampled layout (a greedy request's slot joins mixed batches too)."""
        neutral = SamplingOptions().device(self.gen.cfg.vocab_size)
        return [self.gen.init_fn(False)(neutral, jax.random.key(0)) for _ in range(self.n_slots)]

    # ---- compiled programs ----------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def reset_fn(self):
        """(old slot state, sampling, key) -> the empty state of a new request, in the old one's buffers."""
        init = self.gen.init_fn(False)
        return jax.jit(lambda old, sampling, key: init(sampling, key), donate_argnums=(0,))

    @functools.lru_cache(maxsize=None)
    def batch_step_fn(self, rows: int, is_greedy: bool, with_logprobs: bool):
        """(params, tuple of `rows` slot states) -> (the states after one step, StepOutput [rows, ...]); donated."""
        step = self.gen.step(is_greedy, with_logprobs)

        def run(params, states):
            state, out = step(params, join_rows(states))
            return split_rows(state, rows), out

        return jax.jit(run, donate_argnums=(1,))

    def warm_up_batches(self, progress=None):
        """Compile every bucket > 1 (greedy / sampled, with / without logprobs) on the free slots (before traffic:
        their results are overwritten by the next prefill)."""
        for rows in self.row_buckets[1:]:
            for is_greedy in (True, False):
                for lp in (False, True):
                    states, out = self.batch_step_fn(rows, is_greedy, lp)(self.gen.params, tuple(self.slots[:rows]))
                    self.slots[:rows] = states
                    jax.block_until_ready(out)
            if progress:
                progress()

    # ---- the consumer side ----------------------------------------------------------------------------------
    def stream(self, prompt, *, max_new_tokens: int, seed: int = 0, stop_token_ids=None,
               stats: GenerationStats | None = None, top_logprobs: int | None = None, **sampling):
        """As Generator.stream (same arguments, same chunks); the request decodes batched with the others."""
        gen = self.gen
        prompt = gen.check_inputs(prompt, max_new_tokens, top_logprobs)
        options = SamplingOptions(**sampling)
        options.device(gen.cfg.vocab_size)  # logit_bias ids checked here, in the caller's thread
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens, stats.num_steps = len(prompt), gen.K
        stops = frozenset(stop_token_ids if stop_token_ids is not None else (gen.cfg.eos_token_id,))
        row = _Row(prompt, max_new_tokens, stops, top_logprobs, options, seed, stats)
        self._ensure_scheduler()
        self.inbox.put(row)
        try:
            while (item := row.out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            row.closed = True  # the scheduler drops the row at its next turn

    def generate(self, prompt, **kw):
        return collect(self.stream, prompt, **kw)

    def _ensure_scheduler(self):
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="batch-scheduler", daemon=True)
                self._thread.start()

    # ---- the scheduler thread -------------------------------------------------------------------------------
    def _serve(self):
        turns = _Turns(self)
        while True:
            try:
                turns.turn()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving with fresh slots
                log.exception("batched decoding failed")
                for row in turns.rows():
                    row.out.put(RuntimeError(f"batched decoding failed: {e}"))
                    row.end("abort")
                turns = _Turns(self)
                self.slots = self._fresh_slots()


class _Turns:
    """The scheduler's bookkeeping; `turn` is one round of admit / prefill chunk / step / read."""

    def __init__(self, bg: BatchGenerator):
        self.bg = bg
        self.waiting: collections.deque[_Row] = collections.deque()
        self.live: dict[int, _Row] = {}  # slot -> prefilled row that has not ended
        self.prefilling: _Row | None = None
        self.firsts: list = []  # (row, first token, logprobs | None), read at the next read
        self.in_flight = None  # (host copies of the step's outputs, rows in bucket order)

    def rows(self):
        return list(self.waiting) + list(self.live.values()) + ([self.prefilling] if self.prefilling else [])

    def turn(self):
        idle = not (self.waiting or self.live or self.prefilling or self.firsts or self.in_flight)
        self._take(block=idle)
        for slot, row in list(self.live.items()):
            if row.closed:
                row.end(None)
            if row.done:
                del self.live[slot]
        self._admit()
        if self.prefilling is not None:
            self._prefill_chunk()
        dispatched = self._step()
        firsts, self.firsts = self.firsts, []
        for row, first, lp in firsts:
            self._read_first(row, first, lp)
        if self.in_flight is not None:
            self._read_step(*self.in_flight)
        self.in_flight = dispatched

    def _take(self, block: bool):
        try:
            self.waiting.append(self.bg.inbox.get(block=block))
            while True:
                self.waiting.append(self.bg.inbox.get_nowait())
        except queue.Empty:
            pass

    def _free_slots(self, busy) -> list[int]:
        return [s for s in range(self.bg.n_slots) if s not in busy]

    def _admit(self):
        bg = self.bg
        while self.prefilling is None and self.waiting and len(self.live) < bg.max_running:
            row = self.waiting.popleft()
            if row.closed:
                row.end(None)
                continue
            row.slot = self._free_slots(self.live)[0]
            sp = row.options.device(bg.gen.cfg.vocab_size)
            bg.slots[row.slot] = bg.reset_fn()(bg.slots[row.slot], sp, jax.random.key(row.seed))
            row.chunks = bg.gen.prefill_chunks(row.prompt)
            self.prefilling = row

    def _prefill_chunk(self):
        bg, row = self.bg, self.prefilling
        run = bg.gen.prefill_fn(row.options.is_greedy)
        bg.slots[row.slot], first, lp = run(bg.gen.params, bg.slots[row.slot], *row.chunks.pop(0))
        if row.chunks:
            return
        self.prefilling = None
        lp = lp if row.top_logprobs is not None else None
        for a in jax.tree.leaves((first, lp)):
            a.copy_to_host_async()
        self.firsts.append((row, first, lp))
        row.unread = 1
        self.live[row.slot] = row

    def _step(self):
        """Dispatch one step over the rows that need more tokens; returns (outputs, rows) or None."""
        bg = self.bg
        rows = [r for r in self.live.values() if not r.done and r.emitted + r.unread < r.max_new]
        if not rows:
            return None
        is_greedy = all(r.options.is_greedy for r in rows)
        with_lp = any(r.top_logprobs is not None for r in rows)
        bucket = next(b for b in bg.row_buckets if b >= len(rows))
        with jax.transfer_guard("disallow"):
            if bucket == 1:
                slot = rows[0].slot
                bg.slots[slot], out = bg.gen.step_fn(is_greedy, with_lp)(bg.gen.params, bg.slots[slot])
            else:
                busy = {r.slot for r in rows} | ({self.prefilling.slot} if self.prefilling else set())
                order = [r.slot for r in rows] + self._free_slots(busy)[: bucket - len(rows)]
                states, out = bg.batch_step_fn(bucket, is_greedy, with_lp)(bg.gen.params,
                                                                           tuple(bg.slots[s] for s in order))
                for s, state in zip(order, states):
                    bg.slots[s] = state
        out = (out.tokens, out.n_emit) + ((out.logprobs,) if with_lp else ())
        for a in jax.tree.leaves(out):
            a.copy_to_host_async()
        for r in rows:
            r.unread += 1
        return out, rows

    def _read_first(self, row: _Row, first, lp):
        first, lp = jax.device_get((first, lp))
        row.unread -= 1
        if row.done:
            return
        st = row.stats
        first = int(first[0])
        if lp is not None:
            _record_logprobs(st, jax.tree.map(lambda a: a[:, None], lp), 1, row.top_logprobs)
        st.ttft_s = time.perf_counter() - row.t0
        row.emitted = st.completion_tokens = 1
        row.out.put([first])
        if first in row.stops:
            row.end("stop")
        elif row.max_new == 1:
            row.end("length")

    def _read_step(self, out, rows):
        tokens, n_emit, *lp = jax.device_get(out)  # explicit, one step late: the device is busy
        for j, row in enumerate(rows):
            row.unread -= 1
            if row.done:
                continue  # ended at an earlier read (or its stream closed): this step is masked for it
            st = row.stats
            new = [int(t) for t in tokens[j, : int(n_emit[j])]]
            st.verify_steps += 1
            st.accept_lengths.append(len(new))
            new = new[: row.max_new - row.emitted]
            for i, t in enumerate(new):
                if t in row.stops:
                    new = new[: i + 1]
                    st.finish_reason = "stop"
                    break
            if lp:
                _record_logprobs(st, jax.tree.map(lambda a: a[j : j + 1], lp[0]), len(new), row.top_logprobs)
            row.emitted += len(new)
            st.completion_tokens = row.emitted
            row.out.put(new)
            if st.finish_reason is not None:
                row.end("stop")
            elif row.emitted >= row.max_new:
                row.end("length")
