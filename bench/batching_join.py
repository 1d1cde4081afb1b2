"""What a request joining a decoding group costs the others: each program of a join alone, and the scheduler's turns
with and without a join, on the demo model (NEXTN 3, the batching server's defaults).

At concurrency 8 the serving sweep's decode steps take ~1.4 ms (median ITL) but its output rate implies ~1.8 ms a
step: the rest is the turns in which a request is admitted, because the group waits for them. A join is, in the
scheduler (ling_jax.batching._Turns): in the stager thread, the start program (the new request's empty state and its
first prefill chunk in one program, start_fn) and one prefill program per later chunk (runner.Generator.prefill_fn;
a 128-token prompt is one chunk of the 128 bucket); in the scheduler thread, into the group (insert_fn into a dead
position, or regroup_fn into the next row bucket), and that turn's step.

Rows (ms, median of --reps, each call's outputs waited for, warm-up excluded):
  program alone   each join program called back to back (device + host dispatch: the demo model is host-bound);
  dispatch        the same call's return alone (the host's share of it);
  turns           the wall time of the scheduler's turns: a plain decode turn at R rows, and a turn that admits,
                  prefills and inserts a request (R - 1 rows decoding, one joining), as the server runs them.

    python3 -m bench.batching_join --out $OUT                          # GPU (bf16)
    JAX_PLATFORMS=cpu python3 -m bench.batching_join --dtype float32 --reps 3 --rows 2   # CPU smoke test
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import os
import tempfile
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.batching_host import InlineLoop, make_rows
from bench.bench_step import census, write
from ling_jax.batching import BatchGenerator, _Turns
from ling_jax.config import load_config
from ling_jax.runner import Generator
from ling_jax.sampling import SamplingOptions
from ling_jax.spec import SpecConfig
from ling_jax.tokenizer import load_tokenizer
from ling_jax.weights import load_params
from serve.engine import Engine, Metrics
from serve.protocol import ModelLimits


def timed(fn, reps: int) -> tuple[float, float]:
    """(median ms of a call with its outputs waited for, median ms of the call's return alone); fn() -> outputs."""
    for _ in range(2):
        jax.block_until_ready(fn())
    whole, dispatch = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        whole.append(time.perf_counter() - t0)
        dispatch.append(t1 - t0)
    return 1e3 * float(np.median(whole)), 1e3 * float(np.median(dispatch))


def programs_alone(bg: BatchGenerator, rows: int, prompt_len: int, reps: int) -> list[dict]:
    """Each program of a join at `rows` rows, alone (see the module docstring)."""
    gen = bg.gen
    greedy = SamplingOptions(temperature=0.0).device(gen.cfg.vocab_size)
    key = jax.random.key(0)
    prompt = np.random.default_rng(0).integers(5, gen.cfg.vocab_size, prompt_len).tolist()
    chunks = gen.prefill_chunks(prompt)
    box = {"staging": bg.fresh_slot()}
    box["staging"] = gen.prefill(prompt, greedy, key, True, state=box["staging"])[0]
    group = bg.regroup_fn()(box["staging"], None, np.zeros(rows, np.int32))
    box["group"] = group
    step = bg.batch_step_fn(rows, True, False)
    start, prefill, insert, regroup = bg.start_fn(True), gen.prefill_fn(True), bg.insert_fn(), bg.regroup_fn()

    def run_start():  # the empty state and the first chunk, then the later chunks (none within the largest bucket)
        box["staging"], first, _ = start(gen.params, box["staging"], greedy, key, *chunks[0])
        for c in chunks[1:]:
            box["staging"], first, _ = prefill(gen.params, box["staging"], *c)
        return first

    def run_insert():
        box["group"] = insert(box["group"], np.int32(rows - 1), box["staging"])
        return box["group"]

    def run_regroup():  # rows - 1 rows and the new one into a group of `rows` (the bucket grows)
        return regroup(box["group"], box["staging"], np.arange(rows, dtype=np.int32))

    def run_step():
        box["group"], out = step(gen.params, box["group"])
        return out

    out = []
    census_of = {}
    for name, (prog_fn, state_key, args) in (("prefill", (prefill, "staging", chunks[0])), ("step", (step, "group", ()))):
        def one(p, st, prog_fn=prog_fn, args=args):
            st, *rest = prog_fn(p, st, *args)
            return st, rest
        with tempfile.TemporaryDirectory() as d:
            c, box[state_key] = census(one, gen.params, box[state_key], 5, 1e-3, d, 1)
        census_of[name] = {k: c.get(k) for k in ("kernels_per_step_per_device", "kernel_us_per_step_all_streams",
                                                 "by_category_us", "error")}
        census_of[name]["top_kernels"] = c.get("top_kernels", [])[:15]
        print(f"  census {name}: {c.get('kernels_per_step_per_device')} kernels, "
              f"{c.get('kernel_us_per_step_all_streams')} us of kernels a call {c.get('error', '')}", flush=True)
    for name, fn in ((f"start + prefill ({len(chunks)} chunk(s) for {prompt_len} tokens, buckets {gen.buckets})",
                      run_start), ("insert (dead position)", run_insert),
                     ("regroup (next bucket)", run_regroup), (f"decode step, {rows} rows", run_step)):
        whole, dispatch = timed(fn, reps)
        out.append({"name": name, "rows": rows, "program_ms": whole, "dispatch_ms": dispatch,
                    "census": census_of.get(name.split()[0].replace("decode", "step"))})
        print(f"  {name:60s} {whole:8.3f} ms  (dispatch {dispatch:.3f})", flush=True)
    return out


def scheduler_turns(bg: BatchGenerator, engine: Engine, rows: int, prompt_len: int, reps: int,
                    prof: cProfile.Profile | None = None) -> list[dict]:
    """Wall ms of the scheduler's plain decode turns at `rows` rows and of its turns that admit a request while
    rows - 1 decode (each join's turns until the new row decodes with the others), as the server runs them."""
    t = _Turns(bg)
    max_new = bg.gen.max_len - prompt_len - bg.gen.reserved_rows
    make_rows(engine, bg, rows - 1, prompt_len, max_new, 1)
    while len(t.live()) < rows - 1 or t.prefilling is not None or t.waiting or not bg.inbox.empty():
        t.turn()
    plain, join = [], []
    for i in range(reps + 1):
        for _ in range(5):
            t0 = time.perf_counter()
            t.turn()
            plain.append(time.perf_counter() - t0)
        before = {id(r) for r in t.members}
        make_rows(engine, bg, 1, prompt_len, max_new, 100 + i)
        if prof is not None and i > 0:
            prof.enable()
        t0 = time.perf_counter()
        while len(t.live()) < rows or t.prefilling is not None or t.waiting or not bg.inbox.empty():
            t.turn()
        t.turn()  # the turn that reads the new row's first token with the group's outputs
        join.append(time.perf_counter() - t0)
        if prof is not None:
            prof.disable()
        # the new row leaves again (it ends at the next turn), so the next join inserts into its dead position
        next(r for r in t.members if r is not None and id(r) not in before).closed = True
        while len(t.live()) > rows - 1:
            t.turn()
    for r in t.rows():
        r.closed = True
    while t.live() or t.in_flight:
        t.turn()
    plain_ms, join_ms = 1e3 * float(np.median(plain[5:])), 1e3 * float(np.median(join[1:]))
    print(f"  turns at {rows} rows: plain decode turn {plain_ms:.3f} ms, a join (admit, prefill, insert, its "
          f"turns until the new row's first read) {join_ms:.3f} ms", flush=True)
    return [{"name": f"scheduler turn, {rows} rows decoding", "rows": rows, "turn_ms": plain_ms},
            {"name": f"join into {rows - 1} decoding rows (all its turns)", "rows": rows, "turn_ms": join_ms}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/ling-demo")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", default="8", help="group sizes (each a row bucket)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--profile-joins", action="store_true", help="cProfile the timed joins' turns (the host's "
                    "functions by cumulative time, printed; the join times then include the profiler's cost)")
    ap.add_argument("--skip-alone", action="store_true", help="only the scheduler's turns")
    ap.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args(argv)
    rows_list = [int(r) for r in a.rows.split(",")]
    cfg = load_config(a.model)
    dtype = jnp.dtype(a.dtype)
    gen = Generator(cfg, load_params(cfg, a.model, dtype=dtype), spec=SpecConfig("NEXTN", 3), max_len=a.context,
                    dtype=dtype)
    bg = BatchGenerator(gen, max_running=max(rows_list))
    bg._thread = threading.current_thread()  # no scheduler thread: this one drives the turns
    tok = load_tokenizer(a.model)
    engine = Engine(bg, ModelLimits(a.model, cfg.vocab_size, a.context, gen.reserved_rows, tok,
                                    tok.eos_ids if tok else ()), Metrics("bench"))
    engine.loop = InlineLoop()
    table = []
    for rows in rows_list:
        if not a.skip_alone:
            print(f"rows {rows}: programs alone (ms, outputs waited for)", flush=True)
            table += programs_alone(bg, rows, a.prompt_len, a.reps)
        prof = cProfile.Profile() if a.profile_joins else None
        table += scheduler_turns(bg, engine, rows, a.prompt_len, max(3, a.reps // 4), prof)
        if prof is not None:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
            print(f"---- rows {rows}: the joins' turns, by cumulative time ----\n{buf.getvalue()}", flush=True)
        engine.loop.drain()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        print("wrote", write(a.out, "batching-join", table, {"model": a.model, "dtype": a.dtype,
                                                              "prompt_len": a.prompt_len, "context": a.context},
                             jax.devices()[0].device_kind, "python3 -m bench.batching_join " + " ".join(
                                 argv if argv is not None else sys.argv[1:])))


if __name__ == "__main__":
    main()
