"""Host time per batched step: the Python the batching server runs around the step program (the scheduler's per-row
bookkeeping, stop / EOS / max-token checks, each row's serve.engine.Decoding: detokenisation, metrics, the hand-off
to the event loop; the one-step-late read), at 1 / 2 / 4 / 8 rows, on the demo model.

The scheduler (ling_jax.batching._Turns) is driven turn by turn in this thread with R greedy requests decoding
(ignore_eos, 128-token prompts, each row's consumer a real serve.engine.Decoding whose outputs an asyncio loop in
another thread delivers, as the server's does; --inline-loop / --profile: run in this thread after each turn).
Per decode step (a turn: dispatch one step, read the previous one; with --decode-steps N a turn is one dispatch
of N steps and the per-step numbers divide by N):
  turn      the wall time of the turn;
  program   the time inside the step program's call (its host dispatch; ~all of it on the H200, where the demo
            model's step is host-bound);
  read      the time inside jax.device_get (the one-step-late read: a wait for the device where it is behind);
  host      turn - program - read: the Python around the program, what this bench is for;
  alone     the step program alone at R rows, called back to back (bench/batching_dispatch's whole step).
--trivial-step ACCEPT: the model's step replaced by one that emits ACCEPT tokens per row and touches one leaf
(bench/serve_host_overhead's), so the program costs ~nothing and the host's Python is measured alone (on a CPU
host, where the demo model's real step takes ~15-150 ms, the host's share is otherwise lost in its noise).
--profile: cProfile over the timed turns of each row count; the host time split into the consumers (text, metrics,
hand-off) and the scheduler's own bookkeeping, plus the top functions by own time.

Found with it (CPU host, --trivial-step 3, 200 turns; bench/results/batching-host-n*-cpu-2026-12-03-trivial-*.json):
host ms per step at 1 / 2 / 4 / 8 rows 0.33 / 0.50 / 0.83 / 1.11 before, of which at 8 rows (profiled) ~0.7 ms
was detokenisation (IncrementalDetokenizer decoded the whole output every chunk: O(tokens) per row per step),
~0.15 metrics, ~0.15 the read and per-row numpy element reads, plus a wake-up of the event loop's thread per row
(call_soon_threadsafe's self-pipe write, and the GIL hand-over it invites, once per row per step); after (one read
per turn, nested-list rows, one hand-off per turn, windowed byte-level detokenisation) 0.07 / 0.08 / 0.11 / 0.14,
and with --decode-steps 2 0.04 / 0.05 / 0.06 / 0.09 per step.

    python3 -m bench.batching_host --rows 1,2,4,8 --out $OUT                   # GPU (bf16)
    JAX_PLATFORMS=cpu python3 -m bench.batching_host --trivial-step 3 --dtype float32 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from ling_jax.batching import BatchGenerator, _Turns
from ling_jax.config import load_config
from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.tokenizer import load_tokenizer
from ling_jax.weights import load_params
from serve.engine import Engine, Metrics, Request
from serve.protocol import GenRequest, ModelLimits

# (label, functions whose cumulative time it is): where the host time goes under --profile
CATEGORIES = (
    ("consumers (Decoding.put)", ("put",), "serve/engine.py"),
    ("  text (TextAssembler.add)", ("add",), "serve/engine.py"),
    ("  metrics (histogram observe)", ("observe",), "prometheus_client"),
     ("event loop deliveries (inline)", ("drain",), "bench/batching_host.py"),
    ("read (jax.device_get)", ("device_get",), "jax"),
    ("program call", ("__call__",), "ling_jax/aliased_step.py"),
)


class InlineLoop:
    """The event loop's side run in the scheduler's thread: call_soon_threadsafe queues, `drain` runs the queue
    (timed apart). For --profile: cProfile here sees every thread as one and mixes their calls up."""

    def __init__(self):
        self.calls, self.s = [], 0.0

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))

    def call_later(self, *a):
        raise NotImplementedError

    def drain(self):
        t = time.perf_counter()
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)
        self.s += time.perf_counter() - t


class Clock:
    """Accumulated seconds inside wrapped callables."""

    def __init__(self):
        self.s = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s += time.perf_counter() - t

        return timed


def make_rows(engine: Engine, bg: BatchGenerator, n: int, prompt_len: int, max_new: int, seed: int):
    """n requests as the server makes them (Engine._submit: its Decoding as the row's consumer), in bg's inbox."""
    rng = np.random.default_rng(seed)
    decodings = []
    for i in range(n):
        ids = rng.integers(5, bg.gen.cfg.vocab_size, prompt_len).tolist()
        req = Request(gen=GenRequest(input_ids=ids, max_new_tokens=max_new, ignore_eos=True), queue=asyncio.Queue())
        engine.live[req.id] = engine.running[req.id] = req
        engine._submit(req)  # as the server's worker does: the Decoding consumer, the per-turn flush
        decodings.append(req)
    return decodings


def measure(bg: BatchGenerator, engine: Engine, rows: int, turns: int, profile: bool, max_new: int):
    """The timed turns at `rows` decoding rows (see the module docstring); -> (dict of per-step ms, profile text)."""
    t = _Turns(bg)
    make_rows(engine, bg, rows, 128, max_new, rows)
    while len(t.live()) < rows or t.prefilling is not None or t.waiting or not bg.inbox.empty():
        t.turn()
    for _ in range(3):  # every row past its first read
        t.turn()
    drain = getattr(engine.loop, "drain", None)
    if drain:
        drain()
        engine.loop.s = 0.0
    program, read = Clock(), Clock()
    step_fns = {}
    orig_fn, orig_get = bg.batch_step_fn, jax.device_get

    def timed_step_fn(*key):
        if key not in step_fns:
            step_fns[key] = program.wrap(orig_fn(*key))
        return step_fns[key]

    bg.batch_step_fn = timed_step_fn
    jax.device_get = read.wrap(orig_get)
    prof = cProfile.Profile() if profile else None
    try:
        emitted0 = sum(r.emitted for r in t.rows())
        if prof:
            prof.enable()
        wall, per_turn = timed_turns(lambda: t.turn(), drain, turns, program, read)
        if prof:
            prof.disable()
        tokens = sum(r.emitted for r in t.rows()) - emitted0
        assert len(t.live()) == rows, "a row ended inside the timed turns: raise max_new"
    finally:
        bg.batch_step_fn, jax.device_get = orig_fn, orig_get
    for r in t.rows():  # end the rows (their consumers close them at the next turn)
        r.closed = True
    while t.live() or t.in_flight:
        t.turn()
    if drain:
        drain()
    steps = turns * bg.gen.decode_steps
    ms = lambda s: 1e3 * s / steps
    res = dict(path="batching", rows=rows, decode_steps=bg.gen.decode_steps, turns=turns, turn_ms=ms(wall),
               program_ms=ms(program.s), read_ms=ms(read.s), host_ms=ms(wall - program.s - read.s),
               host_median_ms=1e3 * float(np.median(per_turn)) / bg.gen.decode_steps, tokens_per_step=tokens / steps)
    if drain:
        res["event_loop_ms"] = ms(engine.loop.s)  # inside host_ms
    text = ""
    if prof:
        res["profile_ms"], text = breakdown(prof, steps)
        res["profile_ms"]["host (turn - program - read), profiled"] = (
            res["profile_ms"]["turn, profiled"] - res["profile_ms"]["program call"]
            - res["profile_ms"]["read (jax.device_get)"])
    return res, text


def timed_turns(turn, drain, turns: int, program: Clock, read: Clock):
    """Run `turns` turns (each followed by the inline loop's deliveries, if any); -> (wall seconds, per turn the
    host seconds: its wall time less the program call's and the read's; their median shrugs off a shared host's
    preemptions, which land on whole turns)."""
    per_turn = []
    t0 = time.perf_counter()
    for _ in range(turns):
        t, p, r = time.perf_counter(), program.s, read.s
        turn()
        if drain:
            drain()
        per_turn.append(time.perf_counter() - t - (program.s - p) - (read.s - r))
    return time.perf_counter() - t0, per_turn


def measure_batch1(gen: Generator, engine: Engine, turns: int, max_new: int, seed: int = 1):
    """The batch-1 server's path at the same clock, for the lone row's comparison: one request through
    Generator.stream with its serve.engine.Decoding as Engine._process runs it (the chunk's work in the thread
    that reads the stream, each output handed to the loop), a step per yielded chunk (decode_steps 1)."""
    from serve.engine import Decoding

    ids = np.random.default_rng(seed).integers(5, gen.cfg.vocab_size, 128).tolist()
    req = Request(gen=GenRequest(input_ids=ids, max_new_tokens=max_new, ignore_eos=True), queue=asyncio.Queue())
    engine.live[req.id] = engine.running[req.id] = req
    d = Decoding(engine, req)
    drain = getattr(engine.loop, "drain", None)
    program, read = Clock(), Clock()
    step_fns = {}
    orig_fn, orig_get = gen.step_fn, jax.device_get

    def timed_step_fn(*key):  # Generator.stream takes self.step_fn(...) once per stream: shadowed on the instance
        if key not in step_fns:
            step_fns[key] = program.wrap(orig_fn(*key))
        return step_fns[key]

    gen.step_fn = timed_step_fn
    jax.device_get = read.wrap(orig_get)
    it = d.stream = gen.stream(req.gen.input_ids, **d.stream_args())
    try:
        for _ in range(4):  # the first token, then every step read one step late
            d.chunk(next(it))
        if drain:
            drain()
        program.s = read.s = 0.0
        n0 = d.n_out
        wall, per_turn = timed_turns(lambda: d.chunk(next(it)), drain, turns, program, read)
        tokens = d.n_out - n0
    finally:
        it.close()
        del gen.step_fn
        jax.device_get = orig_get
    if drain:
        drain()
    ms = lambda x: 1e3 * x / turns
    return dict(path="batch1", rows=1, decode_steps=1, turns=turns, turn_ms=ms(wall), program_ms=ms(program.s),
                read_ms=ms(read.s), host_ms=ms(wall - program.s - read.s),
                host_median_ms=1e3 * float(np.median(per_turn)), tokens_per_step=tokens / turns)


def breakdown(prof: cProfile.Profile, steps: int):
    """Per-step ms of each CATEGORIES entry (cumulative time of its functions) and the top functions by own time."""
    st = pstats.Stats(prof)
    out = {}
    total = sum(v[2] for v in st.stats.values())  # own time of everything profiled
    out["turn, profiled"] = 1e3 * total / steps
    for label, names, where in CATEGORIES:
        out[label] = 1e3 * sum(v[3] for (f, _, n), v in st.stats.items() if n in names and where in f
                               and not _nested(st, (f, _, n), names, where)) / steps
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return out, buf.getvalue()


def _nested(st, key, names, where) -> bool:
    """A function of the category called (directly) by another of the same category: its time is counted there."""
    callers = st.stats[key][4]
    return any(n in names and where in f for (f, _, n) in callers)


def alone_ms(bg: BatchGenerator, rows: int, reps: int) -> float:
    """The step program alone at `rows` rows, called back to back (each call's outputs waited for)."""
    gen = bg.gen
    neutral_slot = bg.fresh_slot()
    prompt = list(range(5, 5 + 40))
    slot = gen.prefill(prompt, _greedy(gen), jax.random.key(0), True, state=neutral_slot)[0]
    group = slot if rows == 1 else bg.regroup_fn()(slot, None, np.zeros(rows, np.int32))
    fn = bg.batch_step_fn(rows, True, False)
    for _ in range(3):
        group, out = fn(gen.params, group)
        jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        group, out = fn(gen.params, group)
        jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / (reps * gen.decode_steps)


def _greedy(gen):
    from ling_jax.sampling import SamplingOptions

    return SamplingOptions(temperature=0.0).device(gen.cfg.vocab_size)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/ling-demo")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--turns", type=int, default=200, help="timed turns per row count")
    ap.add_argument("--decode-steps", type=int, default=1, help="--num-continuous-decode-steps")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed turns (slows them)")
    ap.add_argument("--rounds", type=int, default=1, help="measure every row count this many times, in turn")
    ap.add_argument("--inline-loop", action="store_true",
                    help="run the event loop's deliveries in this thread after each turn (implied by --profile)")
    ap.add_argument("--trivial-step", type=int, default=None, metavar="ACCEPT",
                    help="replace the model's step by a trivial one emitting ACCEPT tokens per row "
                         "(bench.serve_host_overhead.trivial_steps): the host's share alone, on any device")
    ap.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args(argv)
    rows_list = [int(r) for r in a.rows.split(",")]
    if a.trivial_step is not None:
        from bench.serve_host_overhead import trivial_steps

        trivial_steps(a.trivial_step)
    cfg = load_config(a.model)
    params = load_params(cfg, a.model, dtype=jnp.dtype(a.dtype))
    gen = Generator(cfg, params, spec=SpecConfig("NEXTN", 3), max_len=a.context, dtype=jnp.dtype(a.dtype),
                    decode_steps=a.decode_steps)
    bg = BatchGenerator(gen, max_running=max(rows_list))
    bg._thread = threading.current_thread()  # no scheduler thread: this one drives the turns
    max_new = a.context - 128 - gen.reserved_rows
    if (a.turns + 8) * a.decode_steps * gen.rows_per_step > max_new:
        raise SystemExit(f"--turns {a.turns} x {a.decode_steps} steps may run past the context {a.context}")
    tok = load_tokenizer(a.model)
    limits = ModelLimits(a.model, cfg.vocab_size, a.context, gen.reserved_rows, tok, tok.eos_ids if tok else ())
    engine = Engine(bg, limits, Metrics("bench"))
    if a.profile or a.inline_loop:
        engine.loop = InlineLoop()
    else:
        engine.loop = asyncio.new_event_loop()
        threading.Thread(target=engine.loop.run_forever, name="event-loop", daemon=True).start()
    # no warm_up_batches: each row count's untimed turns (its rows joining) compile what its timed turns run
    table, profiles = [], []
    print(f"{'rows':>4} {'turn':>8} {'program':>8} {'read':>8} {'host':>8} {'host p50':>8} {'alone':>8}  ms per decode step "
          f"(decode_steps {a.decode_steps}); tokens/step", flush=True)
    batch1 = 1 in rows_list and a.decode_steps == 1 and not a.profile
    for rnd in range(a.rounds):
        for rows in rows_list:
            if rows == 1 and batch1:  # the batch-1 server's path first, then the lone row's, in every round
                res = measure_batch1(gen, engine, a.turns, max_new)
                res["round"] = rnd
                table.append(res)
                print(f"  1* {res['turn_ms']:8.3f} {res['program_ms']:8.3f} {res['read_ms']:8.3f} "
                      f"{res['host_ms']:8.3f} {res['host_median_ms']:8.3f} {'':>8s}  {res['tokens_per_step']:.2f}  "
                      f"(batch-1: Generator.stream)", flush=True)
            res, text = measure(bg, engine, rows, a.turns, a.profile, max_new)
            if "event_loop_ms" in res:
                print(f"     (event loop's deliveries, run inline: {res['event_loop_ms']:.3f} ms of host)")
            res["alone_ms"] = alone_ms(bg, rows, max(10, a.turns // 4))
            res["round"] = rnd
            table.append(res)
            print(f"{rows:4d} {res['turn_ms']:8.3f} {res['program_ms']:8.3f} {res['read_ms']:8.3f} "
                  f"{res['host_ms']:8.3f} {res['host_median_ms']:8.3f} {res['alone_ms']:8.3f}  "
                  f"{res['tokens_per_step']:.2f}", flush=True)
            if a.profile:
                for k, v in res["profile_ms"].items():
                    print(f"       {k:40s} {v:8.3f} ms/step")
                profiles.append(text)
    if a.rounds > 1:
        print("median over rounds of the per-turn host medians (ms per decode step):")
        for path, rows in ([("batch1", 1)] if batch1 else []) + [("batching", r) for r in rows_list]:
            xs = [r["host_median_ms"] for r in table if (r["path"], r["rows"]) == (path, rows)]
            print(f"  {path:8s} rows {rows}: {np.median(xs):.4f}  ({', '.join(f'{x:.4f}' for x in xs)})")
    if a.profile:
        for rows, text in zip(rows_list, profiles):
            print(f"---- rows {rows}: top functions by own time (whole profiled turns) ----\n{text}")
    if a.out:
        device = jax.devices()[0].device_kind
        extra = {"model": a.model, "dtype": a.dtype, "decode_steps": a.decode_steps, "turns": a.turns,
                 "profiled": a.profile, "trivial_step_accept": a.trivial_step}
        print("wrote", write(a.out, f"batching-host-n{a.decode_steps}", table, extra, device,
                             "python3 -m bench.batching_host " + " ".join(argv if argv is not None else
                                                                         __import__("sys").argv[1:])))


if __name__ == "__main__":
    main()
