"""bench/batching_sweep.sh's summary: OUT/runs (the bench_serving JSONs, with --timed the servers' step timings and
logs) -> OUT/summary.json and the printed table.

Concurrency 1: the alternated runs' mean TPOT and TTFT per server (batch-1 vs batching), medians and their ratio
(target: within 3 %). The sweep: per level the output throughput, its ratio to concurrency 1 (target at 8: >= 4x),
TPOT, TTFT, accept length. With --timed (each server's steps-NAME.json from bench/serve_host_overhead.py --serve):
per run (each alternated concurrency-1 run, each sweep level) the median per-step interval split into the step
program's call, the reads and the rest (serve_host_overhead.step_split over the run's window_perf_counter); with
--vlog, per server its step calls and XLA's command-buffer re-recordings by num_commands.

Targets (issue 17), each with its verdict in summary.json's "targets" (null where its runs are missing):
conc8_scaling: the sweep's concurrency-8 output throughput over its concurrency 1 >= SCALING_TARGET;
conc1_tpot_ratio: the batching server's median concurrency-1 TPOT over the batch-1 server's <= TPOT_RATIO_TARGET.

    python3 -m bench.batching_sweep_summary OUT [--command "..."]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

from bench.serve_host_overhead import step_split, vlog_updates

SCALING_TARGET = 4.0  # concurrency 8 over concurrency 1, output tokens/s
TPOT_RATIO_TARGET = 1.03  # batching server / batch-1 server, concurrency-1 mean TPOT (medians of the rounds)


def conc1_runs(runs: str, name: str) -> list[dict]:
    return [json.load(open(p))["levels"][0] for p in sorted(glob.glob(f"{runs}/serving-conc1-{name}-r*.json"))]


def timings(runs: str, name: str) -> dict | None:
    path = f"{runs}/steps-{name}.json"
    return json.load(open(path)) if os.path.exists(path) else None


def split_row(timed: dict | None, level: dict) -> dict | None:
    if timed is None or "window_perf_counter" not in level:
        return None
    return step_split(timed, [level["window_perf_counter"]])


def fmt_split(s: dict | None) -> str:
    if not s or not s["intervals"]:  # untimed server, or a level with no step inside its window
        return ""
    return (f"  | per step (us, medians): interval {s['interval_us_median']:.0f} = call {s['call_us_median']:.0f} + "
            f"read {s['read_us_median']:.0f} + rest {s['rest_us_median']:.0f} ({s['intervals']} steps)")


def summarize(out: str, command: str | None = None) -> dict:
    runs = os.path.join(out, "runs")
    summary: dict = {"command": command}
    t1, t8 = timings(runs, "batch1"), timings(runs, "batch8")
    one, b8 = conc1_runs(runs, "batch1"), conc1_runs(runs, "batch8")
    if one and b8:
        m1 = statistics.median(r["mean_tpot_ms"] for r in one)
        m8 = statistics.median(r["mean_tpot_ms"] for r in b8)
        summary["conc1"] = {
            "batch1_tpot_ms": [r["mean_tpot_ms"] for r in one], "batch8_tpot_ms": [r["mean_tpot_ms"] for r in b8],
            "batch1_ttft_ms": [r["mean_ttft_ms"] for r in one], "batch8_ttft_ms": [r["mean_ttft_ms"] for r in b8],
            "batch1_median_itl_ms": [r["median_itl_ms"] for r in one],
            "batch8_median_itl_ms": [r["median_itl_ms"] for r in b8],
            "median_ratio": m8 / m1,
            "batch1_split": [split_row(t1, r) for r in one], "batch8_split": [split_row(t8, r) for r in b8]}
        tpots = lambda rs: ", ".join("%.3f" % r["mean_tpot_ms"] for r in rs)
        print(f"concurrency-1 TPOT, alternated runs: batch-1 server {tpots(one)} ms; batching server {tpots(b8)} ms; "
              f"medians {m1:.3f} vs {m8:.3f} ({m8 / m1 - 1:+.1%}; target within 3 %)")
        print(f"concurrency-1 TTFT medians: batch-1 {statistics.median(r['mean_ttft_ms'] for r in one):.2f} ms, "
              f"batching {statistics.median(r['mean_ttft_ms'] for r in b8):.2f} ms; median ITL "
              f"{statistics.median(r['median_itl_ms'] for r in one):.3f} vs "
              f"{statistics.median(r['median_itl_ms'] for r in b8):.3f} ms")
        for name, rs, t in (("batch-1", one, t1), ("batching", b8, t8)):
            for i, r in enumerate(rs):
                if (s := fmt_split(split_row(t, r))):
                    print(f"  {name} server, run {i + 1}{s}")
    sweep_path = os.path.join(runs, "serving-sweep-batch8.json")
    if os.path.exists(sweep_path):
        levels = json.load(open(sweep_path))["levels"]
        keys = ("max_concurrency", "output_throughput", "throughput_vs_first_level", "mean_tpot_ms", "median_itl_ms",
                "mean_ttft_ms", "accept_length", "failed")
        summary["sweep"] = [dict({k: m.get(k) for k in keys}, split=split_row(t8, m)) for m in levels]
        if not (one and b8):
            print(f"concurrency-1 TPOT: batching server {levels[0]['mean_tpot_ms']:.3f} ms (no batch-1 server run)")
        for m in levels:
            print(f"  concurrency {m['max_concurrency']}: {m['output_throughput']:.0f} tok/s = "
                  f"{m['throughput_vs_first_level']:.2f}x, TPOT {m['mean_tpot_ms']:.3f} ms, TTFT {m['mean_ttft_ms']:.1f} "
                  f"ms, accept {m['accept_length'] or 0:.2f} (target at 8: >= 4x){fmt_split(split_row(t8, m))}")
    summary["targets"] = targets(summary)
    print_targets(summary["targets"])
    vlog = {}
    for name, t in (("batch1", t1), ("batch8", t8)):
        log = os.path.join(runs, f"server-{name}.log")
        if t is not None and os.path.exists(log):
            counts = vlog_updates(log)
            if counts:
                vlog[name] = {"step_calls": len(t["starts"]), "command_buffer_updates": counts}
                print(f"  {name}: {len(t['starts'])} step calls; command-buffer updates by num_commands: "
                      + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[0])[:6]))
    if vlog:
        summary["vlog"] = vlog
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("wrote", os.path.join(out, "summary.json"))
    return summary


def targets(summary: dict) -> dict:
    """Each target's value, bound and verdict (value and verdict None where the runs it needs are missing)."""
    at8 = [m for m in summary.get("sweep", []) if m["max_concurrency"] == 8]
    scaling = at8[0]["throughput_vs_first_level"] if at8 else None
    ratio = summary["conc1"]["median_ratio"] if "conc1" in summary else None
    return {"conc8_scaling": {"value": scaling, "bound": f">= {SCALING_TARGET}",
                              "pass": None if scaling is None else scaling >= SCALING_TARGET},
            "conc1_tpot_ratio": {"value": ratio, "bound": f"<= {TPOT_RATIO_TARGET}",
                                 "pass": None if ratio is None else ratio <= TPOT_RATIO_TARGET}}


def print_targets(t: dict):
    print(f"{'target':18s} {'value':>8s}  {'bound':8s}  verdict")
    for name, v in t.items():
        value = "-" if v["value"] is None else f"{v['value']:.3f}"
        verdict = {True: "PASS", False: "FAIL", None: "not run"}[v["pass"]]
        print(f"{name:18s} {value:>8s}  {v['bound']:8s}  {verdict}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--command", default=None)
    a = p.parse_args(argv)
    summarize(a.out, a.command)


if __name__ == "__main__":
    main()
