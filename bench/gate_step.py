"""The correctness gate of a change to the step, on the device it runs on: for each kernel variant, 256-token
greedy generations (plain and NEXTN) on a few fixed prompts of the demo model, compared token for token.

A variant is KernelCalls fields, e.g. `rtables:moe_router_tables=1` or `fl:fused_linear=1,moe_router_tables=1`
(the default KernelCalls runs first and is the baseline; e.g. `old:moe_router_tables=0` gates a default that
changed). The JSON is rewritten after every variant, so a run cut short keeps what it finished. Per variant it reports:
  plain == baseline plain: the variant's plain greedy tokens equal the baseline's, prompt by prompt (a kernel
    that is "the same math" must give the same tokens; bf16 rounding differences show up here as a count < P);
  NEXTN == own plain: speculation is lossless with this variant's kernels (bf16 verify rows are not batch-invariant
    everywhere, so this may be < P without --enable-deterministic-inference; it is reported, as is the baseline's);
  accept length: NEXTN's mean accept length (the gate: within 0.05 of the baseline's);
  rerun == first: greedy again after a sampled request (temperature 0.8, top-p 0.9) gives the same tokens.

  python3 -m bench.gate_step --model models/ling-demo --variants rtables:moe_router_tables=1 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from ling_jax.config import load_config
from ling_jax.kernel_calls import KernelCalls, kernel_calls
from ling_jax.model import RuntimeOptions
from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.tokenizer import load_tokenizer
from ling_jax.weights import load_params

PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "# parse a CSV file and print the sum of the second column\nimport csv\n",
    "def is_prime(n: int) -> bool:\n",
    "for i in range(10):\n    print(",
    "def read_config(path):\n    with open(path) as f:\n",
)


def parse_variant(text: str) -> tuple[str, dict]:
    """`name:field=value,...` -> (name, KernelCalls fields); values: 1/0/true/false for bool fields, else ints or strings."""
    name, _, body = text.partition(":")
    fields = {}
    known = {f.name: f for f in dataclasses.fields(KernelCalls)}
    for item in filter(None, body.split(",")):
        k, _, v = item.partition("=")
        if k not in known:
            raise SystemExit(f"error: variant {name!r}: {k!r} is not a KernelCalls field ({sorted(known)})")
        if v.lower() in ("1", "true", "0", "false") and known[k].type in ("bool", bool):
            fields[k] = v.lower() in ("1", "true")
        else:
            try:
                fields[k] = int(v)
            except ValueError:
                fields[k] = v
    return name, fields


def generations(gen: Generator, prompts, new_tokens: int) -> tuple[list[list[int]], list[float]]:
    outs, accepts = [], []
    for p in prompts:
        ids, stats = gen.generate(p, max_new_tokens=new_tokens, seed=0, stop_token_ids=())
        outs.append(ids)
        accepts.extend(stats.accept_lengths)
    return outs, accepts


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/ling-demo")
    ap.add_argument("--variants", default="", help="space-separated name:field=value,... (the baseline is first)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="NEXTN draft steps")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--kernels", default="pallas", choices=("pallas", "interpret"),
                    help="interpret: a CPU smoke test of this script")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tree", default=None)
    a = ap.parse_args()
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[a.dtype]
    cfg = load_config(a.model)
    params = load_params(cfg, a.model, dtype=dtype)
    tok = load_tokenizer(a.model)
    prompts = [tok.encode(t) for t in PROMPTS[:a.prompts]]
    variants = [("default", {})] + [parse_variant(v) for v in a.variants.split()]
    max_len = max(len(p) for p in prompts) + a.new_tokens + 64
    rows, base = [], None
    print(f"{'variant':<12} {'plain==base':>11} {'nextn==plain':>12} {'accept':>7} {'rerun==first':>12}  first diffs")
    for name, fields in variants:
        t0 = time.perf_counter()
        opts = RuntimeOptions(kernels=kernel_calls(a.kernels, **fields))
        plain_gen = Generator(cfg, params, max_len=max_len, dtype=dtype, opts=opts)
        spec_gen = Generator(cfg, params, spec=SpecConfig("NEXTN", num_steps=a.steps), max_len=max_len,
                             dtype=dtype, opts=opts)
        plain, _ = generations(plain_gen, prompts, a.new_tokens)
        nextn, accepts = generations(spec_gen, prompts, a.new_tokens)
        for gen in (plain_gen, spec_gen):  # a sampled request between two greedy runs must change nothing
            gen.generate(prompts[0], max_new_tokens=64, seed=3, stop_token_ids=(), temperature=0.8, top_p=0.9)
        rerun_plain, _ = generations(plain_gen, prompts[:2], a.new_tokens)
        rerun_nextn, _ = generations(spec_gen, prompts[:2], a.new_tokens)
        base = base or plain
        row = dict(variant=name, fields=fields,
                   plain_equal_baseline=sum(x == y for x, y in zip(plain, base)),
                   plain_first_diff_vs_baseline=[first_difference(x, y) for x, y in zip(plain, base)],
                   nextn_equal_own_plain=sum(x == y for x, y in zip(nextn, plain)),
                   nextn_first_diff_vs_own_plain=[first_difference(x, y) for x, y in zip(nextn, plain)],
                   mean_accept_length=float(np.mean(accepts)),
                   rerun_equal_first=(rerun_plain == plain[:2]) and (rerun_nextn == nextn[:2]),
                   prompts=len(prompts), new_tokens=a.new_tokens, nextn_steps=a.steps, seconds=time.perf_counter() - t0)
        rows.append(row)
        diffs = [d for d in row["plain_first_diff_vs_baseline"] if d is not None]
        print(f"{name:<12} {row['plain_equal_baseline']:>8}/{len(prompts)} {row['nextn_equal_own_plain']:>9}/{len(prompts)} "
              f"{row['mean_accept_length']:>7.3f} {str(row['rerun_equal_first']):>12}  {diffs}", flush=True)
        path = write(a.out, "gate", rows, dict(model=a.model, dtype=a.dtype, kernels=a.kernels, tree=a.tree),
                     jax.devices()[0].device_kind)
    print("wrote", path)


if __name__ == "__main__":
    main()
