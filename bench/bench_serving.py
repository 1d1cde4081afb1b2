"""Serving benchmark client with SGLang's bench_serving flags: random prompts, streamed requests, TTFT / TPOT /
ITL / E2E / throughput / accept length; prints SGLang's table, writes JSON and a PNG (TPOT histogram + timeline).

    python -m bench.bench_serving --base-url http://127.0.0.1:30000 --backend sglang --dataset-name random \
        --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1 --num-prompts 16 \
        --max-concurrency 1 --tokenizer-free

TPOT excludes the first token: (latency - ttft) / (output_len - 1). ITL is the gap between streamed chunks (a
speculative step delivers several tokens in one chunk). Peak output throughput: most tokens in any 1 s window.
Accept length: the server's spec counters (/get_server_info) over this run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np


@dataclass
class Result:
    prompt_len: int
    output_len: int = 0
    start: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time since benchmark start, tokens)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", choices=["sglang", "openai"], default="sglang")
    p.add_argument("--model", default=None, help="model name for the openai backend (default: the server's)")
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are drawn uniformly from [len * ratio, len]")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into the sampling params / request")
    p.add_argument("--tokenizer-free", action="store_true", help="send random token ids (no tokenizer needed)")
    p.add_argument("--output-file", default=None, help="JSON path (default bench/results/serving-<device>-<date>.json)")
    p.add_argument("--plot-file", default=None, help="PNG path (default: the output file with .png)")
    return p


# ---- prompts and requests ------------------------------------------------------------------------------------


def make_prompts(a, vocab_size: int, tokenizer) -> list[tuple[list[int] | str, int, int]]:
    """(prompt as ids or text, prompt length, output length) per request, SGLang's random dataset."""
    rng = np.random.default_rng(a.seed)
    lo_in = max(1, int(a.random_input_len * a.random_range_ratio))
    lo_out = max(1, int(a.random_output_len * a.random_range_ratio))
    out = []
    for _ in range(a.num_prompts):
        n_in = int(rng.integers(lo_in, a.random_input_len + 1))
        n_out = int(rng.integers(lo_out, a.random_output_len + 1))
        ids = rng.integers(2, vocab_size, n_in).tolist()  # skip 0/1 (pad / eos in the presets)
        out.append((ids if tokenizer is None else tokenizer.decode(ids), n_in, n_out))
    return out


def request_body(a, model: str, prompt, n_out: int, stream: bool = True) -> tuple[str, dict]:
    extra = json.loads(a.extra_request_body) if a.extra_request_body else {}
    sp = {"max_new_tokens": n_out, "temperature": 0.0, "ignore_eos": not a.disable_ignore_eos}
    if a.backend == "sglang":
        key = "text" if isinstance(prompt, str) else "input_ids"
        return "/generate", {key: prompt, "sampling_params": {**sp, **extra}, "stream": stream}
    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0.0,
            "ignore_eos": sp["ignore_eos"], "stream": stream, "stream_options": {"include_usage": True}}
    return "/v1/completions", {**body, **extra}


async def send(client: httpx.AsyncClient, a, model: str, prompt, n_in: int, n_out: int, t0: float) -> Result:
    path, body = request_body(a, model, prompt, n_out)
    res = Result(prompt_len=n_in)
    st = time.perf_counter()
    res.start, last, seen = st - t0, st, 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    res.error = d["error"].get("message", str(d))
                    return res
                if a.backend == "sglang":
                    n_new = len(d["output_ids"]) - seen
                    res.output_len = d["meta_info"]["completion_tokens"]
                    res.prompt_len = d["meta_info"]["prompt_tokens"]
                else:
                    if d.get("usage"):
                        res.output_len = d["usage"]["completion_tokens"]
                        res.prompt_len = d["usage"]["prompt_tokens"]
                    if not d.get("choices"):
                        continue
                    c = d["choices"][0]
                    n_new = len(c["token_ids"]) if "token_ids" in c else int(bool(c.get("text")))
                if n_new <= 0:
                    continue
                now = time.perf_counter()
                if seen == 0:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last)
                res.chunks.append((now - t0, n_new))
                seen += n_new
                last = now
        res.latency = time.perf_counter() - st
        res.output_len = res.output_len or seen
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(a, model: str, prompts) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(a.max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=a.max_concurrency or 100)
    async with httpx.AsyncClient(base_url=a.base_url, timeout=httpx.Timeout(None), limits=limits) as client:
        for p, n_in, _ in prompts[: a.warmup_requests]:  # compiles the prompt bucket, as SGLang's warm-up does
            w = await send(client, a, model, p, n_in, min(16, a.random_output_len), time.perf_counter())
            if w.error:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        rng = random.Random(a.seed)
        t0 = time.perf_counter()

        async def one(p, n_in, n_out):
            async with sem:
                return await send(client, a, model, p, n_in, n_out, t0)

        tasks = []
        for p, n_in, n_out in prompts:
            tasks.append(asyncio.create_task(one(p, n_in, n_out)))
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(a.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


# ---- metrics, table, plot ----------------------------------------------------------------------------------------


def peak_throughput(results: list[Result], window: float = 1.0) -> float:
    """Most output tokens delivered in any `window`-second interval (a window starts at a chunk)."""
    ev = sorted(c for r in results for c in r.chunks)
    best, j, acc = 0, 0, 0
    for i, (t, n) in enumerate(ev):
        acc += n
        while ev[j][0] <= t - window:
            acc -= ev[j][1]
            j += 1
        best = max(best, acc)
    return best / window


def summarize(results: list[Result], duration: float, accept: float | None) -> dict:
    ok = [r for r in results if r.error is None]
    ms = lambda xs: np.asarray(xs, float) * 1e3  # noqa: E731
    ttft, e2e = ms([r.ttft for r in ok]), ms([r.latency for r in ok])
    tpot = ms([r.tpot for r in ok if r.tpot is not None])
    itl = ms([x for r in ok for x in r.itl])
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    m = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
         "total_input_tokens": n_in, "total_output_tokens": n_out,
         "request_throughput": len(ok) / duration, "input_throughput": n_in / duration,
         "output_throughput": n_out / duration, "max_output_tokens_per_s": peak_throughput(ok),
         "total_throughput": (n_in + n_out) / duration,
         "concurrency": float(e2e.sum() / 1e3 / duration) if len(ok) else 0.0, "accept_length": accept}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e_latency", e2e)):
        for stat, f in (("mean", np.mean), ("median", np.median), ("std", np.std), ("p95", lambda x: np.percentile(x, 95)),
                        ("p99", lambda x: np.percentile(x, 99)), ("max", np.max)):
            m[f"{stat}_{name}_ms"] = float(f(xs)) if len(xs) else None
    return m


def table(a, m: dict) -> str:
    f = lambda v, p=2: "n/a" if v is None else f"{v:.{p}f}"  # noqa: E731
    rows = [("=" * 12 + " Serving Benchmark Result " + "=" * 12, None),
            ("Backend:", a.backend), ("Traffic request rate:", a.request_rate),
            ("Max request concurrency:", a.max_concurrency or "not set"),
            ("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Benchmark duration (s):", f(m["duration"])), ("Total input tokens:", m["total_input_tokens"]),
            ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f(m["request_throughput"])),
            ("Input token throughput (tok/s):", f(m["input_throughput"])),
            ("Output token throughput (tok/s):", f(m["output_throughput"])),
            ("Peak output token throughput (tok/s):", f(m["max_output_tokens_per_s"])),
            ("Total token throughput (tok/s):", f(m["total_throughput"])),
            ("Concurrency:", f(m["concurrency"])), ("Accept length:", f(m["accept_length"]))]
    for title, key, stats in (("End-to-End Latency", "e2e_latency", ("mean", "median", "p99")),
                              ("Time to First Token", "ttft", ("mean", "median", "p99")),
                              ("Time per Output Token (excl. 1st token)", "tpot", ("mean", "median", "p99")),
                              ("Inter-Token Latency", "itl", ("mean", "median", "p95", "p99", "max"))):
        rows.append((f"{title:-^50}", None))
        label = {"e2e_latency": "E2E Latency"}.get(key, key.upper())
        rows += [(f"{s.capitalize() if s in ('mean', 'median', 'max') else s.upper()} {label} (ms):",
                  f(m[f"{s}_{key}_ms"])) for s in stats]
    rows.append(("=" * 50, None))
    return "\n".join(k if v is None else f"{k:<40} {v:<10}" for k, v in rows)


def plot(results: list[Result], m: dict, path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    fig, (h, t) = plt.subplots(1, 2, figsize=(13, 4.5))
    tpot = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    h.hist(tpot, bins=min(40, max(5, len(tpot))), color="tab:blue")
    if m["mean_tpot_ms"] is not None:
        h.axvline(m["mean_tpot_ms"], color="k", ls="--", label=f"mean {m['mean_tpot_ms']:.2f} ms")
        h.legend()
    h.set(xlabel="TPOT per request (ms, excl. 1st token)", ylabel="requests", title="TPOT distribution")
    for i, r in enumerate(ok):
        t.broken_barh([(r.start, r.ttft), (r.start + r.ttft, r.latency - r.ttft)], (i - 0.4, 0.8),
                      facecolors=("tab:orange", "tab:blue"))
    t.set(xlabel="time since start (s)", ylabel="request", title="timeline: TTFT (orange), decode (blue)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------------------------


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def _spec_counters(info: dict) -> tuple[int, int, float]:
    s = (info.get("internal_states") or [{}])[0]
    return s.get("spec_verify_ct_total", 0), s.get("spec_accept_tokens_total", 0), s.get("avg_spec_accept_length")


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    a.base_url = (a.base_url or f"http://{a.host}:{a.port}").rstrip("/")
    info = httpx.get(a.base_url + "/get_server_info", timeout=30).json()
    model = a.model or info.get("served_model_name") or info.get("model_path")
    tokenizer = None
    if not a.tokenizer_free:
        from ling_jax.tokenizer import load_tokenizer

        path = info.get("model_path", "")
        tokenizer = load_tokenizer(path) if os.path.isdir(path) else None
        if tokenizer is None:
            print("error: no tokenizer for the server's model here; use --tokenizer-free", file=sys.stderr)
            return 2
    vocab = info.get("vocab_size") or (tokenizer.tok.get_vocab_size() if tokenizer else 32000)
    prompts = make_prompts(a, vocab, tokenizer)
    v0, t0_acc, _ = _spec_counters(info)
    results, duration = asyncio.run(run(a, model, prompts))
    info = httpx.get(a.base_url + "/get_server_info", timeout=30).json()
    v1, t1_acc, avg = _spec_counters(info)
    accept = (t1_acc - t0_acc) / (v1 - v0) if v1 > v0 else avg
    m = summarize(results, duration, accept)
    print(table(a, m))
    for r in results:
        if r.error:
            print("failed:", r.error, file=sys.stderr)

    date = time.strftime("%Y-%m-%d-%H%M%S")
    device = info.get("device", "unknown").replace(" ", "").replace("/", "-").lower()
    out = a.output_file or os.path.join("bench", "results", f"serving-{device}-{date}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    record = {"command": shlex.join([sys.executable, "-m", "bench.bench_serving", *(argv or sys.argv[1:])]),
              "date": date, "git_commit": _git_commit(), "device": info.get("device"),
              "jax_version": info.get("jax_version"), "args": vars(a), "server_info": info, **m,
              "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
              "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
              "requests": [{k: v for k, v in asdict(r).items() if k not in ("itl", "chunks")} for r in results]}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    png = a.plot_file or os.path.splitext(out)[0] + ".png"
    plot(results, m, png, f"{info.get('model_path')} on {info.get('device')}, {info.get('speculative_algorithm')}, "
                          f"in {a.random_input_len} / out {a.random_output_len}, concurrency {a.max_concurrency}")
    print(f"wrote {out} and {png}", file=sys.stderr)
    return 0 if m["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
