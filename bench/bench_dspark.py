"""DSpark vs NEXTN step time and tok/s (greedy, batch 1), each step inside one on-device while loop.

  python3 -m bench.bench_dspark --target models/ling-demo --draft models/ling-demo-dspark --out $OUT
  python3 -m bench.bench_dspark --ling-slice 12 --block-size 16 --out $OUT   # Ling-3.0-flash slice, random weights

Demo pair: the same held-out-free prompt (token ids of a short Python snippet) through NEXTN (--nextn-steps) and
DSPARK (static and confidence), `--steps` steps per timed loop after a warm-up loop; a check first asserts that both
loops' greedy tokens equal plain greedy decoding over the same length. Each step is the program the runner gives this
request (greedy, neutral penalties, no logprobs: Generator.adjusts_logits, DSPARK's argmax-only Markov decode), and
DSPARK static once more as a request with penalties would run it ([adjusts_logits program], the baseline). tok/s = emitted tokens / loop time; step time
= loop time / steps. Ling slice: random bf16 weights (layers of Ling-3.0-flash, a random LingDSparkModel-shaped
draft: hidden 2560, 32 heads of 128, 4 kv heads, intermediate 6144, 5 context layers, markov rank 256); random
weights give no accept length, so only the step time is measured, with its floor (bytes / the HBM ceiling,
ling_floors), and TPOT at accept 4.8 is labelled projected.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_step import write
from ling_jax import dspark
from ling_jax.config import get_preset, load_config
from ling_jax.runner import Generator, generate_on_device
from ling_jax.sampling import SamplingOptions
from ling_jax.spec import SpecConfig
from ling_jax.weights import init_params, load_params

PROMPT = [int(t) for t in np.random.default_rng(0).integers(5, 4000, 64)]


def timed_loop(gen: Generator, prompt, steps: int, reps: int, adjusts_logits: bool | None = None):
    """(seconds per loop (median), tokens emitted, the emitted ids) of `steps` greedy steps after prefill.
    adjusts_logits: the steps' static flag (None: the one the runner gives a neutral greedy request without logprobs,
    Generator.adjusts_logits; True: the program of requests that may adjust their logits, a baseline)."""
    options = SamplingOptions()  # greedy, neutral penalties, no logit bias
    if adjusts_logits is None:
        adjusts_logits = gen.adjusts_logits(options, False)
    run = generate_on_device(gen.cfg, gen.spec, steps, dcfg=gen.dcfg, adjusts_logits=adjusts_logits)
    sp = options.device(gen.cfg.vocab_size)
    times, out = [], None
    for r in range(reps + 1):
        state, first, _ = gen.prefill(prompt, sp, jax.random.key(0), True)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, buf, count = run(gen.run_params, state)
        jax.block_until_ready(count)
        if r:  # the first loop compiles
            times.append(time.perf_counter() - t0)
        out = [int(first[0])] + np.asarray(buf[0, : int(count[0])]).tolist()
    return float(np.median(times)), len(out) - 1, out


def kernel_profile(gen: Generator, prompt, steps: int, adjusts_logits: bool | None = None, top: int = 25) -> dict:
    """The device kernels of one on-device loop of `steps` greedy steps (after a compile + warm loop), per step:
    launches, kernel-busy us and the `top` kernels by time (bench_step.census's grouping by kernel name), so a step
    time splits into what runs on the GPU and the gaps between kernels."""
    import collections, glob, gzip, json, os, tempfile

    options = SamplingOptions()
    if adjusts_logits is None:
        adjusts_logits = gen.adjusts_logits(options, False)
    run = generate_on_device(gen.cfg, gen.spec, steps, dcfg=gen.dcfg, adjusts_logits=adjusts_logits)
    sp = options.device(gen.cfg.vocab_size)
    for traced in (False, True):
        state, _, _ = gen.prefill(prompt, sp, jax.random.key(0), True)
        jax.block_until_ready(state)
        if not traced:
            jax.block_until_ready(run(gen.run_params, state))
            continue
        logdir = tempfile.mkdtemp(prefix="dspark-prof-")
        try:
            with jax.profiler.trace(logdir, create_perfetto_trace=True):
                jax.block_until_ready(run(gen.run_params, state))
        except Exception as ex:  # noqa: BLE001 -- a profiler that fails loses the trace, not the run's timings
            return {"error": f"profiler: {type(ex).__name__}: {str(ex)[:200]}"}
    files = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return {"error": "no trace"}
    with gzip.open(files[0]) as f:
        tr = json.load(f)
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in pname.items() if "gpu" in n.lower() or "stream" in n.lower()}
    ks = [e for e in ev if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
    if not ks:
        return {"error": "no GPU kernels in the trace"}
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in ks:
        per[e["name"]][0] += 1
        per[e["name"]][1] += float(e["dur"])
    span = max(float(e["ts"]) + float(e["dur"]) for e in ks) - min(float(e["ts"]) for e in ks)
    busy = sum(v[1] for v in per.values())
    return {"steps": steps, "launches_per_step": len(ks) / steps, "kernel_us_per_step": busy / steps,
            "span_us_per_step": span / steps, "idle_us_per_step": (span - busy) / steps,
            "top_kernels": [{"name": n[:100], "count_per_step": c / steps, "us_per_step": d / steps}
                            for n, (c, d) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]]}


def demo_rows(a):
    cfg = load_config(a.target)
    params = load_params(cfg, a.target, dtype=jnp.bfloat16)
    dcfg = dspark.load_config(a.draft)
    draft = (dcfg, dspark.load_params(dcfg, a.draft, jnp.bfloat16))
    max_len = len(PROMPT) + a.steps * 17 + 64
    kw = dict(max_len=max_len, dtype=jnp.bfloat16, chunked_prefill_size=64)
    plain, _ = Generator(cfg, params, **kw).generate(PROMPT, max_new_tokens=a.steps * 2, stop_token_ids=())
    rows = []
    runs = [("NEXTN", Generator(cfg, params, spec=SpecConfig("NEXTN", a.nextn_steps), **kw), None)]
    for mode in ("static", "confidence"):
        spec = SpecConfig("DSPARK", dcfg.block_size, draft_model_path=a.draft, dspark_verify=mode)
        gen = Generator(cfg, params, spec=spec, draft=draft, **kw)
        runs.append((f"DSPARK {mode}", gen, None))
        if mode == "static" and not gen.adjusts_logits(SamplingOptions(), False):
            # the same step as a request with penalties or a logit bias runs it (the Markov decode transforms every
            # slot and counts its tokens): the neutral greedy program's baseline, same run
            runs.append((f"DSPARK {mode}", gen, True))
    base = None
    for name, gen, adjusts in runs:
        t, n, out = timed_loop(gen, PROMPT, a.steps, a.reps, adjusts)
        m = min(len(out), len(plain))
        label = f"{name} (block {gen.K})" if "DSPARK" in name else f"NEXTN steps={gen.K}"
        row = {"name": label + (" [adjusts_logits program]" if adjusts else ""),
               "adjusts_logits": gen.adjusts_logits(SamplingOptions(), False) if adjusts is None else adjusts,
               "time_us": 1e6 * t / a.steps, "tokens_per_s": n / t, "accept_length": n / a.steps,
               "greedy_equals_plain_prefix": out[:m] == plain[:m], "compared_tokens": m}
        if base is None:
            base = row
        else:
            row.update(baseline=base["name"], baseline_time_us=base["time_us"],
                       speedup_tokens_per_s=row["tokens_per_s"] / base["tokens_per_s"])
        rows.append(row)
        print(f"{row['name']:28s} step {row['time_us']:8.1f} us  accept {row['accept_length']:5.2f}  "
              f"{row['tokens_per_s']:8.1f} tok/s  lossless-prefix {row['greedy_equals_plain_prefix']}", flush=True)
        if a.profile and jax.default_backend() == "gpu":
            row["profile"] = prof = kernel_profile(gen, PROMPT, a.steps, adjusts)
            if "error" not in prof:
                print(f"    traced: {prof['launches_per_step']:.1f} launches, {prof['kernel_us_per_step']:.1f} us in "
                      f"kernels + {prof['idle_us_per_step']:.1f} us idle a step; top: " + ", ".join(
                          f"{k['name'][:40]} {k['us_per_step']:.1f}" for k in prof["top_kernels"][:8]), flush=True)
    return rows, {"model": a.target, "draft": a.draft}


def expected_distinct(cfg, tokens: int) -> float:
    """Distinct routed experts one MoE call of `tokens` rows reads, in expectation under uniform routing (the random
    weights' router is close to it): E (1 - (1 - A/E)^T)."""
    E, A = cfg.num_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - A / E) ** tokens)


def ling_floors(cfg, dcfg, nextn_k: int, ctx: int) -> dict:
    """Bytes each step must move (one device), bench_step's byte model (each dependent pass's weights once, the
    distinct experts per MoE call, KDA state, MLA cache reads), with uniform-routing expert counts:
      NEXTN K: bench_step.floor_bytes (K-1 one-row MTP drafts, K+1-row verify and extend);
      DSPARK G: the target over G+1 verify rows (layers, lm_head, experts, 3 x KDA state, MLA cache) + the draft's
                weights once (W1 only the G rows gathered; W2, rank x V, once although the Markov decode applies it
                G times in a chain) + the lm_head once more (the block's logits) + the draft's context K/V reads
                (Ld x ctx x Hk x Dh x 2 x 2 B)."""
    from bench.bench_step import byte_model, floor_bytes
    from compile.mesh import make_mesh
    from compile.sharding import ShardingRules

    mesh, rules = make_mesh(1), ShardingRules.tensor_parallel()
    n_moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    d = lambda t: expected_distinct(cfg, t)
    routing = [d(1)] * (nextn_k - 1) + [d(nextn_k + 1)] * n_moe + [d(nextn_k + 1)]
    nextn = floor_bytes(cfg, mesh, rules, "nextn", nextn_k, routing, ctx)
    g, per_expert = byte_model(cfg, mesh, rules)
    G = dcfg.block_size
    H, Kd = cfg.num_attention_heads, cfg.head_dim
    kda_state = len(cfg.kda_layers) * H * Kd * Kd * 4
    mla_read = ctx * cfg.mla_cache_dim * 2
    target = sum(v for k, v in g.items() if k.startswith("layer"))
    verify = (target + g["lm_head"] + n_moe * d(G + 1) * per_expert + 3 * kda_state
              + len(cfg.mla_layers) * mla_read)
    w1 = dcfg.vocab_size * dcfg.markov_rank * 2
    draft_weights = 2 * dspark.param_count(dcfg) - w1 + G * dcfg.markov_rank * 2
    ctx_kv = dcfg.num_hidden_layers * ctx * dcfg.num_key_value_heads * dcfg.head_dim * 2 * 2
    return {"NEXTN": nextn, "DSPARK": verify + draft_weights + g["lm_head"] + ctx_kv,
            "dspark_parts": {"verify": verify, "draft_weights": draft_weights, "lm_head_draft": g["lm_head"],
                             "draft_context_kv": ctx_kv},
            "routing": "uniform expectation E(1-(1-A/E)^T) per MoE call (random weights)"}


def ling_slice_rows(a):
    from bench.ceiling import Ceiling
    from compile.stages import slice_config

    cfg = slice_config(get_preset("ling3-flash"), a.ling_slice)
    ceiling = Ceiling.measure(jax.devices()[0])
    params = init_params(cfg, 0, jnp.bfloat16)
    D, H = cfg.hidden_size, cfg.num_attention_heads
    dcfg = dspark.DSparkConfig(hidden_size=D, num_hidden_layers=a.draft_layers, num_attention_heads=H,
                               num_key_value_heads=4, head_dim=128, intermediate_size=cfg.intermediate_size,
                               vocab_size=cfg.vocab_size, block_size=a.block_size,
                               target_layer_ids=dspark.evenly_spaced_layers(cfg.num_hidden_layers, 5),
                               num_target_layers=cfg.num_hidden_layers, mask_token_id=1, markov_rank=256)
    draft = (dcfg, dspark.init_params(dcfg, 0, jnp.bfloat16))
    kw = dict(max_len=a.ctx + 1024, dtype=jnp.bfloat16, chunked_prefill_size=512)
    prompt = [int(t) for t in np.random.default_rng(1).integers(5, cfg.vocab_size, a.ctx)]
    floors = ling_floors(cfg, dcfg, a.nextn_steps, a.ctx)
    bw = ceiling.bytes_per_s
    rows = []
    gens = [("NEXTN", Generator(cfg, params, spec=SpecConfig("NEXTN", a.nextn_steps), **kw)),
            ("DSPARK static", Generator(cfg, params, spec=SpecConfig("DSPARK", a.block_size), draft=draft, **kw))]
    for name, gen in gens:
        t, _, _ = timed_loop(gen, prompt, a.steps, a.reps)
        step_us = 1e6 * t / a.steps
        nbytes = floors[name.split()[0]]
        floor_us = nbytes / bw * 1e6
        rows.append({"name": f"{name} ({cfg.name}, ctx {a.ctx}, K={gen.K})", "time_us": step_us, "bytes": nbytes,
                     "floor_us": floor_us, "fraction_of_floor": floor_us / step_us,
                     "projected_tpot_us_at_accept_4.8": step_us / 4.8, "projected": True})
        print(f"{rows[-1]['name']:48s} step {step_us:9.1f} us  floor {floor_us:8.1f} us "
              f"({100 * floor_us / step_us:4.1f} %)  TPOT at accept 4.8 (projected) {step_us / 4.8:8.1f} us",
              flush=True)
    return rows, {"model": cfg.name, "draft_params": dspark.param_count(dcfg), "ctx": a.ctx,
                  "hbm_bw_bytes_per_s": bw, **ceiling.summary(), "floors": floors}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="models/ling-demo")
    ap.add_argument("--draft", default="models/ling-demo-dspark")
    ap.add_argument("--ling-slice", type=int, default=0, help="> 0: Ling-3.0-flash slice of this many layers")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--nextn-steps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--profile", action="store_true", help="demo pair on a GPU: also trace one loop per row and "
                    "record its kernels per step (launches, kernel time, idle time, the top kernels)")
    a = ap.parse_args()
    rows, meta = ling_slice_rows(a) if a.ling_slice else demo_rows(a)
    print("wrote", write(a.out, "dspark", rows, meta, jax.devices()[0].device_kind.replace(" ", "-")))


if __name__ == "__main__":
    main()
