"""Host cost of dispatching one batched NEXTN step: the group step (one joined state, ling_jax.batching) against the
per-slot step it replaced (a tuple of batch-1 slot states joined, stepped and split inside one program), per row
count, on the demo model. Checked first: both give the same tokens. Then per call: the wall time of the dispatch
alone (the call returns before the device finishes; the previous step is waited for first, so no queue builds up)
and of the whole step, and the program's input buffers.

Usage: python3 -m bench.batching_dispatch [--model models/ling-demo] [--rows 1,2,8] [--reps 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from ling_jax.batching import BatchGenerator
from ling_jax.config import load_config
from ling_jax.runner import Generator
from ling_jax.sampling import SamplingOptions
from ling_jax.slots import join_rows, split_rows
from ling_jax.spec import SpecConfig
from ling_jax.weights import load_params


def per_slot_step_fn(gen: Generator, rows: int):
    """The replaced program: (params, tuple of `rows` batch-1 states) -> (their states after one step, outputs)."""
    step = gen.step(True, False)

    def run(params, states):
        state, out = step(params, join_rows(states))
        return split_rows(state, rows), out

    return jax.jit(run, donate_argnums=(1,))


def time_calls(fn, params, state, reps: int):
    """Mean / median / min dispatch seconds and mean whole-step seconds over `reps` calls (after 3 warm ones)."""
    dispatch, whole = [], []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        state, out = fn(params, state)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        if i >= 3:
            dispatch.append(t1 - t0)
            whole.append(time.perf_counter() - t0)
    return float(np.mean(dispatch)), float(np.median(dispatch)), float(np.min(dispatch)), float(np.mean(whole))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/ling-demo")
    ap.add_argument("--rows", default="1,2,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args()
    cfg = load_config(a.model)
    params = load_params(cfg, a.model, dtype=jnp.bfloat16)
    gen = Generator(cfg, params, spec=SpecConfig("NEXTN", 3), max_len=a.context, dtype=jnp.bfloat16)
    bg = BatchGenerator(gen, max_running=max(int(r) for r in a.rows.split(",")))
    prompt = [2 + (7 * t) % (cfg.vocab_size - 2) for t in range(40)]
    table = []
    greedy = SamplingOptions(temperature=0.0).device(cfg.vocab_size)
    for rows in (int(r) for r in a.rows.split(",")):
        slots = [gen.prefill(prompt[i:], greedy, jax.random.key(i), True, state=bg.fresh_slot())[0]
                 for i in range(rows)]  # distinct prompts: a row mix-up would show in the tokens
        group_fn = bg.batch_step_fn(rows, True, False)
        runs = [("group", group_fn, slots[0] if rows == 1 else join_rows(slots))]
        if rows > 1:  # the per-slot program, on the slots themselves (join_rows copied them into the group)
            old_fn = per_slot_step_fn(gen, rows)
            group, new = group_fn(params, runs[0][2])
            old_slots, old = old_fn(params, tuple(slots))
            for x, y in ((new.tokens, old.tokens), (new.n_emit, old.n_emit)):  # the check: same tokens
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            runs = [("group", group_fn, group), ("per-slot", old_fn, old_slots)]
        for name, fn, st in runs:
            n_in = len(jax.tree.leaves((params, st)))
            mean_d, med_d, min_d, mean_w = time_calls(fn, params, st, a.reps)
            table.append(dict(name=name, rows=rows, input_buffers=n_in, dispatch_mean_ms=1e3 * mean_d,
                              dispatch_median_ms=1e3 * med_d, dispatch_min_ms=1e3 * min_d, step_mean_ms=1e3 * mean_w))
            print(f"{name:9s} rows {rows}: {n_in:4d} input buffers, dispatch mean {1e3 * mean_d:.3f} ms "
                  f"(median {1e3 * med_d:.3f}, min {1e3 * min_d:.3f}), whole step {1e3 * mean_w:.1f} ms", flush=True)
    if a.out:
        device = jax.devices()[0].device_kind
        print("wrote", write(a.out, "batching-dispatch", table, {"model": a.model, "reps": a.reps}, device))


if __name__ == "__main__":
    main()
