"""A lone request: per-token time of Generator.stream vs BatchGenerator.stream, in process (no HTTP server).

The serving sweep on the H200 put the batching server's concurrency-1 TPOT 22 % above the batch-1 server's
(bench/results/serving-sweep-h200-*-groups.json). This separates the scheduler (its thread, the staging slot's
sampled layout, the one-step-late reads through a queue) from the server: the same greedy request through both, the
median over --reps of (decode seconds / decoded tokens), the first run of each excluded (it compiles).

    python3 -m bench.batching_lone --model models/ling-demo --out $OUT
"""

from __future__ import annotations

import argparse
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
from ling_jax.spec import SpecConfig
from ling_jax.weights import load_params

PROMPT = [int(t) for t in np.random.default_rng(0).integers(5, 4000, 128)]


def per_token_us(gen, new_tokens: int, reps: int) -> list[float]:
    """Decode microseconds per token (after the first token) of each run but the first."""
    times = []
    for r in range(reps + 1):
        first, n = None, 0
        for chunk in gen.stream(PROMPT, max_new_tokens=new_tokens, stop_token_ids=()):
            first = first or time.perf_counter()
            n += len(chunk)
        if r:
            times.append(1e6 * (time.perf_counter() - first) / (n - 1))
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/ling-demo")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=3, help="NEXTN steps (0: plain decoding)")
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = load_config(a.model)
    params = load_params(cfg, a.model, dtype=jnp.dtype(a.dtype))
    spec = SpecConfig("NEXTN", a.steps) if a.steps else SpecConfig("NONE")
    gen = Generator(cfg, params, spec=spec, max_len=2048, dtype=jnp.dtype(a.dtype))
    batcher = BatchGenerator(gen, a.max_running)  # a lone request never needs the b > 1 programs: not built
    rows = []
    for _ in range(2):  # alternate, so a drift of the host shows in both
        for name, g in (("Generator", gen), ("BatchGenerator", batcher)):
            t = per_token_us(g, a.new_tokens, a.reps)
            rows.append({"path": name, "median_us_per_token": float(np.median(t)), "runs_us": t})
            print(f"{name:15s} {np.median(t):8.1f} us/token (median of {len(t)})", flush=True)
    report = {"model": a.model, "dtype": a.dtype, "nextn_steps": a.steps, "new_tokens": a.new_tokens}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        print("wrote", write(a.out, "batching-lone", rows, report, jax.devices()[0].device_kind.replace(" ", "-"),
                             "python3 -m bench.batching_lone " + " ".join(argv or sys.argv[1:])))
    return rows


if __name__ == "__main__":
    main()
