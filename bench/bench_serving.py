"""Serving benchmark client with SGLang's bench_serving flags: random or ShareGPT prompts, streamed requests over
SGLang's /generate (--backend sglang), /v1/completions (sglang-oai) or /v1/chat/completions (sglang-oai-chat);
TTFT / TPOT / ITL / E2E / throughput / accept length; prints SGLang's table, writes JSON and a PNG (TPOT histogram
+ timeline).

    python -m bench.bench_serving --base-url http://127.0.0.1:30000 --backend sglang --dataset-name random \
        --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --tokenizer models/ling-demo \
        --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1 --num-prompts 16 --max-concurrency 1

Datasets (SGLang's): `sharegpt` takes each conversation's first turn as the prompt and the second's token count
as the output length (--sharegpt-output-len fixes it); `random` takes token ids from those real prompts,
repeated or cut to the drawn input length, so the text re-encodes to about that length. Without a tokenizer
(--tokenizer-free, or a server without one) `random` sends random token ids instead. The tokenizer: --tokenizer,
else the server's /model_info tokenizer_path when that exists here. OPENAI_API_KEY is sent as the Bearer key.

TPOT excludes the first token: (latency - ttft) / (output_len - 1). ITL is the gap between streamed chunks (a
speculative step delivers several tokens in one chunk). Peak output throughput: most tokens in any 1 s window.
Accept length: the server's spec counters (/server_info) over this run.
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", choices=list(BACKENDS), default="sglang")
    p.add_argument("--model", default=None, help="model name for the OpenAI backends (default: the server's)")
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (the prompts of both datasets)")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    p.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="drop sharegpt requests longer than this (default: the server's context length)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (tokenizer.json); default: the server's")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are drawn uniformly from [len * ratio, len]")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--concurrency-sweep", default=None,
                   help="comma-separated concurrencies (e.g. 1,2,4,8): one run per level with max(--num-prompts, "
                        "2 x level) prompts; one JSON + PNG of output throughput and TPOT per level")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into the sampling params / request")
    p.add_argument("--tokenizer-free", action="store_true",
                   help="send random token ids (no tokenizer needed; random dataset, sglang / sglang-oai backends)")
    p.add_argument("--output-file", default=None, help="JSON path (default bench/results/serving-<device>-<date>.json)")
    p.add_argument("--plot-file", default=None, help="PNG path (default: the output file with .png)")
    return p


# ---- prompts and requests ------------------------------------------------------------------------------------

# backend -> path; "openai" is this client's older name for sglang-oai
BACKENDS = {"sglang": "/generate", "sglang-oai": "/v1/completions", "openai": "/v1/completions",
            "sglang-oai-chat": "/v1/chat/completions"}


def sharegpt_prompts(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of every ShareGPT conversation with at least two turns, in file order."""
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for d in data:
        turns = d.get("conversations", d.get("conversation", []))
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path}: no conversation with two turns (ShareGPT format: "
                         f'[{{"conversations": [{{"from": "human", "value": ...}}, ...]}}])')
    return pairs


def make_prompts(a, vocab_size: int, tokenizer) -> list[tuple[list[int] | str, int, int]]:
    """(prompt as ids or text, prompt length, output length) per request, SGLang's datasets."""
    rng = np.random.default_rng(a.seed)
    if a.dataset_name == "sharegpt":
        return _sharegpt(a, tokenizer, rng)
    lo_in = max(1, int(a.random_input_len * a.random_range_ratio))
    lo_out = max(1, int(a.random_output_len * a.random_range_ratio))
    lens = [(int(rng.integers(lo_in, a.random_input_len + 1)), int(rng.integers(lo_out, a.random_output_len + 1)))
            for _ in range(a.num_prompts)]
    if tokenizer is None:  # no text to sample from: random ids, skipping 0/1 (pad / eos in the presets)
        return [(rng.integers(2, vocab_size, n_in).tolist(), n_in, n_out) for n_in, n_out in lens]
    pairs = sharegpt_prompts(a.dataset_path)
    order = rng.permutation(len(pairs))
    out, k = [], 0
    for n_in, n_out in lens:
        ids = []
        while not ids:  # skip prompts that encode to nothing
            ids = tokenizer.encode(pairs[order[k % len(order)]][0])
            k += 1
        ids = (ids * -(-n_in // len(ids)))[:n_in]  # real token ids, repeated or cut to the drawn length
        out.append((tokenizer.decode(ids), n_in, n_out))
    return out


def _sharegpt(a, tokenizer, rng) -> list:
    pairs = sharegpt_prompts(a.dataset_path)
    out = []
    for idx in rng.permutation(len(pairs)):
        if len(out) == a.num_prompts:
            break
        prompt, completion = pairs[idx]
        n_in = len(tokenizer.encode(prompt))
        n_out = a.sharegpt_output_len or len(tokenizer.encode(completion))
        if n_in >= 2 and n_out >= 2 and n_in + n_out <= a.sharegpt_context_len:  # SGLang's pruning
            out.append((prompt, n_in, n_out))
    return out


def request_body(a, model: str, prompt, n_out: int, stream: bool = True) -> tuple[str, dict]:
    extra = json.loads(a.extra_request_body) if a.extra_request_body else {}
    sp = {"max_new_tokens": n_out, "temperature": 0.0, "ignore_eos": not a.disable_ignore_eos}
    path = BACKENDS[a.backend]
    if a.backend == "sglang":
        key = "text" if isinstance(prompt, str) else "input_ids"
        return path, {key: prompt, "sampling_params": {**sp, **extra}, "stream": stream}
    body = {"model": model, "temperature": 0.0, "ignore_eos": sp["ignore_eos"], "stream": stream,
            "stream_options": {"include_usage": True}}
    if a.backend == "sglang-oai-chat":
        body.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=n_out)
    else:
        body.update(prompt=prompt, max_tokens=n_out)
    return path, {**body, **extra}


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
                    piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                    n_new = len(c["token_ids"]) if "token_ids" in c else int(bool(piece))
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
    async with httpx.AsyncClient(base_url=a.base_url, timeout=httpx.Timeout(None), limits=limits,
                                 headers=auth_headers()) as client:
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


def auth_headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY")  # as SGLang's client
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get(a, path: str) -> dict:
    r = httpx.get(a.base_url + path, timeout=30, headers=auth_headers())
    r.raise_for_status()
    return r.json()


def load_bench_tokenizer(a):
    """--tokenizer, else the server's tokenizer_path when it is a dir here; None for --tokenizer-free."""
    from ling_jax.tokenizer import load_tokenizer

    if a.tokenizer_free:
        return None
    path = a.tokenizer or _get(a, "/model_info").get("tokenizer_path") or ""
    tok = load_tokenizer(path) if os.path.isdir(path) else None
    if tok is None:
        raise ValueError(f"no tokenizer.json at '{path}': pass --tokenizer DIR (or --tokenizer-free)")
    return tok


def check_args(a, tokenizer):
    if a.dataset_name == "sharegpt" and tokenizer is None:
        raise ValueError("--dataset-name sharegpt needs a tokenizer (its prompts are text)")
    if (a.dataset_name == "sharegpt" or tokenizer is not None) and not a.dataset_path:
        raise ValueError("--dataset-path (a ShareGPT-format JSON) is needed: the random dataset samples its token "
                         "ids from real prompts (SGLang downloads ShareGPT; this client does not)")
    if a.backend == "sglang-oai-chat" and tokenizer is None:
        raise ValueError("--backend sglang-oai-chat sends text: it needs a tokenizer, not --tokenizer-free")


def sweep_levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency-sweep takes positive integers separated by commas, got {spec!r}")
    return levels


def plot_sweep(levels: list[dict], path: str, title: str):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [m["max_concurrency"] for m in levels]
    fig, (th, tp) = plt.subplots(1, 2, figsize=(11, 4))
    th.plot(c, [m["output_throughput"] for m in levels], "o-")
    th.set(xlabel="concurrency", ylabel="output tokens / s", title="output throughput", xscale="log", xticks=c)
    th.set_xticklabels([str(x) for x in c])
    th.set_ylim(bottom=0)
    tp.plot(c, [m["mean_tpot_ms"] for m in levels], "o-", label="mean")
    tp.plot(c, [m["p99_tpot_ms"] for m in levels], "s--", label="p99")
    tp.set(xlabel="concurrency", ylabel="ms", title="TPOT", xscale="log", xticks=c)
    tp.set_xticklabels([str(x) for x in c])
    tp.set_ylim(bottom=0)
    tp.legend()
    for ax in (th, tp):
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(a, argv, model: str, tokenizer, vocab: int, info: dict) -> int:
    """One run per --concurrency-sweep level against the same server; a summary row per level."""
    levels = []
    for c in sweep_levels(a.concurrency_sweep):
        a.max_concurrency, n = c, a.num_prompts
        a.num_prompts = max(n, 2 * c)
        v0, t0_acc, _ = _spec_counters(_get(a, "/server_info"))
        w0 = time.perf_counter()
        results, duration = asyncio.run(run(a, model, make_prompts(a, vocab, tokenizer)))
        w1 = time.perf_counter()
        a.num_prompts = n
        v1, t1_acc, avg = _spec_counters(_get(a, "/server_info"))
        m = summarize(results, duration, (t1_acc - t0_acc) / (v1 - v0) if v1 > v0 else avg)
        # the level's span on this host's CLOCK_MONOTONIC (perf_counter), which a timed server shares
        # (bench/serve_host_overhead.step_split: the server's per-step split within it)
        levels.append({"max_concurrency": c, **m, "window_perf_counter": [w0, w1]})
        print(f"concurrency {c:3d}: output {m['output_throughput']:9.1f} tok/s  mean TPOT {m['mean_tpot_ms']:.2f} ms"
              f"  p99 {m['p99_tpot_ms']:.2f} ms  TTFT {m['mean_ttft_ms']:.1f} ms  accept {m['accept_length'] or 0:.2f}"
              f"  failed {m['failed']}", flush=True)
    base = levels[0]["output_throughput"]
    for m in levels:
        m["throughput_vs_first_level"] = m["output_throughput"] / base if base else None
    date = time.strftime("%Y-%m-%d-%H%M%S")
    device = info.get("device", "unknown").replace(" ", "").replace("/", "-").lower()
    out = a.output_file or os.path.join("bench", "results", f"serving-sweep-{device}-{date}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    record = {"command": shlex.join([sys.executable, "-m", "bench.bench_serving", *(argv or sys.argv[1:])]),
              "date": date, "git_commit": _git_commit(), "device": info.get("device"),
              "jax_version": info.get("jax_version"), "args": vars(a), "server_info": info, "levels": levels}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    png = a.plot_file or os.path.splitext(out)[0] + ".png"
    plot_sweep(levels, png, f"{info.get('model_path')} on {info.get('device')}, {info.get('speculative_algorithm')}, "
                            f"max running {info.get('max_running_requests')}, in {a.random_input_len} / out "
                            f"{a.random_output_len}")
    print(f"wrote {out} and {png}", file=sys.stderr)
    return 0 if all(m["failed"] == 0 for m in levels) else 1


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    a.base_url = (a.base_url or f"http://{a.host}:{a.port}").rstrip("/")
    info = _get(a, "/server_info")
    model = a.model or info.get("served_model_name") or info.get("model_path")
    # rows the speculative loop reserves past the last token (2 steps of draft_tokens) do not fit either
    reserve = 2 * (info.get("speculative_num_draft_tokens") or 1)
    a.sharegpt_context_len = a.sharegpt_context_len or info.get("context_length", 1 << 30) - reserve
    try:
        tokenizer = load_bench_tokenizer(a)
        check_args(a, tokenizer)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab = info.get("vocab_size") or (tokenizer.tok.get_vocab_size() if tokenizer else 32000)
    if a.concurrency_sweep is not None:
        try:
            sweep_levels(a.concurrency_sweep)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return run_sweep(a, argv, model, tokenizer, vocab, info)
    prompts = make_prompts(a, vocab, tokenizer)
    v0, t0_acc, _ = _spec_counters(info)
    results, duration = asyncio.run(run(a, model, prompts))
    info = _get(a, "/server_info")
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
