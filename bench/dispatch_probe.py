"""Why does one call of the demo model's step cost ~1 ms of host time when its kernels take ~0.37 ms?

The census of 2026-12-02 (bench/results/step-ling-demo-kdaverify-probe-h200x1-2026-12-02.json) shows the whole
plain step is one CUDA graph (XLA command buffer) whose host side is `command_buffer::update` (~840 us, the graph
re-recorded) plus `cuGraphLaunch` (~1000 us, under the profiler). XLA re-records a command buffer whenever any
buffer allocation its commands use has moved since the last call (backends/gpu/runtime/command_buffer_thunk.cc,
UpdateBufferAllocations). This probe times the same step called three ways, each on donated state:

  as-is       the step as bench_step times it: (state, out) returned, `out` a fresh buffer each call
  hold-out    the same, with the last 4 calls' `out` kept alive (a host reading tokens one step late)
  state-only  the same step returning only its state (every output aliases a donated input)
  state-only + copy-out   state-only, then a second small program copying two state leaves out (4 held)
  advance-only            AliasedStep's big program alone (the box chained, nothing copied out)
  alternate               two executables of that program called in turn with two boxes (nothing copied out)
  aliased     ling_jax.aliased_step.AliasedStep, the runner's form: the outputs written into the previous call's
              output buffers (donated) and copied out by a second small program, 4 of them held

and prints the median host seconds one call takes to return and the device-synchronised seconds per step. Run
it with XLA's command-buffer VLOG on to count each variant's re-recordings (markers `== variant` go to stderr):

  TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 python3 -m bench.dispatch_probe --out $OUT \\
      2> $OUT/vlog.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import random_state, time_chain, write
from compile.mesh import make_mesh
from compile.runner import constrain
from compile.sharding import ShardingRules, kernel_calls_for, shardings_for, state_shardings, with_shardings
from compile.stages import Program
from ling_jax.aliased_step import AliasedStep
from ling_jax.config import from_hf_config
from ling_jax.kernel_calls import kernel_calls
from ling_jax.model import RuntimeOptions
from ling_jax.weights import load_hf_checkpoint


def marker(text: str):
    """A line in stderr between the variants, so the VLOG lines of each can be counted."""
    sys.stderr.write(f"\n== variant {text}\n")
    sys.stderr.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/ling-demo")
    ap.add_argument("--mode", default="plain", choices=("plain", "nextn"))
    ap.add_argument("--steps", type=int, default=5, help="NEXTN steps (--mode nextn)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="every variant once per round, in turn (host noise)")
    a = ap.parse_args()
    mesh, rules = make_mesh(1), ShardingRules.tensor_parallel()
    cfg = from_hf_config(a.model)
    params = load_hf_checkpoint(cfg, a.model, jnp.bfloat16, shardings_for(cfg, mesh, rules))
    opts = kernel_calls_for(RuntimeOptions(kernels=kernel_calls("auto")), mesh, rules)
    K = a.steps if a.mode == "nextn" else 0
    prog = Program(cfg, mode=a.mode, steps=max(K, 1), max_len=a.ctx + 1024, opts=opts)
    fn = prog.fn()
    abstract = prog.abstract_state()
    shaped = with_shardings(abstract, state_shardings(abstract, mesh, rules))
    as_is = jax.jit(lambda p, s: constrain(fn(p, s), mesh, rules), donate_argnums=(1,)).lower(params, shaped).compile()
    only = jax.jit(lambda p, s: constrain(fn(p, s)[0], mesh, rules), donate_argnums=(1,)).lower(params, shaped).compile()
    state_only = lambda p, s: (only(p, s), None)
    aliased = AliasedStep(lambda p, s: constrain(fn(p, s), mesh, rules),
                          out_shardings=lambda out: state_shardings(out, mesh, rules))
    aliased.compile(params, shaped)
    boxes = {}

    def advance_only(p, s):  # the aliased step's big program alone, its box chained (nothing copied out)
        s, boxes["box"] = aliased.advance(p, s, boxes.get("box") or aliased.first_box(p, s))
        return s, None

    # two executables of the advance program (two jits of distinct functions: two command buffers), called in
    # turn with two boxes: each sees the same addresses every time it runs, and nothing is copied out
    twins = [AliasedStep(lambda p, s: constrain(fn(p, s), mesh, rules),
                         out_shardings=lambda out: state_shardings(out, mesh, rules)) for _ in range(2)]
    for t in twins:
        t.compile(params, shaped)
    turn = {"i": 0, "boxes": [None, None]}

    def alternate(p, s):
        i = turn["i"] % 2
        turn["i"] += 1
        box = turn["boxes"][i] if turn["boxes"][i] is not None else twins[i].first_box(p, s)
        s, turn["boxes"][i] = twins[i].advance(p, s, box)
        return s, None

    grab = jax.jit(lambda s: jax.tree.map(jnp.copy, jax.tree.leaves(s)[:2]))
    state_emit = lambda p, s: (lambda s2: (s2, grab(s2)))(only(p, s))
    rows = []
    variants = (("as-is", as_is, 0), ("hold-out", as_is, 4), ("state-only", state_only, 0),
                ("state-only + copy-out", state_emit, 4), ("advance-only", advance_only, 0),
                ("aliased", aliased, 4), ("alternate", alternate, 0))
    for name, call, hold in [(f"{n} #{r}", c, h) for r in range(a.rounds) for n, c, h in variants]:
        state = random_state(prog, mesh, rules, a.ctx)
        marker(name)
        disp: list = []
        w, state = time_chain(call, params, state, a.calls, a.reps, disp, hold)
        d = disp[0]
        marker(f"{name} done")
        del state
        rows.append({"name": f"{a.mode}{K} {name}", "host_us_per_call": d * 1e6, "step_us": w * 1e6,
                     "calls_per_chain": a.calls, "reps": a.reps, "held_outputs": hold})
        print(f"{rows[-1]['name']:28s} host {d * 1e6:8.1f} us/call   step {w * 1e6:8.1f} us", flush=True)
    n_out = len(jax.tree.leaves(jax.eval_shape(fn, params, abstract)))
    extra = {"model": a.model, "ctx": a.ctx, "outputs_as_is": n_out, "state_leaves": len(jax.tree.leaves(abstract)),
             "param_leaves": len(jax.tree.leaves(params)), "tree": a.tree,
             "note": "host_us_per_call: median time one call takes to return; step_us: device-synchronised chains"}
    os.makedirs(a.out, exist_ok=True)
    print("wrote", write(a.out, f"dispatch-probe-{a.mode}{K}", rows, extra, jax.devices()[0].device_kind,
                              "python3 -m bench.dispatch_probe " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
