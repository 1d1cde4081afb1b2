"""bench/batching_sweep_summary.py on hand-made runs: the alternated concurrency-1 medians and their ratio, the
sweep's concurrency-8 scaling, each target's verdict, and the per-step split of a timed server's steps inside a
run's window (values worked out by hand below)."""

from __future__ import annotations

import json

from bench import batching_sweep_summary


def level(c, tok_s, base, tpot, window=None):
    m = {"max_concurrency": c, "output_throughput": tok_s, "throughput_vs_first_level": tok_s / base,
         "mean_tpot_ms": tpot, "median_itl_ms": 3 * tpot, "mean_ttft_ms": 8.0, "accept_length": 3.3, "failed": 0}
    return m if window is None else dict(m, window_perf_counter=window)


def write(path, levels):
    with open(path, "w") as f:
        json.dump({"levels": levels}, f)


def test_summary_medians_ratio_and_verdicts(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for r, (t1, t8) in enumerate([(0.220, 0.230), (0.200, 0.260), (0.240, 0.225)], 1):
        write(runs / f"serving-conc1-batch1-r{r}.json", [level(1, 1.0, 1.0, t1)])
        write(runs / f"serving-conc1-batch8-r{r}.json", [level(1, 1.0, 1.0, t8, window=[10.0 * r, 10.0 * r + 1])])
    write(runs / "serving-sweep-batch8.json", [level(c, v, 3000.0, 0.3) for c, v in
                                               ((1, 3000.0), (2, 5000.0), (4, 8500.0), (8, 12300.0))])
    # the batching server's step calls: run 2's window [20, 21] holds calls at 20.1, 20.1008, 20.1020 (intervals
    # 800 and 1200 us), each call 100 us, a read of 300 us in the first interval; 20.5 is > 20 ms after: dropped
    starts = [5.0, 20.1, 20.1008, 20.102, 20.5]
    with open(runs / "steps-batch8.json", "w") as f:
        json.dump({"starts": starts, "ends": [s + 100e-6 for s in starts], "reads": [[20.1002, 20.1005]]}, f)
    s = batching_sweep_summary.summarize(str(tmp_path), "cmd")
    c1 = s["conc1"]
    assert abs(c1["median_ratio"] - 0.230 / 0.220) < 1e-12  # medians 0.220 (batch-1) and 0.230 (batching)
    t = s["targets"]
    assert abs(t["conc8_scaling"]["value"] - 4.1) < 1e-12 and t["conc8_scaling"]["pass"] is True
    assert t["conc1_tpot_ratio"]["pass"] is False  # +4.5 % > 3 %
    split = c1["batch8_split"][1]
    assert split["intervals"] == 2
    assert abs(split["interval_us_median"] - 1000.0) < 1e-3  # median of 800 and 1200
    assert abs(split["call_us_median"] - 100.0) < 1e-3
    assert abs(split["read_us_median"] - 150.0) < 1e-3  # 300 us and 0 us
    assert c1["batch1_split"] == [None, None, None]  # untimed batch-1 server
    assert json.load(open(tmp_path / "summary.json"))["targets"] == t


def test_summary_without_batch1_server(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    write(runs / "serving-sweep-batch8.json", [level(1, 3000.0, 3000.0, 0.3), level(8, 11000.0, 3000.0, 0.5)])
    t = batching_sweep_summary.summarize(str(tmp_path))["targets"]
    assert t["conc1_tpot_ratio"] == {"value": None, "bound": "<= 1.03", "pass": None}
    assert t["conc8_scaling"]["pass"] is False  # 3.67x
