"""Can a request's prefill be dispatched while the group keeps decoding? A probe of the host's share of a join.

On the H200 the demo model is host-bound: a request joining a group of decoding rows costs them ~5.5 ms
(bench/batching_join.py, bench/results/batching-join-h200-2026-12-03.json), nearly all of it host dispatch in the
scheduler's one thread: reset the staging slot (0.34 ms), the 128-token prefill program (1.6 ms of dispatch for 511
kernels), the insert (0.39 ms). This probe times, per iteration (median ms, warm-up excluded), with R rows decoding:

  turns        2 decode turns (dispatch the step, read the previous one's outputs one step late), nothing else;
  serial       reset + prefill + 2 turns + insert, all in this thread (the scheduler before 2026-12-06);
  fused        init folded into the prefill program (one program: the empty state is made inside it, the old
               staging buffers donated: BatchGenerator.start_fn) + 2 turns + insert;
  thread       reset + prefill dispatched from a second thread while this one runs the 2 turns, then the insert;
  fused+thread both (the scheduler since 2026-12-06: BatchGenerator.stage).

If `thread` costs about what `turns` does, dispatch overlaps across threads (the GIL is released while XLA enqueues
a program) and the scheduler can stage prefills in a second thread.

    python3 -m bench.join_overlap_probe --out $OUT
    JAX_PLATFORMS=cpu python3 -m bench.join_overlap_probe --dtype float32 --reps 3 --rows 2   # CPU smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from ling_jax.batching import BatchGenerator
from ling_jax.config import load_config
from ling_jax.runner import Generator
from ling_jax.sampling import SamplingOptions
from ling_jax.spec import SpecConfig
from ling_jax.weights import load_params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/ling-demo")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = load_config(a.model)
    dtype = jnp.dtype(a.dtype)
    gen = Generator(cfg, load_params(cfg, a.model, dtype=dtype), spec=SpecConfig("NEXTN", 3), max_len=a.context,
                    dtype=dtype)
    bg = BatchGenerator(gen, max_running=a.rows)
    greedy = SamplingOptions(temperature=0.0).device(cfg.vocab_size)
    key = jax.random.key(0)
    prompt = np.random.default_rng(0).integers(5, cfg.vocab_size, a.prompt_len).tolist()
    chunks = gen.prefill_chunks(prompt)
    prefill, insert, fused_first = gen.prefill_fn(True), bg.insert_fn(), bg.start_fn(True)
    init = gen.init_fn(False)
    reset = jax.jit(lambda old, sampling, key: init(sampling, key), donate_argnums=(0,))  # the staging reset, alone

    box = {"staging": bg.fresh_slot()}
    box["staging"] = gen.prefill(prompt, greedy, key, True, state=box["staging"])[0]
    box["group"] = bg.regroup_fn()(box["staging"], None, np.zeros(a.rows, np.int32))
    step = bg.batch_step_fn(a.rows, True, False)
    box["prev"] = None

    def turn():
        box["group"], out = step(gen.params, box["group"])
        out = (out.tokens, out.n_emit)
        for x in out:
            x.copy_to_host_async()
        if box["prev"] is not None:
            jax.device_get(box["prev"])
        box["prev"] = out

    def stage(fused: bool):
        if fused:
            box["staging"], first, _ = fused_first(gen.params, box["staging"], greedy, key, *chunks[0])
            rest = chunks[1:]
        else:
            box["staging"] = reset(box["staging"], greedy, key)
            rest = chunks
        for c in rest:
            box["staging"], first, _ = prefill(gen.params, box["staging"], *c)
        first.copy_to_host_async()
        return first

    def join_insert():
        box["group"] = insert(box["group"], np.int32(a.rows - 1), box["staging"])

    pool = concurrent.futures.ThreadPoolExecutor(1)

    def variant(name):
        if name == "turns":
            turn(); turn()
        elif name in ("serial", "fused"):
            stage(name == "fused"); turn(); turn(); join_insert()
        else:
            f = pool.submit(stage, name == "fused+thread")
            turn(); turn()
            f.result()
            join_insert()

    names = ("turns", "serial", "fused", "thread", "fused+thread")
    times = {n: [] for n in names}
    for n in names:  # compile and warm
        for _ in range(3):
            variant(n)
    jax.block_until_ready(box["group"])
    for r in range(a.reps):  # interleaved, so drifts hit every variant alike
        for n in names:
            t0 = time.perf_counter()
            variant(n)
            times[n].append(time.perf_counter() - t0)
    jax.block_until_ready(box["group"])
    table = []
    base = float(np.median(times["turns"])) * 1e3
    print(f"{'variant':14s} {'ms/iter':>9s} {'join cost':>10s}   ({a.rows} rows, {a.prompt_len}-token prompt, "
          f"{len(chunks)} chunk(s))")
    for n in names:
        ms = float(np.median(times[n])) * 1e3
        table.append({"variant": n, "rows": a.rows, "ms_per_iteration_median": ms,
                      "ms_p10": float(np.percentile(times[n], 10)) * 1e3,
                      "ms_p90": float(np.percentile(times[n], 90)) * 1e3,
                      "join_cost_ms": ms - base})
        print(f"{n:14s} {ms:9.3f} {ms - base:10.3f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        print("wrote", write(a.out, "join-overlap", table, {"model": a.model, "dtype": a.dtype,
                                                             "prompt_len": a.prompt_len, "context": a.context},
                             jax.devices()[0].device_kind, "python3 -m bench.join_overlap_probe " + " ".join(
                                 argv if argv is not None else sys.argv[1:])))


if __name__ == "__main__":
    main()
