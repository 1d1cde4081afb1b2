"""Kernel census of the step without a GPU: the step compiled for an H200 (or H100) target on this machine.

XLA's GPU compiler runs without a device when it is given the device's description (a GpuTargetConfigProto:
bench/gpu_targets/*.txtpb) and a compile-only topology; the Pallas Triton and Mosaic GPU kernels lower the same
way (their target is the abstract device's kind). The optimized program's launches (bench/hlo_census.py) are the
kernels the profiler census of bench_step.py counts on the device: the demo's plain step 147 here against 147.6
per step in the H200 trace (step-ling-demo-kdaverify-fl-mrt-ms8-h200x1-2026-12-02.json, same kernels). So a
change to the step's kernel count is measured here, in seconds, and only its time needs the GPU.

Needs the CUDA PJRT plugin of this jax (its compiler; no driver, no GPU): `bash scripts/setup_census.sh` puts it
in .plugins/cuda. Then:

    PYTHONPATH=.plugins/cuda:$PWD .venv/bin/python -m bench.census_offline --model models/ling-demo --steps 5
    ... --kda-verify-epilogue --moe-shared-segments   (any bench_step flag: the same programs bench_step times)
    ... --multi-step 8 --target h100 --tp 2 --out DIR --show-sequence 40
    ... --speculative-algorithm DSPARK --speculative-draft-model-path models/ling-demo-dspark
        [--speculative-dspark-verify static,confidence]   (the DSpark step after the plain and NEXTN rows)

Prints kernels per step and per layer pass, by group and by section of the step (the named scopes of
ling_jax/spec.py and dspark_step.py: nextn_draft / draft_forward + markov_slot_NN, verify_forward, verdict_commit,
nextn_extend / project_context, accept_histograms: bench/hlo_census.py Census.scopes), and writes
census-offline-[dspark-]<model>-<target>-<date>.json (command, jax version, date, git commit, target; per step the
launches by kind and section and the program-order sequence).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax  # noqa: E402

# the CUDA plugin registers its (compile-only) backend without validating a driver when CUDA is not requested
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from bench import bench_step  # noqa: E402
from bench.bench_kernels import git_head  # noqa: E402
from bench.hlo_census import count_launches, group  # noqa: E402
from compile.stages import draft_abstract_params  # noqa: E402
from compile.sharding import TP, ShardingRules, shardings_for, state_shardings, with_shardings  # noqa: E402
from ling_jax.weights import abstract_params  # noqa: E402

TARGETS = {"h200": "h200.txtpb", "h100": "h100.txtpb"}
TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")


def compile_only_devices(target: str, n: int):
    """n compile-only devices of the target GPU (one host): no driver, no memory, only the compiler's view."""
    from jax.experimental import topologies

    with open(os.path.join(TARGET_DIR, TARGETS[target])) as f:
        config = f.read()
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology_name="", topology=f"1x1x{n}",
                                            target_config=config)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise SystemExit(f"no compile-only CUDA topology ({type(e).__name__}: {str(e)[:300]}). Install the CUDA "
                         "plugin of this jax (bash scripts/setup_census.sh) and run with "
                         "PYTHONPATH=.plugins/cuda:$PWD") from None
    return list(topo.devices)


# the step's named scopes (jax.named_scope in ling_jax/spec.py and dspark_step.py): its launches by section
SECTIONS = ("nextn_draft", "draft_forward", "markov_slot", "confidence", "verify_length", "verify_forward",
            "verdict_commit", "nextn_extend", "project_context", "accept_histograms")


def step_name(mode: str, K: int, prog) -> str:
    if mode == "plain":
        return "plain decode step"
    if mode == "dspark":
        return f"DSpark step (block {K}, {prog.dspark_verify}, {K + 1} verify rows)"
    return f"NEXTN step (steps={K}, {K + 1} verify rows)"


def sections_of(census, multi_step: int) -> tuple[dict, list]:
    """({section: launches per step}, the Markov decode's launches per slot): markov_slot_NN summed into
    markov_decode."""
    by = census.by_scope(SECTIONS)
    slots = sorted((k, v / multi_step) for k, v in by.items() if k.startswith("markov_slot"))
    out = {k: v / multi_step for k, v in by.most_common() if not k.startswith("markov_slot")}
    if slots:
        out["markov_decode"] = sum(v for _, v in slots)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])), [v for _, v in slots]


def census_of(a, cfg, mesh, rules, mode, K, prog, fused) -> dict:
    """Compile one step program for the compile-only mesh; its launches per step and per layer pass."""
    step = bench_step.aliased_step(prog, mesh, rules, a.multi_step)
    params = abstract_params(cfg, jnp.bfloat16, shardings_for(cfg, mesh, rules), a.quantization)
    if mode == "dspark":  # the runner's run_params: (target, draft), the draft replicated
        params = (params, draft_abstract_params(prog.draft, jnp.bfloat16, NamedSharding(mesh, PartitionSpec())))
    abstract = prog.abstract_state()
    state = with_shardings(abstract, state_shardings(abstract, mesh, rules))
    t0 = time.perf_counter()
    with jax.default_device(mesh.devices.flat[0]):  # the Pallas lowerings read their target from it
        compiled = step.lower_abstract(params, state).compile()
    seconds = time.perf_counter() - t0
    hlo = compiled.as_text()
    census = count_launches(hlo)
    if a.dump_hlo:  # the optimised HLO the census counts
        import gzip

        os.makedirs(a.out, exist_ok=True)
        what = f"{mode}{K}" + (f"-{prog.dspark_verify}" if mode == "dspark" else "")
        with gzip.open(os.path.join(a.out, f"hlo-offline-{a.target}{a.tag}-{what}.txt.gz"), "wt") as f:
            f.write(hlo)
    per_step = census.total / a.multi_step
    passes = bench_step.layer_passes(cfg, mode, K, prog.draft.num_hidden_layers if prog.draft else 0)
    groups = census.by_group()
    sections, slots = sections_of(census, a.multi_step)
    return {
        "name": step_name(mode, K, prog),
        "mode": mode, "K": K, "fused_linear": bench_step.fused_label(fused), "compile_s": round(seconds, 2),
        "adjusts_logits": prog.adjusts_logits,
        "kernels_per_step": per_step, "layer_passes": passes, "kernels_per_layer_pass": per_step / passes,
        "by_section_per_step": sections, **({"markov_decode_per_slot": slots} if slots else {}),
        "by_group_per_step": {k: v / a.multi_step for k, v in groups.most_common()},
        "sequence": [{"kind": group(l), "section": sec, "name": l.name, "op": l.op_name[:160], "times": n}
                     for (l, n), sec in zip(census.launches, census.scopes(SECTIONS))],
    }


def build_parser() -> argparse.ArgumentParser:
    ap = bench_step.build_parser()
    ap.description = __doc__.split("\n\n")[0]
    ap.add_argument("--target", choices=sorted(TARGETS), default="h200", help="the GPU compiled for")
    ap.add_argument("--adjusts-logits", action="store_true", help="compile every step with adjusts_logits=True "
                    "(the program of requests with penalties or a logit bias) instead of bench_step's False (neutral "
                    "greedy requests: the fused head where it is on, DSPARK's argmax-only Markov decode)")
    ap.add_argument("--show-sequence", type=int, default=0, metavar="N",
                    help="print the first N launches of each step in program order (kind, op)")
    ap.set_defaults(out="bench/results", steps="5")
    return ap


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    for key in bench_step.ZERO_IS_NONE:
        setattr(a, key, getattr(a, key) or None)
    tp = a.tp or 1
    devices = compile_only_devices(a.target, tp)
    mesh, rules = Mesh(np.array(devices), (TP,)), ShardingRules.tensor_parallel()
    cfg = bench_step.model_config(a)
    kernels = "pallas" if a.kernels == "auto" else a.kernels  # "auto" would read this (CPU) host's backend
    fused = bench_step.fused_of(a)
    rows = []
    for mode, K, prog, dv in bench_step.programs(a, cfg, mesh, rules, kernels, fused):
        prog = dataclasses.replace(prog, adjusts_logits=True) if a.adjusts_logits else prog
        if dv is not None:
            raise SystemExit("--draft-vocab: not in the offline census yet (its params are arrays, not shapes)")
        r = census_of(a, cfg, mesh, rules, mode, K, prog, fused)
        rows.append(r)
        print(f"{r['name']:40s} {r['kernels_per_step']:7.1f} kernels/step  {r['kernels_per_layer_pass']:5.2f} per "
              f"layer pass ({r['layer_passes']} passes)  compile {r['compile_s']:.1f} s", flush=True)
        top = list(r["by_group_per_step"].items())[:12]
        print("    " + ", ".join(f"{k} {v:g}" for k, v in top), flush=True)
        print("    sections: " + ", ".join(f"{k} {v:g}" for k, v in r["by_section_per_step"].items()), flush=True)
        if "markov_decode_per_slot" in r:
            print("    Markov decode per slot: " + " ".join(f"{v:g}" for v in r["markov_decode_per_slot"]), flush=True)
        for s in r["sequence"][:a.show_sequence]:
            print(f"      {s['times']:3d}x {s['kind'][:44]:44s} {s['op'][:90]}")
    date = datetime.date.today().isoformat()
    name = os.path.basename(os.path.normpath(a.model)) if a.model else cfg.name
    out = {"command": " ".join([os.path.basename(sys.executable), "-m", "bench.census_offline", *sys.argv[1:]]),
           "device": f"compile-only {devices[0].device_kind} x{tp} (deviceless XLA compile, no GPU)",
           "target_config": TARGETS[a.target], "jax_version": jax.__version__, "date": date,
           "git_commit": git_head(), "tree": bench_step.tree_of(a.tree), "model": a.model or cfg.name,
           "ctx": a.ctx, "multi_step": a.multi_step, "kernels": kernels, "rows": rows,
           "flags": {k: v for k, v in vars(a).items() if k not in ("out", "tag", "show_sequence")}}
    os.makedirs(a.out, exist_ok=True)
    algo = "dspark-" if a.speculative_algorithm == "DSPARK" else ""
    path = os.path.join(a.out, f"census-offline-{algo}{name}-{a.target}{a.tag}-{date}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print("wrote", path)


if __name__ == "__main__":
    main()
