"""Continuous batching: up to `max_running` requests decode together in one group of device state.

Staging. A request is prefilled, one chunk per scheduler turn while the group keeps decoding, into the staging
slot: one batch-1 SpecState / DSparkState / PlainState (KDA state, MLA caches, the NEXTN draft cache or DSpark's
draft context K/V, sampling state) of --context-length rows. Its first chunk's program also makes the request's
empty state, in the old slot's buffers (start_fn); the later chunks run the batch-1 prefill program. The chunks
are dispatched from a second thread, the stager (BatchGenerator.stage), while the scheduler thread dispatches and
reads the group's steps: a prefill chunk is hundreds of kernels, whose host dispatch (~1.6 ms for 128 demo tokens
on the H200) would otherwise stall every decoding row's turn; XLA releases the GIL while it enqueues, so the two
threads' dispatches overlap.

The group. The requests that decode hold the rows of ONE state, kept across steps:
  * one request: its prefilled state itself (the staging slot becomes the group; the next prefill gets a fresh
    one, or this one's buffers once its request ended), stepped in place by the batch-1 step program: a lone
    request runs exactly the program it ran before batching and nothing is copied;
  * b > 1 requests: a joined [bucket]-row state (ling_jax.slots; bucket: the smallest of 2, 4, 8, ...,
    max_running >= b), stepped in place (donated) by the B-row step program. Per row: lengths, accept lengths,
    sampling fields, keys (a row draws from its own key as it would alone) and greedy-or-sampled (a group with a
    sampled row runs the sampled program; its temperature-0 rows take the argmax and the greedy verdict there).
Every program takes the Generator's run_params (the target's weights; DSPARK: the (target, draft) pair, every
row drafting its block in the one program). A step is one dispatch of one state, whatever the row count: the
program's buffers are the weights' and one state's, never one per row. Positions past the live rows are dead: a
request that ended (EOS, stop, length, abort), or padding; they step on (the step is row-independent, so they
touch no live row) and their outputs are never read.
Membership changes, and only then is state copied (each a small program, one dispatch):
  * a prefilled request joins: into a dead position, its staging row copied in (put_row, the group donated:
    one row's bytes); into a full group, the group is re-formed in the next bucket (its live rows + the new one
    + padding: the group's bytes once);
  * when nothing waits or prefills and the live rows fit a smaller bucket, the group is compacted into it (the
    live rows copied once); its last row becomes a batch-1 state again, stepped by the batch-1 program.
Trade-off (vs the per-slot step this replaced, which joined bucket slot states, stepped and split them back:
~bucket x 20 buffers in and out and 2 x bucket x (KDA state + caches) bytes copied EVERY step): the step copies
nothing and dispatches one state's buffers; copies happen once per request start or end (a 256-token request at
ling-demo's accept ~3.5 is ~70 steps), at most the group's bytes (ling-demo: KDA 0.4 MB + 0.94 MB of latent
caches per 1k context, per row; at Ling-3.0-flash size, KDA 73 MB per row, a re-form of 8 rows moves ~0.6 GB +
caches, ~0.2 ms of H200 bandwidth, still rare). A re-form briefly holds the old and the new group: up to
max_running + the next bucket down + the staging slot rows (serve.launch_server.request_rows counts that peak).

Host. One scheduler thread (and the stager for prefill chunks): admit -> take the chunk the stager finished
dispatching and hand it the next (after the last one the row joins the group) -> dispatch the step ->
read the previous dispatch's outputs and the new rows' first tokens (ONE device_get, one dispatch late, as
Generator.stream: the device is busy with the dispatch just queued) -> hand each row its tokens, to its Consumer,
right there in this thread (`stream` wraps a queue.Queue for a caller's thread; the server's consumer does the
request's text and reply work in place, so no other thread has to wake per step, as none does for
Generator.stream) -> the rows' `flush` (BatchGenerator.submit): the server hands the whole turn's replies to its
event loop in one wake-up -> the read dispatch's outputs are released (after the flush, as Generator.stream drops
them after its consumer: freeing them releases the GIL, which the woken loop takes there, between two dispatches,
not inside the next one; _Turns._turn). EOS / stop ids / max tokens / a closed stream end a row at that read; the
dispatch already queued for it runs on masked (its outputs are dropped, never committed to the request) and its position
is dead until a new request is put there. Per row and step the host does list slicing and set checks on the
outputs' nested lists (bench/batching_host.py measures this Python: with the demo model's tokenizer and the
server's consumer, 0.14 ms per step at 8 rows on a CPU host, from 1.1 ms before the reads, hand-offs and
detokenisation were made per turn / incremental).

Continuous decode steps (decode_steps = N > 1, --num-continuous-decode-steps): every dispatch of the group runs N
batched steps in one program (runner.Generator.dispatch_step: a lax.scan over the step), so the host's dispatch
cost and its per-turn work are paid once per N steps. The rows of a group are fixed for a dispatch; a row that
ends inside one (stop id, max tokens) is cut at that token when the dispatch is read: its later steps in that
dispatch, and the next dispatch already queued, ran masked (dropped, never committed, not counted in its
accept lengths), exactly as the batch-1 Generator drops steps past a request's end. Each row's N steps reach its
consumer as one chunk. Generator.reserved_rows covers the 2 N steps' rows a row may write past its last token.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import jax
import numpy as np

from ling_jax.aliased_step import AliasedStep, write_into
from ling_jax.runner import GenerationStats, Generator, _record_logprobs, collect, warm_up_prompts
from ling_jax.sampling import SamplingOptions
from ling_jax.slots import cat_rows, is_joined, join_rows, put_row, split_rows, take_rows

log = logging.getLogger("ling_jax.batching")
_END = object()  # a row's last queue item


def row_buckets(max_running: int) -> tuple[int, ...]:
    """The compiled step batch sizes: powers of two below max_running, and max_running."""
    if max_running < 1:
        raise ValueError(f"max_running_requests must be >= 1, got {max_running}")
    return tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_running) + (max_running,)


class Consumer(Protocol):
    """Where a row's output goes, handed over in the scheduler thread as it is read: each chunk (a list of token
    ids) in order, then _END (after an exception when batched decoding failed). `put` returns True once the
    consumer wants nothing more (as closing a stream): the row ends before the next step is dispatched. A
    queue.Queue is one (its put returns None); serve.engine's consumer does a request's per-chunk work right
    there, so no thread of its own wakes per step."""

    def put(self, item) -> bool | None: ...


@dataclass(eq=False)
class _Row:
    """One request as the scheduler sees it. emitted: tokens handed out; unread: see below."""

    prompt: list[int]
    max_new: int
    stops: frozenset
    top_logprobs: int | None
    options: SamplingOptions
    seed: int
    stats: GenerationStats
    out: Consumer = field(default_factory=queue.Queue)
    # (SamplingParams, key) on device, made by `submit` in the caller's thread (None: made at admission), so
    # the scheduler, which every running row waits on, does not build them
    device_inputs: tuple | None = None
    flush: object = None  # see BatchGenerator.submit
    t0: float = field(default_factory=time.perf_counter)
    closed: bool = False  # the consumer closed its stream
    done: bool = False
    chunks: list = field(default_factory=list)  # prefill chunks not yet dispatched
    emitted: int = 0
    unread: int = 0  # tokens at least in the outputs dispatched and not yet read (every step emits >= 1)

    def put(self, item):
        """Hand `item` to the consumer; it may close the row (its answer, or its failure: nothing more reaches a
        consumer that raised)."""
        try:
            if self.out.put(item):
                self.closed = True  # only ever set: the stream's own close may come from another thread meanwhile
        except Exception:  # noqa: BLE001 - the consumer's bug: it gets no more, the others keep decoding
            log.exception("a row's consumer failed")
            self.closed = True

    def end(self, reason: str | None):
        if not self.done:
            self.done = True
            self.stats.finish_reason = self.stats.finish_reason or reason
            self.stats.total_s = time.perf_counter() - self.t0
            self.put(_END)


class BatchGenerator:
    """Generator.stream's interface over continuous batching (thread-safe: each request's stream is consumed in
    its own thread; one scheduler thread runs the device). Other attributes come from the wrapped Generator."""

    def __init__(self, gen: Generator, max_running: int):
        self.gen, self.max_running = gen, max_running
        self.row_buckets = row_buckets(max_running)
        self.inbox: queue.SimpleQueue[_Row] = queue.SimpleQueue()  # empty(): no lock, every turn
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        # the staging slot; while the stager thread dispatches a chunk into it, the stager holds it (None here)
        self.staging = self.fresh_slot()
        self._stager = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-prefill")

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def fresh_slot(self):
        """A batch-1 state in the sampled layout (a greedy request's row joins mixed groups too)."""
        neutral = SamplingOptions().device(self.gen.cfg.vocab_size)
        return self.gen.init_fn(False)(neutral, jax.random.key(0))

    # ---- compiled programs ----------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def start_fn(self, is_greedy: bool):
        """(run_params, old slot state, sampling, key, *first chunk) -> (state, first, logprobs): a new request's
        empty state (the sampled layout) and its first prefill chunk in ONE program, written into the old slot's
        buffers (donated; aliased_step.write_into: every leaf overwritten in place, none read). One dispatch fewer
        per join than a reset program then the chunk's (bench/join_overlap_probe.py, 8 rows decoding, an H100: a
        join costs them 2.06 ms instead of 2.28; with the stager 0.71 instead of 1.28). In place: the old slot's
        values are unused, so without write_into jit drops the argument (its donation aliases nothing) and every
        request's state was a fresh allocation beside the old slot's, at new addresses (on the GPU, the step's
        recorded CUDA graph is re-recorded whenever its buffers moved); now a conc-1 stream of requests keeps one
        set of state buffers, as the group's steps do between joins."""
        init, chunk = self.gen.init_fn(False), self.gen.prefill_chunk(is_greedy)

        def start(pp, old, sampling, key, *first):
            state, token, lp = chunk(pp, init(sampling, key), *first)
            return write_into(old, state), token, lp

        return jax.jit(start, donate_argnums=(1,))

    def stage(self, is_greedy: bool, chunk: tuple, start: tuple | None = None,
              inline: bool = False) -> concurrent.futures.Future:
        """Dispatch one prefill chunk into the staging slot from the stager thread, so its host dispatch (~1.6 ms
        for a 128-token chunk of the demo model on the H200) overlaps the scheduler's decode turns: XLA releases
        the GIL while it enqueues a program (bench/join_overlap_probe.py, an H100: a join costs 8 decoding rows
        1.28 ms instead of 2.28). -> a Future of (staging state, first token, logprobs). The stager holds the slot until
        the future resolves (self.staging is None meanwhile; the scheduler puts the result back). start:
        (sampling, key) of a new request, whose empty state the chunk's program makes (start_fn, into the old
        slot) or, with no slot left (the last one became a lone group), init does.
        inline: dispatch it here, in the caller's thread (the future is done on return): when no row decodes there
        is no turn to overlap, and the stager's hop (its wake-up, then the scheduler's, each waiting for the GIL)
        would only delay the request's first token."""
        old, self.staging = self.staging, None
        if not inline:
            return self._stager.submit(self._prefill_chunk, is_greedy, old, chunk, start)
        done = concurrent.futures.Future()
        try:
            done.set_result(self._prefill_chunk(is_greedy, old, chunk, start))
        except Exception as e:  # noqa: BLE001 - raised where the stager's would be: at the scheduler's result()
            done.set_exception(e)
        return done

    def _prefill_chunk(self, is_greedy, state, chunk, start):
        gen = self.gen
        if start is not None and state is not None:
            return self.start_fn(is_greedy)(gen.run_params, state, *start, *chunk)
        if start is not None:
            state = gen.init_fn(False)(*start)
        return gen.prefill_fn(is_greedy)(gen.run_params, state, *chunk)

    def batch_step_fn(self, rows: int, is_greedy: bool, with_logprobs: bool, adjusts_logits: bool = True):
        """(run_params, group of `rows` rows) -> (the group after one dispatch, StepOutput [rows, ...]; with
        decode_steps = N > 1 N steps in one program (runner.Generator.dispatch_step's lax.scan over the step), its
        outputs [N, rows, ...]); the group is donated (updated in place). rows = 1: the batch-1 program itself, on a
        batch-1 state. adjusts_logits: the steps' static flag (False: every row's request leaves its logits as
        they are, runner.Generator.adjusts_logits)."""
        return self.batch_program(int(rows), bool(is_greedy), bool(with_logprobs), bool(adjusts_logits))

    @functools.lru_cache(maxsize=None)
    def batch_program(self, rows: int, is_greedy: bool, with_logprobs: bool, adjusts_logits: bool):
        """batch_step_fn's program, built once per key (every argument given: the cache's key is the program's)."""
        if rows == 1:
            return self.gen.step_fn(is_greedy, with_logprobs, adjusts_logits)
        return AliasedStep(self.gen.dispatch_step(is_greedy, with_logprobs, adjusts_logits))

    def step_variants(self) -> list[tuple]:
        """(is_greedy, with_logprobs[, adjusts_logits]) of every step program a group can need: greedy / sampled,
        with / without logprobs, and the greedy step of neutral requests where it is another program (the fused
        lm_head + argmax on: Generator.adjusts_logits)."""
        out = [(g, lp) for g in (True, False) for lp in (False, True)]
        if not self.gen.adjusts_logits(SamplingOptions(), False):
            out.append((True, False, False))
        return out

    @functools.lru_cache(maxsize=None)
    def insert_fn(self):
        """(group, position int32[], batch-1 state) -> the group with that row replaced; the group is donated."""
        return jax.jit(put_row, donate_argnums=(0,))

    @functools.lru_cache(maxsize=None)
    def regroup_fn(self):
        """(group (joined or batch-1), batch-1 state | None, idx int32[m]) -> rows idx of the group's rows followed
        by the new state's, as a group of m rows (m = 1: a batch-1 state). Not donated: the shapes change."""

        def regroup(group, new, idx):
            rows = group if is_joined(group) else join_rows([group])
            if new is not None:
                rows = cat_rows(rows, join_rows([new]))
            out = take_rows(rows, idx)
            return split_rows(out, 1)[0] if idx.shape[0] == 1 else out

        return jax.jit(regroup)

    def warm_up_batches(self, progress=None):
        """Compile every program a group can need, before traffic, on fresh states (their results dropped): per
        greedy / sampled and prefill bucket the start program and the later chunks' on the staging slot's sampled
        layout (runner's warm_up builds the greedy ones on the greedy layout); the batch-1 steps on that layout;
        per bucket > 1 the re-form that grows the full bucket below it by one row, the step (greedy / sampled,
        with / without logprobs), the insert, and the compactions into each smaller bucket."""
        gen = self.gen
        neutral = SamplingOptions().device(gen.cfg.vocab_size)
        if self.staging is None:  # a lone request of runner.warm_up took it and its group is not dropped yet
            self.staging = self.fresh_slot()
        for is_greedy in (True, False):
            for prompt in warm_up_prompts(gen):
                chunk = gen.prefill_chunks(prompt)[0]  # the prompt is one chunk of its bucket
                self.staging = self.start_fn(is_greedy)(gen.run_params, self.staging, neutral, jax.random.key(0),
                                                        *chunk)[0]
                self.staging = gen.prefill_fn(is_greedy)(gen.run_params, self.staging, *chunk)[0]
        for variant in self.step_variants():
            if variant[0]:  # the greedy ones
                self.staging, out = self.batch_step_fn(1, *variant)(gen.run_params, self.staging)
                jax.block_until_ready(out)
        group, rows = self.fresh_slot(), 1
        for bucket in self.row_buckets[1:]:
            idx = np.minimum(np.arange(bucket), rows).astype(np.int32)  # the full group, the new row, padding
            group, rows = self.regroup_fn()(group, self.staging, idx), bucket
            for variant in self.step_variants():
                group, out = self.batch_step_fn(bucket, *variant)(gen.run_params, group)
                jax.block_until_ready(out)
            group = self.insert_fn()(group, np.int32(bucket - 1), self.staging)
            for smaller in self.row_buckets[: self.row_buckets.index(bucket)]:
                jax.block_until_ready(self.regroup_fn()(group, None, np.arange(smaller, dtype=np.int32)))
            if progress:
                progress()

    # ---- the consumer side ----------------------------------------------------------------------------------
    def stream(self, prompt, *, max_new_tokens: int, seed: int = 0, stop_token_ids=None,
               stats: GenerationStats | None = None, top_logprobs: int | None = None, **sampling):
        """As Generator.stream (same arguments, same chunks); the request decodes batched with the others."""
        out = queue.Queue()
        row = self.submit(prompt, out, max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=stop_token_ids,
                          stats=stats, top_logprobs=top_logprobs, **sampling)
        try:
            while (item := out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            row.closed = True  # the scheduler drops the row at its next turn

    def submit(self, prompt, out: Consumer, *, max_new_tokens: int, seed: int = 0, stop_token_ids=None,
               stats: GenerationStats | None = None, top_logprobs: int | None = None, flush=None,
               **sampling) -> _Row:
        """Queue a request whose chunks go to `out` (see Consumer); returns its row (set `closed` to leave). Its
        arguments are checked here, in the caller's thread (ValueError). flush: None, or a callable the scheduler
        calls (in its thread, once per turn however many rows share it) after the turn's hand-overs to the
        consumers: the server hands a whole turn's outputs to its event loop there, one wake-up of that thread per
        turn instead of one per row."""
        gen = self.gen
        prompt = gen.check_inputs(prompt, max_new_tokens, top_logprobs)
        options = SamplingOptions(**sampling)
        device_inputs = options.device(gen.cfg.vocab_size), jax.random.key(seed)  # logit_bias ids checked here
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens, stats.num_steps = len(prompt), gen.K
        stops = frozenset(stop_token_ids if stop_token_ids is not None else (gen.cfg.eos_token_id,))
        row = _Row(prompt, max_new_tokens, stops, top_logprobs, options, seed, stats, out, device_inputs, flush)
        self._ensure_scheduler()
        self.inbox.put(row)
        return row

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
                    row.put(RuntimeError(f"batched decoding failed: {e}"))
                    row.end("abort")
                turns.flush()
                turns.settle()
                turns = _Turns(self)
                self.staging = self.fresh_slot()


class _Turns:
    """The scheduler's bookkeeping; `turn` is one round of admit / prefill chunk / dispatch / read."""

    def __init__(self, bg: BatchGenerator):
        self.bg = bg
        self.n = bg.gen.decode_steps  # steps per dispatch
        self.waiting: collections.deque[_Row] = collections.deque()
        self.group = None  # the decoding rows' state: batch-1 (one position) or joined ([bucket] positions)
        self.members: list[_Row | None] = []  # the group's request per position; None or a done row: dead
        self.prefilling: _Row | None = None
        self.staged: concurrent.futures.Future | None = None  # the prefilling row's chunk the stager dispatches
        self.firsts: list = []  # (row, (first token, logprobs | None)), read at the next read
        self.in_flight = None  # (host copies of the dispatch's outputs, [(position, row)] they are read for)
        self.flushes: dict = {}  # the rows' flush callables (BatchGenerator.submit), each called once per turn
        # the step program's key (rows, is_greedy, with_logprobs, adjusts_logits) and the (group size, decoding
        # rows) it was made for: made again only when those change, not every step
        self.keyed_for, self.step_key = None, None

    def live(self) -> list[int]:
        """The positions of the group's rows that have not ended."""
        return [j for j, r in enumerate(self.members) if r is not None and not r.done]

    def rows(self):
        live = [self.members[j] for j in self.live()]
        return list(self.waiting) + live + ([self.prefilling] if self.prefilling else [])

    def turn(self):
        read = None
        try:
            read = self._turn()
        finally:
            self.flush()
        del read  # the dispatch this turn read: released after the flush (see _turn's end)

    def _turn(self):
        idle = not (self.in_flight or self.waiting or self.prefilling or self.firsts or self.live())
        self._take(block=idle)
        for row in self.members:
            if row is not None and row.closed:
                row.end(None)
        self._admit()
        if self.prefilling is not None:
            # wait for the stager only when no row decodes (the turn would spin on the future otherwise)
            self._prefill(block=not self._decoding())
            if self.prefilling is None:
                # it joined: the next waiting request's first chunk is staged in this same turn (its dispatch
                # overlaps this turn's step), not the next one, so a burst of requests joins one per turn, not
                # one per two
                self._admit()
        elif not self.waiting:
            self._compact()
        if self.firsts and self.in_flight is None:
            # the rows joined an idle group (nothing dispatched to read with them): their first tokens are read
            # and handed over before the first step is dispatched, as Generator.stream does, so that dispatch is
            # no part of the time to first token
            self._read(None)
            self.flush()
        dispatched = self._dispatch()
        if self.firsts or self.in_flight is not None:
            self._read(self.in_flight)
        # the dispatch just read is released by `turn`, after the flush, as Generator.stream drops its read outputs
        # right after its consumer took the chunk: freeing a jax Array releases the GIL (jaxlib deletes its
        # buffers without it), and the flush has just woken the server's event loop, which takes the GIL there,
        # between two dispatches. Released before the flush (as it was), the loop's first chance was the next
        # dispatch's own GIL release, and its work (the replies' Python) delayed that call's return: on a 2-core
        # CPU host (bench/batching_sweep.sh --trivial) the lone row's step call took 125-280 us, the batch-1
        # server's 92-102 us, and the lone row's TPOT was 10-34 % above the batch-1 server's.
        read, self.in_flight = self.in_flight, dispatched
        return read

    def _read(self, in_flight):
        """ONE explicit read: the dispatch `in_flight` (one dispatch late: the device is busy with the one just
        queued) and the new rows' first tokens together."""
        if not self.firsts:  # the usual turn: no row joined
            self._read_dispatch(jax.device_get(in_flight[0]), in_flight[1])
            return
        firsts, self.firsts = self.firsts, []
        host_firsts, host_out = jax.device_get(([f for _, f in firsts],
                                                in_flight[0] if in_flight is not None else None))
        for (row, _), (first, lp) in zip(firsts, host_firsts):
            self._read_first(row, first, lp)
        if in_flight is not None:
            self._read_dispatch(host_out, in_flight[1])

    def flush(self):
        for flush in self.flushes.values():
            flush()

    def settle(self):
        """Wait until the stager holds no chunk (after a failure, before the staging slot is replaced)."""
        if self.staged is not None:
            concurrent.futures.wait([self.staged])
            self.staged = None

    def _take(self, block: bool):
        if not block and self.bg.inbox.empty():  # the usual turn: nothing new (a put racing this is taken next turn)
            return
        try:
            self._queue(self.bg.inbox.get(block=block))
            while True:
                self._queue(self.bg.inbox.get_nowait())
        except queue.Empty:
            pass

    def _queue(self, row: _Row):
        self.waiting.append(row)
        if row.flush is not None:
            self.flushes.setdefault(row.flush, row.flush)

    def _admit(self):
        bg = self.bg
        while self.prefilling is None and self.waiting and len(self.live()) < bg.max_running:
            row = self.waiting.popleft()
            if row.closed:
                row.end(None)
                continue
            sp, key = row.device_inputs or (row.options.device(bg.gen.cfg.vocab_size), jax.random.key(row.seed))
            row.device_inputs = None
            if not self.live():
                self._drop_group()
            row.chunks = bg.gen.prefill_chunks(row.prompt)
            self.prefilling = row
            self.staged = bg.stage(row.options.is_greedy, row.chunks.pop(0), start=(sp, key),
                                   inline=not self._decoding())

    def _prefill(self, block: bool):
        """Once the stager has dispatched the prefilling row's chunk: stage the next one (one chunk per turn, so
        a long prompt's chunks interleave with the group's steps on the device), or after the last one join the
        row to the group. A failed chunk raises here (the scheduler fails the rows in flight)."""
        if not (block or self.staged.done()):
            return
        bg, row = self.bg, self.prefilling
        staged, self.staged = self.staged, None
        bg.staging, first, lp = staged.result()
        if row.chunks:
            self.staged = bg.stage(row.options.is_greedy, row.chunks.pop(0), inline=not self._decoding())
            return
        self.prefilling = None
        lp = lp if row.top_logprobs is not None else None
        for a in jax.tree.leaves((first, lp)):
            a.copy_to_host_async()
        self.firsts.append((row, (first, lp)))
        row.unread = 1
        self._join(row)

    def _join(self, row: _Row):
        """Put the prefilled staging state into the group: as the lone row, into a dead position, or re-formed."""
        bg, live = self.bg, self.live()
        if not live:  # the group's rows all ended: the staging state is the group now, nothing is copied
            self.group, self.members, bg.staging = bg.staging, [row], None
        elif len(live) < len(self.members):
            j = next(j for j in range(len(self.members)) if j not in live)
            self.group = bg.insert_fn()(self.group, np.int32(j), bg.staging)
            self.members[j] = row
        else:
            self._regroup(live, row)

    def _compact(self):
        """Nothing waits: move the live rows into the smallest bucket that holds them (or drop an ended group)."""
        live = self.live()
        if not live:
            self._drop_group()
        elif len(live) < len(self.members) and next(b for b in self.bg.row_buckets if b >= len(live)) < len(
                self.members):
            self._regroup(live, None)

    def _drop_group(self):
        """The group's rows all ended: drop it; a batch-1 group's buffers become the staging slot when there is
        none (the lone request took it), so the next start program writes over them instead of a new init."""
        if self.bg.staging is None and self.group is not None and not is_joined(self.group):
            self.bg.staging = self.group
        self.group, self.members = None, []

    def _regroup(self, keep: list[int], new: _Row | None):
        """A group of the smallest bucket holding the rows at positions `keep` (in order) and the staged `new`."""
        bg = self.bg
        rows = [self.members[j] for j in keep] + ([new] if new is not None else [])
        bucket = next(b for b in bg.row_buckets if b >= len(rows))
        idx = keep + ([len(self.members)] if new is not None else [])  # the new row follows the group's
        idx += [idx[-1]] * (bucket - len(idx))  # padding: a copy of a row, stepped and never read
        self.group = bg.regroup_fn()(self.group, bg.staging if new is not None else None, np.array(idx, np.int32))
        self.members = rows + [None] * (bucket - len(rows))

    def _decoding(self) -> list:
        """[(position, row)] of the group's rows that need more tokens (the next dispatch is for them)."""
        return [(j, r) for j, r in enumerate(self.members)
                if r is not None and not r.done and r.emitted + r.unread < r.max_new]

    def _dispatch(self):
        """Dispatch one program of the group (decode_steps steps) when a row needs more tokens; returns (outputs,
        [(position, row)] they are read for)."""
        bg, n = self.bg, self.n
        rows = self._decoding()
        if not rows:
            return None
        if (len(self.members), rows) != self.keyed_for:  # the decoding rows changed: their program's key
            is_greedy = all(r.options.is_greedy for _, r in rows)
            with_lp = any(r.top_logprobs is not None for _, r in rows)
            adjusts = any(bg.gen.adjusts_logits(r.options, with_lp) for _, r in rows)
            self.keyed_for, self.step_key = (len(self.members), rows), (len(self.members), is_greedy, with_lp, adjusts)
        with_lp = self.step_key[2]
        with jax.transfer_guard("disallow"):
            self.group, out = bg.batch_step_fn(*self.step_key)(bg.gen.run_params, self.group)
        out = (out.tokens, out.n_emit) + ((out.logprobs,) if with_lp else ())
        for a in jax.tree.leaves(out):
            a.copy_to_host_async()
        for _, r in rows:
            r.unread += n  # each of the n steps emits at least one token
        return out, rows

    def _read_first(self, row: _Row, first, lp):
        row.unread -= 1
        if row.done:
            return
        st = row.stats
        first = int(first[0])
        if lp is not None:
            _record_logprobs(st, jax.tree.map(lambda a: a[:, None], lp), 1, row.top_logprobs)
        st.ttft_s = time.perf_counter() - row.t0
        row.emitted = st.completion_tokens = 1
        row.put([first])
        if first in row.stops:
            row.end("stop")
        elif row.max_new == 1:
            row.end("length")

    def _read_dispatch(self, out, rows):
        """Host outputs of one dispatch (tokens [(n,) B, K+1], n_emit [(n,) B], logprobs) -> each row's tokens,
        its n steps' in order, handed to its consumer as ONE chunk. A row stops at its first stop id or max
        tokens: what its later steps emitted is dropped, never committed (those steps ran masked)."""
        tokens, n_emit, *lp = out
        n = self.n
        tokens, n_emit = tokens.tolist(), n_emit.tolist()  # nested lists: per-element numpy reads cost ~10x
        if n == 1:
            tokens, n_emit = [tokens], [n_emit]
            lp = [jax.tree.map(lambda a: a[None], lp[0])] if lp else lp
        for j, row in rows:
            row.unread -= n
            if row.done:
                continue  # ended at an earlier read (or its stream closed): this dispatch is masked for it
            st, stops, room = row.stats, row.stops, row.max_new - row.emitted
            new = []
            for s in range(n):
                step = tokens[s][j][: n_emit[s][j]]
                st.verify_steps += 1
                st.accept_lengths.append(len(step))
                step = step[:room - len(new)]
                if stops and not stops.isdisjoint(step):
                    step = step[: next(i for i, t in enumerate(step) if t in stops) + 1]
                    st.finish_reason = "stop"
                if lp:
                    _record_logprobs(st, jax.tree.map(lambda a: a[s, j : j + 1], lp[0]), len(step), row.top_logprobs)
                new += step
                if st.finish_reason is not None or len(new) >= room:
                    break
            row.emitted += len(new)
            st.completion_tokens = row.emitted
            row.put(new)
            if st.finish_reason is not None:
                row.end("stop")
            elif row.emitted >= row.max_new:
                row.end("length")
