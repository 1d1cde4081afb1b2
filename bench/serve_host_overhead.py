"""The serving path's host cost per step, without the model: the real server (serve.launch_server, uvicorn, the
engine, the BatchGenerator's scheduler) with the prefill chunk and the decode step replaced by trivial programs
(the step emits --accept tokens per row and touches one [B] leaf of the state; AliasedStep's two dispatches, the
donated state and StepOutput's shapes stay), driven by bench_serving (/generate, streamed, 128 in / 256 out). The
H200's step is host-bound (~1 ms of host time per call for ~0.37 ms of kernels: bench/dispatch_probe.py), so the
dispatch is emulated too: each step call then holds the GIL --dispatch-held-us (a busy loop) and sleeps
--dispatch-us (off the GIL). Every server (this tree, --baseline's, x the --levels' --max-running-requests) is up
at once and measured in alternating rounds (a shared host drifts); per level: bench_serving's mean TPOT and median
ITL, the server's CPU time and voluntary context switches per token (from /proc, per thread), and per server the
median dispatch-to-dispatch interval of the step calls (the per-step host cost, robust to the host's noise).

    python3 -m bench.serve_host_overhead --dispatch-held-us 400 --dispatch-us 200 --levels 1:1,8:1,8:8 \
        --baseline OLD_TREE --out $OUT
    python3 -m bench.serve_host_overhead --in-process    # Generator.stream vs BatchGenerator.stream, no server
    python3 -m bench.serve_host_overhead --real-step --dtype bfloat16 --vlog --levels 1:1,8:1,8:8 --out $OUT  # GPU

--real-step: the real model (no trivial programs, no knobs): on the GPU, each level's step interval split into the
step program's call (its host dispatch: jaxlib's argument handling, XLA's command-buffer update when one is
re-recorded, the launch), the one-step-late read (device_get: the wait for the device where the host is ahead)
and the rest (the Python of the turn / the stream, the consumers, GIL waits); --vlog adds XLA's count of
command-buffer re-recordings per server (its log), against the server's step calls.

Found with it (CPU, 2026-12-02; bench/results/serve-host-overhead-cpu-2026-12-02.json: this tree vs e81b80e in the
same 10 rounds; *-before-14rounds / *-after-14rounds.json: each alone): the batching server ran each request's
stream in an engine thread fed by a queue from the scheduler, so every step woke one more thread between the
scheduler and the event loop than the batch-1 server does (voluntary switches per token 2.1 vs 1.3). With the
GIL held during the dispatch, the lone request's step took +184 / +244 us (two runs) dispatch to dispatch over the
batch-1 server's (the H200's +22 % TPOT was ~+200 us per ~1 ms step), server CPU per token +14 / +17 %; with the
dispatch off the GIL the extra thread hid (TPOT equal, CPU +14 %). Now the scheduler runs the request's consumer
itself (serve.engine.Decoding): -40 / +85 us per step (identical trees differ by ~5 % here), CPU -2 / +1 %,
switches equal; at concurrency 8 TPOT 1462 vs 1953 us, CPU per token 163 vs 222 us.

Again on 2026-12-07 (CPU, --dispatch-held-us 400 --dispatch-us 200, 6 rounds, this tree with the lone-row start
vs main before it; bench/results/serve-host-overhead-cpu-2026-12-07-vs-main.json): the lone row's step interval
over the batch-1 server's, medians, +41 us (1047.5 vs 1006.1; TPOT 361 vs 341 us) here, +16 us (1017.8 vs 1001.6)
on main; a second and third run of this tree +28 / +17 us. All of it is inside the step call, none in the Python
around it (rest 82-95 us both; bench.batching_host in process: 63 vs 60 us of host per step). The calls are
bimodal, ~800 us or ~920 us: in a slow one the event loop's thread, woken by the turn's hand-off ~22 us (batch 1)
or ~25 us (batched) before the call, takes the GIL while the trivial program's execute has released it (the
deliveries start ~80 us into the call) and the call waits for the loop's work; in a fast one the loop waits
through the busy loop and runs in the sleep. Slow calls: 58-61 % batch 1, 74-83 % batched. This is the knobs'
race (where the GIL-free part of a dispatch falls), not work the batched server adds; the real step's split on a
GPU is bench/batching_sweep.sh --timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_FLAGS = ["--model-path", "models/ling-demo", "--context-length", "2048", "--speculative-algorithm", "NEXTN",
                "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
BENCH_FLAGS = ["--backend", "sglang", "--dataset-name", "random", "--tokenizer-free", "--random-input-len", "128",
               "--random-output-len", "256", "--random-range-ratio", "1", "--seed", "1"]


class SlowDispatch:
    """A step program whose call also spends `held_s` holding the GIL (a busy loop), then `seconds` off it
    (time.sleep), as the GPU step's dispatch does (jaxlib's argument handling under the GIL; XLA's command-buffer
    update and launch, ~0.5-1 ms of host time on the H200, with the GIL released: which part is which is not known
    here, so both are knobs). Both 0: the program as it is, its calls only timed."""

    starts: list[float] = []  # per call: when it began (perf_counter: CLOCK_MONOTONIC, the harness's clock too)
    ends: list[float] = []  # per call: when it returned

    def __init__(self, step, seconds: float, held_s: float = 0.0):
        self.step, self.seconds, self.held_s = step, seconds, held_s

    def __call__(self, params, state):
        SlowDispatch.starts.append(time.perf_counter())
        out = self.step(params, state)
        if self.held_s > 0:
            t = time.perf_counter()
            while time.perf_counter() - t < self.held_s:  # host work that keeps the GIL
                pass
        if self.seconds > 0:
            time.sleep(self.seconds)
        SlowDispatch.ends.append(time.perf_counter())
        return out

    def __getattr__(self, name):
        return getattr(self.step, name)


READS: list[tuple[float, float]] = []  # (start, end) of every jax.device_get in the server (the one-step-late reads)


def timed_steps(dispatch_s: float = 0.0, held_s: float = 0.0):
    """Every step program's call (batch 1 and the B-row ones) through SlowDispatch (timed; with the knobs, slowed),
    and every jax.device_get timed into READS: the server's per-step host split into the program call, the read
    (a wait for the device where the host is ahead) and the rest. Patches the classes: for this bench's own
    processes only."""
    import functools

    import jax

    from ling_jax.batching import BatchGenerator
    from ling_jax.runner import Generator

    step_program, batch_program = Generator.step_program.__wrapped__, BatchGenerator.batch_program.__wrapped__
    Generator.step_program = functools.lru_cache(maxsize=None)(
        lambda self, *a: SlowDispatch(step_program(self, *a), dispatch_s, held_s))
    BatchGenerator.batch_program = functools.lru_cache(maxsize=None)(  # rows = 1 is Generator.step_fn's
        lambda self, rows, *a: batch_program(self, rows, *a) if rows == 1
        else SlowDispatch(batch_program(self, rows, *a), dispatch_s, held_s))
    get = jax.device_get

    def device_get(x):
        t = time.perf_counter()
        try:
            return get(x)
        finally:
            READS.append((t, time.perf_counter()))

    jax.device_get = device_get


def trivial_steps(accept: int, dispatch_s: float = 0.0, held_s: float = 0.0):
    """Replace Generator.step (the un-jitted step every step program wraps) by one that emits `accept` tokens per
    row (ids that move with the state's bonus token, so the text changes) and advances only the bonus leaf, and the
    prefill chunk (Generator.prefill_chunk: prefill_fn's and BatchGenerator.start_fn's programs) by one that only
    sets the bonus token (the first token: from the prompt's last one); every step program's call (batch 1 and the
    B-row ones) then also holds the GIL held_s and sleeps dispatch_s (SlowDispatch; timed_steps does that part
    alone when given the knobs). Patches the classes: for this bench's own processes only."""
    import functools

    import jax
    import jax.numpy as jnp

    from ling_jax.runner import Generator
    from ling_jax.spec import StepOutput

    if dispatch_s > 0 or held_s > 0:
        timed_steps(dispatch_s, held_s)

    real = Generator.step

    def step(self, is_greedy: bool, with_logprobs: bool, adjusts_logits: bool = True):
        real_step = real(self, is_greedy, with_logprobs, adjusts_logits)
        vocab, width = self.cfg.vocab_size, self.K + 1

        def fake(params, state):
            b = state.bonus.shape[0]
            tokens = (state.bonus[:, None] + jnp.arange(width, dtype=jnp.int32)) % (vocab - 16) + 16
            lp = None
            if with_logprobs:
                shapes = jax.eval_shape(real_step, params, state)[1].logprobs
                lp = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            state = state.replace(bonus=(state.bonus + accept) % vocab)
            return state, StepOutput(tokens, jnp.full((b,), accept, jnp.int32), lp)

        return fake

    Generator.step = step
    real_chunk_of = Generator.prefill_chunk

    def prefill_chunk(self, is_greedy: bool):
        real_chunk = real_chunk_of(self, is_greedy)

        def chunk(params, state, tokens, next_token, n_prompt):
            lp = jax.eval_shape(real_chunk, params, state, tokens, next_token, n_prompt)[2]
            first = (tokens[:, -1] + n_prompt) % (self.cfg.vocab_size - 16) + 16
            return (state.replace(bonus=first), first, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), lp))

        return chunk

    # the chunk function itself, not only prefill_fn's program: BatchGenerator.start_fn (a new request's init + first
    # chunk in one program) wraps it too, and with only prefill_fn patched every batched request ran the real
    # model's prefill (~1.4 s per 128-token prompt on a 2-core CPU host: the batching server's TTFT and "other"
    # threads' CPU in this bench were that prefill)
    Generator.prefill_chunk = prefill_chunk


def in_process(a):
    import jax.numpy as jnp

    from bench.batching_lone import per_token_us
    from ling_jax.batching import BatchGenerator
    from ling_jax.config import load_config
    from ling_jax.runner import Generator
    from ling_jax.spec import SpecConfig
    from ling_jax.weights import load_params

    trivial_steps(a.accept, a.dispatch_us * 1e-6, a.dispatch_held_us * 1e-6)
    cfg = load_config(a.model)
    params = load_params(cfg, a.model, dtype=jnp.float32)
    gen = Generator(cfg, params, spec=SpecConfig("NEXTN", 3), max_len=2048, dtype=jnp.float32)
    batcher = BatchGenerator(gen, 8)
    rows = []
    for _ in range(2):
        for name, g in (("Generator", gen), ("BatchGenerator", batcher)):
            t = per_token_us(g, 256, a.reps)
            rows.append({"path": name, "median_us_per_token": float(np.median(t))})
            print(f"{name:15s} {np.median(t):8.1f} us/token (median of {len(t)})", flush=True)
    return rows


def serve(argv):
    """The real server, with the trivial step (its own process: run by `run_server`)."""
    import threading

    from serve import launch_server

    accept, dispatch_us, held_us, steps_path = int(argv.pop(0)), float(argv.pop(0)), float(argv.pop(0)), argv.pop(0)
    timed_steps(dispatch_us * 1e-6, held_us * 1e-6)  # every step call and read timed (and slowed by the knobs)
    if accept > 0:  # else: the real model (--real-step)
        trivial_steps(accept)

    def name_threads():  # OS thread id -> Python thread name, for the harness's /proc reading
        while True:
            names = {t.native_id: t.name for t in threading.enumerate()}
            with open(steps_path + ".threads.tmp", "w") as f:
                json.dump(names, f)
            os.replace(steps_path + ".threads.tmp", steps_path + ".threads")
            time.sleep(1)

    threading.Thread(target=name_threads, name="bench-names", daemon=True).start()
    rc = launch_server.main(argv)
    with open(steps_path, "w") as f:
        json.dump({"starts": SlowDispatch.starts, "ends": SlowDispatch.ends, "reads": READS}, f)
    sys.exit(rc)


def run_server(a, code: str, max_running: int, port: int, log_path: str, steps_path: str):
    """The bench's server (`--serve`) from the source tree `code`, on `port`, once /health answers."""
    # this file's --serve (its timers, its trivial step) over the tree's packages: a --baseline tree need not have
    # this version of the bench
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=code)
    if a.vlog:  # XLA's command-buffer log: one "Update command buffer" line per re-recording of a step's graph
        env.update(TF_CPP_VMODULE="command_buffer_thunk=3", TF_CPP_MIN_LOG_LEVEL="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", str(0 if a.real_step else a.accept),
           str(a.dispatch_us), str(a.dispatch_held_us), steps_path, "--port", str(port),
           "--dtype", a.dtype, "--max-running-requests", str(max_running), *SERVER_FLAGS]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT)
    import httpx

    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not ready: see {log_path}")


def thread_counters(pid: int) -> dict[int, tuple[float, int, int]]:
    """tid -> (CPU seconds, voluntary, involuntary context switches) of every thread of process pid."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                st = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except FileNotFoundError:
            continue
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / tick, int(st["voluntary_ctxt_switches"]),
                         int(st["nonvoluntary_ctxt_switches"]))
    return out


def cpu_by_thread(before: dict, after: dict, names: dict, tokens: int) -> dict[str, list[float]]:
    """Python thread name (or 'other': XLA's, uvicorn's C threads) -> [CPU us, voluntary switches, involuntary
    switches] per generated token between two thread_counters readings."""
    out: dict[str, list[float]] = {}
    for tid, (cpu, vol, inv) in after.items():
        c0, v0, i0 = before.get(tid, (0.0, 0, 0))
        name = names.get(str(tid), "other")
        name = "engine-stream" if name.startswith("engine-stream") else name
        acc = out.setdefault(name, [0.0, 0.0, 0.0])
        for k, d in enumerate((1e6 * (cpu - c0), vol - v0, inv - i0)):
            acc[k] += d / tokens
    return out


def over_http(a):
    """Every server (source tree x --max-running) up at once (an idle one sleeps), then rounds of bench_serving
    against each in turn, so a drift of a shared host shows in all of them."""
    os.makedirs(a.out, exist_ok=True)
    trees = {"this": ROOT, **({"baseline": os.path.abspath(a.baseline)} if a.baseline else {})}
    levels = [tuple(int(x) for x in lv.split(":")) for lv in a.levels.split(",")]
    servers, rows = {}, []
    try:
        for name, code in trees.items():
            for n in sorted({n for n, _ in levels}):
                tag = f"{name}-{n}"
                steps = os.path.join(a.out, f"steps-{tag}.json")
                port = a.port + len(servers)
                servers[tag] = (run_server(a, code, n, port, os.path.join(a.out, f"server-{tag}.log"), steps), port,
                                steps)
        order = [(name, n, conc) for name in trees for n, conc in levels]
        for rnd in range(a.rounds):  # every other round in reverse: no server is always measured first
            for name, n, conc in order if rnd % 2 == 0 else order[::-1]:
                rows.append(one_level(a, name, n, conc, rnd, *servers[f"{name}-{n}"]))
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
        for proc, _, _ in servers.values():
            proc.wait(30)
    print("\nmedian over rounds: TPOT (bench_serving's mean) | median ITL | server CPU per token | voluntary "
          "switches per token")
    for name in trees:
        for n, conc in levels:
            rs = [r for r in rows if (r["tree"], r["max_running"], r["concurrency"]) == (name, n, conc)]
            cpu = [sum(v[0] for v in r["per_token_by_thread"].values()) for r in rs]
            vol = [sum(v[1] for v in r["per_token_by_thread"].values()) for r in rs]
            print(f"  {name:8s} --max-running-requests {n} concurrency {conc}: TPOT "
                  f"{1e3 * np.median([r['mean_tpot_ms'] for r in rs]):7.1f} us | "
                  f"{1e3 * np.median([r['median_itl_ms'] for r in rs]):7.1f} us | CPU {np.median(cpu):6.1f} us | "
                  f"{np.median(vol):5.2f}")
    print("per step (between two step calls of the level's runs, within a request's decoding; medians in us): the "
          "interval | the step program's call | the reads (device_get) | the rest (the Python around them)")
    for name in trees:
        for n, conc in levels:
            with open(servers[f"{name}-{n}"][2]) as f:
                timed = json.load(f)
            rs = [r for r in rows if (r.get("tree"), r.get("max_running"), r.get("concurrency")) == (name, n, conc)]
            split = step_split(timed, [r["window"] for r in rs])
            rows.append({"tree": name, "max_running": n, "concurrency": conc, **split})
            print(f"  {name:8s} --max-running-requests {n} concurrency {conc}: {split['interval_us_median']:7.1f} | "
                  f"{split['call_us_median']:7.1f} | {split['read_us_median']:7.1f} | {split['rest_us_median']:7.1f}"
                  f"  (interval p25 {split['interval_us_p25']:7.1f}; {split['intervals']} intervals; knobs "
                  f"{a.dispatch_held_us:.0f} us held + {a.dispatch_us:.0f} us asleep in each call)")
    if a.vlog:
        print("XLA command-buffer re-recordings (\"Update command buffer\" lines of each server's log, whole run; by "
              "num_commands, the biggest graphs first) vs the server's step calls:")
        for tag, (_, _, steps_path) in servers.items():
            with open(steps_path) as f:
                calls = len(json.load(f)["starts"])
            counts = vlog_updates(os.path.join(a.out, f"server-{tag}.log"))
            rows.append({"server": tag, "step_calls": calls, "command_buffer_updates": counts})
            print(f"  {tag}: {calls} step calls; updates " + ", ".join(f"{k} commands: {v}" for k, v in
                                                                     sorted(counts.items(), key=lambda kv: -kv[0])[:6]))
    return rows


def step_split(timed: dict, windows) -> dict:
    """Each interval between two consecutive step calls inside the windows (< 20 ms: not across requests), split
    into the first call's duration, the reads that began inside the interval, and the rest; medians (us)."""
    starts, ends = np.array(timed["starts"]), np.array(timed["ends"])
    reads = np.array(timed.get("reads") or np.zeros((0, 2)))
    out = {"interval": [], "call": [], "read": [], "rest": []}
    for w0, w1 in windows:
        idx = np.nonzero((starts >= w0) & (starts <= w1))[0]
        for i, j in zip(idx[:-1], idx[1:]):
            gap = starts[j] - starts[i]
            if j != i + 1 or gap >= 20e-3:
                continue
            inside = (reads[:, 0] >= starts[i]) & (reads[:, 0] < starts[j]) if len(reads) else np.zeros(0, bool)
            read = float(np.sum(np.minimum(reads[inside, 1], starts[j]) - reads[inside, 0])) if inside.any() else 0.0
            call = ends[i] - starts[i]
            for k, v in (("interval", gap), ("call", call), ("read", read), ("rest", gap - call - read)):
                out[k].append(1e6 * v)
    res = {f"{k}_us_median": float(np.median(v)) if v else float("nan") for k, v in out.items()}
    res["interval_us_p25"] = float(np.percentile(out["interval"], 25)) if out["interval"] else float("nan")
    res["intervals"] = len(out["interval"])
    return res


def vlog_updates(log_path: str) -> dict[int, int]:
    """num_commands -> how many "Update command buffer" lines (XLA re-recorded that command buffer) the log holds."""
    import re

    counts: dict[int, int] = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            if "Update command buffer" in line:
                m = re.search(r"num_commands=(\d+)", line)
                k = int(m.group(1)) if m else -1
                counts[k] = counts.get(k, 0) + 1
    return counts


def one_level(a, tree: str, max_running: int, conc: int, rnd: int, proc, port: int, steps_path: str) -> dict:
    out = os.path.join(a.out, f"bench-{tree}-{max_running}-c{conc}-{rnd}.json")
    before, t0 = thread_counters(proc.pid), time.perf_counter()  # CLOCK_MONOTONIC: the server's clock too
    subprocess.run([sys.executable, "-m", "bench.bench_serving", "--port", str(port), *BENCH_FLAGS,
                    "--max-concurrency", str(conc), "--num-prompts", str(a.num_prompts * conc), "--output-file",
                    out], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after, t1 = thread_counters(proc.pid), time.perf_counter()
    with open(out) as f:
        m = json.load(f)
    with open(steps_path + ".threads") as f:
        names = json.load(f)
    per_thread = cpu_by_thread(before, after, names, m["total_output_tokens"])
    total = sum(v[0] for v in per_thread.values())
    threads = ", ".join(f"{k} {v[0]:.1f} us / {v[1]:.2f} vol / {v[2]:.2f} invol"
                        for k, v in sorted(per_thread.items()) if v[0] > 0.5 or v[1] > 0.05)
    print(f"{tree:8s} max-running {max_running} concurrency {conc} round {rnd}: TPOT {1e3 * m['mean_tpot_ms']:7.1f} "
          f"us (median {1e3 * m['median_tpot_ms']:7.1f}), median ITL {1e3 * m['median_itl_ms']:7.1f} us, TTFT "
          f"{m['mean_ttft_ms']:6.2f} ms, {m['output_throughput']:6.0f} tok/s; server CPU per token {total:6.1f} us: "
          f"{threads}", flush=True)
    return {"tree": tree, "max_running": max_running, "concurrency": conc, "round": rnd, "window": (t0, t1),
            "mean_tpot_ms": m["mean_tpot_ms"], "median_tpot_ms": m["median_tpot_ms"],
            "median_itl_ms": m["median_itl_ms"], "mean_ttft_ms": m["mean_ttft_ms"],
            "output_throughput": m["output_throughput"], "per_token_by_thread": per_thread}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--serve":
        return serve(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/ling-demo")
    p.add_argument("--accept", type=int, default=3, help="tokens each trivial step emits")
    p.add_argument("--dispatch-us", type=float, default=0.0,
                   help="host time off the GIL each step program's call spends (SlowDispatch)")
    p.add_argument("--dispatch-held-us", type=float, default=0.0,
                   help="host time each step program's call spends holding the GIL (before the --dispatch-us)")
    p.add_argument("--real-step", action="store_true",
                   help="the real model's programs (on a GPU), only timed: the per-step split of the real servers")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the servers' --dtype")
    p.add_argument("--vlog", action="store_true",
                   help="XLA's command-buffer VLOG in the server logs; counts the step graphs' re-recordings")
    p.add_argument("--in-process", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=12, help="per level: times its concurrency")
    p.add_argument("--port", type=int, default=30311)
    p.add_argument("--levels", default="1:1,8:1", help="max-running:concurrency pairs to measure")
    p.add_argument("--baseline", default=None, help="another source tree (e.g. the code before a change) whose "
                   "servers are measured in the same rounds")
    p.add_argument("--out", default="/tmp/serve-host-overhead")
    a = p.parse_args(argv)
    rows = in_process(a) if a.in_process else over_http(a)
    if a.out and not a.in_process:
        import jax

        from bench.bench_step import write

        print("wrote", write(a.out, "serve-host-overhead", rows, {"accept": None if a.real_step else a.accept,
                                                    "real_step": a.real_step, "dtype": a.dtype,
                                                    "dispatch_us": a.dispatch_us,
                                                    "dispatch_held_us": a.dispatch_held_us, "levels": a.levels,
                                                    "baseline": a.baseline},
                             jax.devices()[0].device_kind.replace(" ", "-"),
                             "python3 -m bench.serve_host_overhead " + " ".join(argv)))


if __name__ == "__main__":
    main()
