"""The serving engine: requests run FIFO through ling_jax.runner.Generator (batch 1) or, with
--max-running-requests > 1, up to that many at once through ling_jax.batching.BatchGenerator (continuous batching).

The worker is an asyncio task that starts each request once a running place is free. Batch 1: the Generator's
blocking `stream` (itself run-ahead: step k+1 is dispatched before step k is read) runs in an engine thread, which
does the request's per-chunk work (`Decoding`: text, stops, metrics) as each chunk is yielded. Batched: the request
goes to the BatchGenerator with its `Decoding` as consumer, run by the scheduler thread on each chunk the moment it
is read: the same one thread per step as at batch 1 (a thread per request woken per step between the scheduler
and the event loop cost the lone request +184 us per step in bench/serve_host_overhead.py's emulation of the
H200's host-bound step; the H200 sweep showed +22 % TPOT at concurrency 1). Either way every
output is handed to the request's asyncio queue with `call_soon_threadsafe` — no polling anywhere; batched, the
outputs of one scheduler turn (every row's) go to the loop in ONE call at the turn's end (`_flush`), so the loop's
thread wakes once per step, not once per row. Requests beyond the running ones wait in the FIFO queue. With
--num-continuous-decode-steps N a dispatch's N steps arrive together: batch 1 hands them back one after another,
batched as one chunk per row (the client sees N steps at a time; stops are checked per step, as at N = 1).

Text: token ids go through an `IncrementalDetokenizer`; stop strings are searched in the decoded text and cut
exactly (the text ends right before the stop string, later tokens are dropped). While a stop string could still
be completing, its possible prefix is held back so a stream never emits text that a non-stream reply would
not contain. The Generator ends a stream at EOS / a stop token id (kept as the last output id); as in SGLang,
that token's text is not part of the reply.

Aborts: a request ends early when its client disconnects, /abort_request names it, its per-request timeout
passes, or the server shuts down. The last three answer the waiting client at once from the event loop (the
request's Decoding notices the flag at its next chunk and closes the stream / the row); an abort that carries a
`status_code` is an error for the client, one without (SGLang's /abort_request) a normal, shortened reply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ling_jax.runner import GenerationStats, Generator, warm_up
from ling_jax.tokenizer import IncrementalDetokenizer, Tokenizer
from serve.logprobs import TokenLogprob
from serve.protocol import APIError, GenRequest, ModelLimits

log = logging.getLogger("serve.engine")

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0,
                    8.0, 16.0, 32.0, 64.0)


def observe_n(hist, amount: float, n: int):
    """n observations of one value in a prometheus_client Histogram child: what n calls of observe(amount) record
    (counts exact; the sum as amount * n), in one bucket search instead of n (the per-token ITL: a step's interval
    shared over its tokens, ~3 per row per step with speculation). Falls back to the calls where the histogram's
    internals are not the ones this was written against."""
    try:
        bounds, buckets, total = hist._upper_bounds, hist._buckets, hist._sum
    except AttributeError:
        for _ in range(n):
            hist.observe(amount)
        return
    total.inc(amount * n)
    for bucket, bound in zip(buckets, bounds):
        if amount <= bound:
            bucket.inc(n)
            break


class Metrics:
    """Prometheus metrics in a registry owned by one app (names follow SGLang's, with a `ling:` prefix).

    Each metric is already bound to this model's label; `requests` keeps a finish_reason label open.
    """

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry(auto_describe=True)
        lab = {"model_name": model_name}

        def make(kind, name, doc, **kw):
            return kind(name, doc, list(lab), registry=r, **kw).labels(**lab)

        hist = dict(buckets=_LATENCY_BUCKETS)
        self.requests = Counter("ling:num_requests", "Finished requests", ["model_name", "finish_reason"],
                                registry=r)
        self.model_name = model_name
        self.aborted = make(Counter, "ling:num_aborted_requests", "Requests cancelled (client gone) or failed")
        self.prompt_tokens = make(Counter, "ling:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = make(Counter, "ling:generation_tokens", "Tokens generated")
        self.ttft = make(Histogram, "ling:time_to_first_token_seconds", "Time to first token (queue included)",
                         **hist)
        self.itl = make(Histogram, "ling:inter_token_latency_seconds",
                        "Time between output tokens (a step's interval shared over its tokens)", **hist)
        self.tpot = make(Histogram, "ling:time_per_output_token_seconds",
                         "(e2e - ttft) / (output tokens - 1) per request", **hist)
        self.e2e = make(Histogram, "ling:e2e_request_latency_seconds", "End-to-end request latency", **hist)
        self.accept_length = make(Histogram, "ling:spec_accept_length",
                                  "Tokens emitted per verify step (bonus included)", buckets=tuple(range(1, 18)))
        self.avg_accept_length = make(Gauge, "ling:avg_spec_accept_length", "Mean accept length since start")
        self.queue = make(Gauge, "ling:num_queue_reqs", "Requests waiting")
        self.running = make(Gauge, "ling:num_running_reqs", "Requests running")

    def finished(self, kind: str):
        self.requests.labels(model_name=self.model_name, finish_reason=kind).inc()


@dataclass
class Output:
    """One step's worth of a request's output, as handed to the HTTP layer."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: dict | None = None  # SGLang's {"type": "stop" | "length" | "abort", ...}
    logprobs: list[TokenLogprob] | None = None  # per token_ids entry, when the request asked for logprobs


class TextAssembler:
    """Token ids -> text deltas with exact stop-string truncation. Without a tokenizer the text stays empty."""

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...] = ()):
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = stops
        self.text = ""  # decoded so far (complete characters only)
        self.sent = 0  # characters returned so far
        self.matched: str | None = None

    def add(self, ids: list[int]) -> tuple[int, str]:
        """Feed ids; returns (ids consumed, new text). Fewer ids are consumed when a stop string completes."""
        if self.detok is None:
            return len(ids), ""
        if not self.stops:
            self.text += self.detok.add(ids)
            return len(ids), self._take(len(self.text))
        longest = max(map(len, self.stops))
        for i, t in enumerate(ids):
            start = max(0, len(self.text) - longest + 1)
            self.text += self.detok.add([t])
            hits = [(p, s) for s in self.stops if (p := self.text.find(s, start)) >= 0]
            if hits:
                p, self.matched = min(hits)
                self.text = self.text[:p]
                return i + 1, self._take(p)
        return len(ids), self._take(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The rest of the text (held-back stop prefixes, an incomplete UTF-8 tail) once generation ended."""
        if self.detok is not None and self.matched is None:
            self.text = self.detok.text
        return self._take(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        for n in range(min(len(self.text), max(map(len, self.stops)) - 1), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stops):
                return n
        return 0

    def _take(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out


@dataclass
class Request:
    """Engine-side request: the validated input, its output queue, cancellation flag and result."""

    gen: GenRequest
    queue: asyncio.Queue
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    log_metrics: bool = True  # False for /health_generate's probe
    cancelled: threading.Event = field(default_factory=threading.Event)
    abort_reason: dict | None = None  # why it was cancelled, when not by a client disconnect
    timer: asyncio.TimerHandle | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output id, when asked for
    text: str = ""
    finish_reason: dict | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    ttft_s: float = 0.0
    e2e_s: float = 0.0


def device_seed(seed: int) -> int:
    """A request's uint64 seed -> the 31-bit seed the programs (and the multi-host header) take; seeds below
    2**31 map to themselves, larger ones fold their high bits in."""
    return seed if seed < 2**31 else (seed ^ (seed >> 31) ^ (seed >> 62)) & (2**31 - 1)


class Engine:
    """seed: the source of per-request seeds when a request brings none (None: random per start, as SGLang
    without --random-seed). max_queued: waiting requests beyond which submit answers 503. request_timeout_s:
    each request's limit from arrival (queue included); past it the client gets a 504."""

    def __init__(self, generator: Generator, limits: ModelLimits, metrics: Metrics, seed: int | None = None, *,
                 max_queued: int | None = None, request_timeout_s: float | None = None):
        self.gen, self.limits, self.m = generator, limits, metrics
        self.rng = random.Random(seed if seed is not None else secrets.randbits(64))
        self.max_queued, self.request_timeout_s = max_queued, request_timeout_s
        self.live: dict[str, Request] = {}  # submitted and not yet answered, by id
        self.pending: asyncio.Queue[Request] = asyncio.Queue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.worker: asyncio.Task | None = None
        self.verify_ct_total = 0  # verify steps since start (warm-up excluded)
        self.accept_tokens_total = 0  # tokens those steps emitted (sum of accept lengths)
        self.num_finished = self.num_aborted = 0
        self.last_gen_throughput = 0.0
        self.max_running = getattr(generator, "max_running", 1)  # a BatchGenerator's slots, else batch 1
        # a BatchGenerator takes requests with a consumer its scheduler thread hands each chunk to (no thread per
        # request); a Generator's blocking stream runs in an engine thread
        self.batched = callable(getattr(generator, "submit", None))
        self.running: dict[str, Request] = {}  # the requests being generated now, by id
        # batched: the event-loop calls the scheduler thread's consumers made during its current turn, handed to
        # the loop together at the turn's end (`_flush`): one wake-up of the loop per turn, not one per row
        self._outbox: list = []
        self._places = asyncio.Semaphore(self.max_running)
        self._threads = None if self.batched else concurrent.futures.ThreadPoolExecutor(
            self.max_running, thread_name_prefix="engine-stream")

    # ---- async side -------------------------------------------------------------------------------------------
    def start(self):
        self.loop = asyncio.get_running_loop()
        self.worker = asyncio.create_task(self._run(), name="engine-worker")

    async def stop(self):
        for req in list(self.running.values()):  # each request's Decoding closes it at the next chunk
            self.cancel(req, "server shutting down")
        if self.worker is not None:
            self.worker.cancel()

    def submit(self, gen: GenRequest, log_metrics: bool = True) -> Request:
        if self.max_queued is not None and self.pending.qsize() >= self.max_queued:
            raise APIError(503, f"the queue is full ({self.max_queued} requests waiting, --max-queued-requests); "
                                f"retry later", type="service_unavailable", code="queue_full")
        rid = gen.extra.get("rid")
        if rid is not None and rid in self.live:
            raise APIError(400, f"a request with rid '{rid}' is already running", param="rid", code="duplicate_rid")
        req = Request(gen=gen, queue=asyncio.Queue(), log_metrics=log_metrics, **({"id": rid} if rid else {}))
        self.live[req.id] = req
        if self.request_timeout_s is not None:
            req.timer = self.loop.call_later(self.request_timeout_s, self.abort, req, {
                "type": "abort", "message": f"request timed out after {self.request_timeout_s:g} s (--request-timeout)",
                "status_code": 504})
        self.pending.put_nowait(req)
        self.m.queue.inc()
        return req

    def cancel(self, req: Request, why: str = "client disconnected"):
        """Flag `req` for the worker; nobody waits for an answer (the client is gone)."""
        if req.finish_reason is None and not req.cancelled.is_set():
            log.info("request %s cancelled: %s", req.id, why)
            req.cancelled.set()

    def abort(self, req: Request, reason: dict):
        """On the event loop: end `req` now with `reason` (the worker closes its stream at the next step)."""
        if req.finish_reason is not None:
            return
        log.info("request %s aborted: %s", req.id, reason["message"])
        req.abort_reason = reason
        req.cancelled.set()
        self._deliver(req, Output([], "", finished=True, finish_reason=reason))

    def abort_rid(self, rid: str | None, abort_all: bool = False, message: str = "aborted by /abort_request",
                  status_code: int | None = None) -> int:
        """SGLang's /abort_request (and shutdown, with a status): returns how many requests it ended."""
        reqs = list(self.live.values()) if abort_all else [r for r in (self.live.get(rid),) if r is not None]
        reason = {"type": "abort", "message": message}
        if status_code is not None:
            reason["status_code"] = status_code
        for r in reqs:
            self.abort(r, dict(reason))
        return len(reqs)

    @property
    def avg_accept_length(self) -> float:
        return self.accept_tokens_total / self.verify_ct_total if self.verify_ct_total else 0.0

    async def _run(self):
        while True:
            await self._places.acquire()  # first: a request waits in `pending` (and counts there) until a place is free
            req = await self.pending.get()
            self.m.queue.dec()
            if req.cancelled.is_set():  # gone while waiting
                self._finish(req, req.abort_reason or {"type": "abort", "message": "client disconnected"}, 0)
                self._places.release()
                continue
            self.m.running.inc()
            self.running[req.id] = req
            if self.batched:
                self._submit(req)
            else:
                self.loop.run_in_executor(self._threads, self._process, req).add_done_callback(
                    lambda _, req=req: self._ended(req))

    def _ended(self, req: Request):
        self.running.pop(req.id, None)
        self.m.running.dec()
        self._places.release()

    def _call_soon(self, fn, *args):
        """From any thread: run fn(*args) on the event loop."""
        self.loop.call_soon_threadsafe(fn, *args)

    def _queue(self, fn, *args):
        """In the BatchGenerator's scheduler thread: run fn(*args) on the event loop after this turn (`_flush`)."""
        self._outbox.append((fn, args))

    def _flush(self):
        """The scheduler's turn ended (BatchGenerator.submit's flush): its queued calls go to the loop at once."""
        if self._outbox:
            calls, self._outbox = self._outbox, []
            self.loop.call_soon_threadsafe(_run_all, calls)

    def _deliver(self, req: Request, out: Output):
        """On the event loop: the request's fields only ever reflect what its queue has delivered; nothing is
        delivered after its finished output (an abort answered early)."""
        if req.finish_reason is not None:
            return
        req.output_ids += out.token_ids
        req.logprobs += out.logprobs or []
        req.text += out.text
        if out.finished:
            req.finish_reason = out.finish_reason
            req.e2e_s = time.perf_counter() - req.t_arrival
            self.live.pop(req.id, None)
            if req.timer is not None:
                req.timer.cancel()
        req.queue.put_nowait(out)

    # ---- generation: a request's chunks, in the thread that reads them ----------------------------------------
    def _submit(self, req: Request):
        """On the event loop: hand `req` to the BatchGenerator; its scheduler thread runs the request's Decoding
        on each chunk and the place is freed once the request finished."""
        d = Decoding(self, req, on_finished=lambda: d.handoff(self._ended, req), handoff=self._queue)
        try:
            self.gen.submit(req.gen.input_ids, d, flush=self._flush, **d.stream_args())
        except Exception as e:  # noqa: BLE001 - refused arguments: reported to the client, as a stream's error
            d.handoff = self._call_soon  # here on the event loop's thread, not the scheduler's
            d.fail(e)

    def _process(self, req: Request):
        """In an engine thread: `req` through the Generator's stream (the thread ends, and frees the place, once
        it is closed)."""
        d = Decoding(self, req)
        it = d.stream = self.gen.stream(req.gen.input_ids, **d.stream_args())
        try:
            for ids in it:
                if d.chunk(ids):
                    return
            d.end()
        except Exception as e:  # noqa: BLE001 - report it to the client, keep serving
            d.fail(e)
        finally:
            it.close()  # explicit, not at garbage collection (cancels the run-ahead step; multi-host followers
            # wait on this decision)

    @staticmethod
    def _logprobs(req: Request, start: int, n: int) -> list[TokenLogprob] | None:
        """The logprobs the generator recorded for output tokens start..start+n-1 (None when not asked for)."""
        if req.gen.top_logprobs is None:
            return None
        st = req.stats
        return list(zip(st.token_logprobs[start : start + n], st.top_logprobs[start : start + n]))

    def _finish(self, req: Request, reason: dict, n_out: int, ids: list[int] | None = None, delta: str = "",
                logprobs: list[TokenLogprob] | None = None, handoff=None):
        e2e = time.perf_counter() - req.t_arrival
        kind = reason["type"]
        if not req.log_metrics:
            pass
        elif kind == "abort":
            self.num_aborted += 1
            self.m.aborted.inc()
        else:
            self.num_finished += 1
            st = req.stats
            self.verify_ct_total += st.verify_steps
            self.accept_tokens_total += sum(st.accept_lengths)
            for a in st.accept_lengths:
                self.m.accept_length.observe(a)
            self.m.avg_accept_length.set(self.avg_accept_length)
            self.m.e2e.observe(e2e)
            if n_out > 1:
                self.m.tpot.observe((e2e - req.ttft_s) / (n_out - 1))
                self.last_gen_throughput = (n_out - 1) / max(e2e - req.ttft_s, 1e-9)
        if req.log_metrics:
            self.m.finished(kind)
            self.m.prompt_tokens.inc(len(req.gen.input_ids))
            self.m.generation_tokens.inc(n_out)
        if kind == "abort":
            log.info("request %s aborted after %d tokens: %s", req.id, n_out, reason.get("message"))
        (handoff or self._call_soon)(self._deliver, req, Output(ids or [], delta, finished=True, finish_reason=reason,
                                                                logprobs=logprobs))


class Decoding:
    """One request's generation as its chunks of token ids arrive: text (stop strings cut), stop ids, logprobs,
    metrics, and the finished output (Engine._finish). `chunk` runs in the thread that reads the generator:
    the request's engine thread (batch 1), or the BatchGenerator's scheduler (as its Consumer: `put`), where a
    chunk is handed over the moment it is read, as Generator.stream yields it in its own thread."""

    def __init__(self, engine: Engine, req: Request, on_finished=None, handoff=None):
        g = req.gen
        self.engine, self.req, self.on_finished = engine, req, on_finished
        # handoff(fn, *args): fn(*args) on the event loop (batched: queued for the end of the scheduler's turn)
        self.handoff = handoff or engine._call_soon
        self.stream = None  # batch 1: the Generator's stream, closed as soon as the request finished
        eos = () if g.ignore_eos else engine.limits.eos_ids
        self.stop_ids = tuple(eos) + tuple(g.stop_token_ids)
        self.text = TextAssembler(engine.limits.tokenizer, g.stop)
        self.seed = device_seed(g.seed) if g.seed is not None else engine.rng.randrange(2**31)
        self.n_out, self.t_last = 0, req.t_arrival
        self.finished = False

    def stream_args(self) -> dict:
        """The generator's arguments but the prompt (Generator.stream's, BatchGenerator.submit's)."""
        g = self.req.gen
        return dict(max_new_tokens=g.max_new_tokens, seed=self.seed, stop_token_ids=self.stop_ids,
                    stats=self.req.stats, top_logprobs=g.top_logprobs, **g.sampling.kwargs())

    def chunk(self, ids: list[int]) -> bool:
        """One consumed step's ids; True once the request finished (its last output is emitted)."""
        req, g, m = self.req, self.req.gen, self.engine.m
        now = time.perf_counter()
        if not req.log_metrics:  # a /health_generate probe
            pass
        elif self.n_out == 0:
            req.ttft_s = now - req.t_arrival
            m.ttft.observe(req.ttft_s)
        elif ids:
            observe_n(m.itl, (now - self.t_last) / len(ids), len(ids))
        self.t_last = now
        # The Generator ends a chunk at a stop token; decided here from the ids themselves, since its
        # stats only say so once the stream is resumed (the first token is yielded before it checks).
        text = self.text
        stop_token = ids[-1] if ids and ids[-1] in self.stop_ids else None
        n, delta = text.add(ids[:-1] if stop_token is not None else ids)  # its text is dropped
        if text.matched is None:
            n = len(ids)
        ids = ids[:n]
        lps = self.engine._logprobs(req, self.n_out, n)
        self.n_out += n
        reason = None
        if text.matched is not None:
            reason = {"type": "stop", "matched": text.matched}
        elif stop_token is not None:
            reason = {"type": "stop", "matched": stop_token}
        elif self.n_out >= g.max_new_tokens:
            reason = {"type": "length", "length": g.max_new_tokens}
        elif req.cancelled.is_set():
            reason = req.abort_reason or {"type": "abort", "message": "client disconnected"}
        if reason is not None:
            if self.stream is not None:
                self.stream.close()  # cancels the run-ahead step still in flight
            self._finish(reason, ids, delta + text.finish(), lps)
            return True
        self.handoff(self.engine._deliver, req, Output(ids, delta, logprobs=lps))
        return False

    def end(self):
        """The generator ended without a reason (it should not): close as length."""
        if not self.finished:
            self._finish({"type": "length", "length": self.req.gen.max_new_tokens}, [], self.text.finish())

    def fail(self, e: BaseException):
        if not self.finished:
            log.error("request %s failed", self.req.id, exc_info=e)
            self._finish({"type": "abort", "message": f"internal error: {e}", "status_code": 500}, [], "")

    def put(self, item) -> bool:
        """ling_jax.batching.Consumer: a chunk, an exception, or the end; True once finished (the row closes)."""
        if self.finished:
            return True
        if isinstance(item, BaseException):
            self.fail(item)
        elif not isinstance(item, list):
            self.end()
        else:
            try:
                self.chunk(item)
            except Exception as e:  # noqa: BLE001 - report it to the client, keep serving
                self.fail(e)
        return self.finished

    def _finish(self, reason: dict, ids: list[int], delta: str, logprobs: list[TokenLogprob] | None = None):
        self.finished = True
        try:
            self.engine._finish(self.req, reason, self.n_out, ids, delta, logprobs, self.handoff)
        finally:
            if self.on_finished is not None:  # the request's running place is freed whatever happened
                self.on_finished()


def _run_all(calls):
    for fn, args in calls:
        fn(*args)


def warmup(gen: Generator, limits: ModelLimits, progress=None):
    """Compile and run the programs serving uses (greedy and sampled; ling_jax.runner.warm_up; with continuous
    batching every row bucket too), blocking."""
    warm_up(gen, progress)
    if hasattr(gen, "warm_up_batches"):
        gen.warm_up_batches(progress)
