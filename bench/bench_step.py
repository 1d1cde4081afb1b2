"""Step bench: plain decode step and NEXTN step (steps 3 and 5) at context 8192, with floors and a kernel census.

  python3 -m bench.bench_step --layers 12 --out $OUT [--spec-parts]     (one H200: a layer slice, random bf16)
  python3 -m bench.bench_step --model models/ling-demo --out $OUT       (the shipped demo model: pure fixed cost)
  python3 -m bench.bench_step --tp 2 --out $OUT                         (two H200: the full model)
  ... --baseline-fused-linear          (A/B of KernelCalls.fused_linear in the same run, each with its census)

Floor = bytes the step must move per device / the one HBM ceiling (bench/ceiling.py: best of a streaming-read
Pallas kernel over 4 GiB and XLA's copy). Bytes count each dependent pass's weights once: per MoE call the
DISTINCT experts the actual routing activated x the bytes of one expert, attention/dense/router/shared weights,
lm_head per lm_head pass, embedding rows, KDA state (plain: read+write; NEXTN: verify read + commit read+write),
MLA cache reads. The routing is captured from a copy of the step that routes in jnp (same math as the Pallas
router); a MoE model whose capture returns no routing is an error, never a floor without expert bytes.
Time: chains of steps on donated state, device-synchronised, median over chains, warm-up excluded.
Census: a jax.profiler trace of a few steps, kernels grouped by name and category, calibrated against the
unprofiled time, with kernels per step and per layer pass (target layers + MTP passes of the step).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import glob
import gzip
import json
import os
import subprocess
import tempfile
import time

# 255 GB of weights on two 141 GB GPUs: JAX's default pool (75 % of the card) is too small (seen: OOM at init).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from compile.mesh import make_mesh
from compile.runner import constrain, sharded_params
from compile.sharding import ShardingRules, kernel_calls_for, param_specs, state_shardings
from compile.stages import Program, slice_config
from ling_jax.config import get_preset
from ling_jax.kernel_calls import kernel_calls
from ling_jax.model import RuntimeOptions
from ling_jax.sampling import SamplingOptions, TokenHistory
from ling_jax.weights import array_spec

from bench.ceiling import Ceiling  # noqa: E402

SEED_NEXTN_US = 4970.0  # SGLang NEXTN step on 4xB200: TPOT 1.53 ms x accept 3.25 (a published reference)
SEED_ACCEPT = 3.25


def random_state(prog: Program, mesh, rules, ctx: int):
    """A step carry at context `ctx` with random contents (never zeros), born in its sharding."""
    abstract = prog.abstract_state()
    leaves, tree = jax.tree.flatten(abstract)

    def make(key):
        out = []
        for k, a in zip(jax.random.split(key, len(leaves)), leaves):
            if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
                out.append(jax.random.key(1))
            elif a.dtype == jnp.int32:
                out.append(jnp.full(a.shape, ctx, jnp.int32) if a.shape == (prog.batch,) else jnp.zeros(a.shape, jnp.int32))
            else:
                out.append((0.05 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype))
        st = jax.tree.unflatten(tree, out)
        # tokens: random ids; sampling: greedy defaults
        st = st.replace(bonus=jax.random.randint(key, (prog.batch,), 2, prog.cfg.vocab_size))
        if hasattr(st, "seed"):
            st = st.replace(seed=jax.random.randint(jax.random.fold_in(key, 1), (prog.batch,), 2, prog.cfg.vocab_size))
        st = st.replace(sampling=SamplingOptions().device(prog.cfg.vocab_size),  # greedy, neutral transforms
                        history=TokenHistory.empty(prog.batch, prog.cfg.vocab_size))
        return constrain(st, mesh, rules)  # the layout the step's outputs get: no recompile on the 2nd call

    return jax.jit(make)(jax.random.key(7))


def time_chain(step, params, state, n_steps=10, reps=20, dispatch: list | None = None):
    """Median seconds per step over `reps` chains of n_steps (donated state carried). Returns (s, state).
    dispatch: receives the median host seconds one call takes to return (dispatch only, nothing blocks): when
    it is close to the step time, the step is host-bound."""
    state, _ = step(params, state)  # warm-up (compile)
    jax.block_until_ready(state)
    ts, ds = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n_steps):
            t1 = time.perf_counter()
            state, out = step(params, state)
            ds.append(time.perf_counter() - t1)
        jax.block_until_ready((state, out))
        ts.append((time.perf_counter() - t0) / n_steps)
    if dispatch is not None:
        dispatch.append(float(np.median(ds)))
    return float(np.median(ts)), state


@contextlib.contextmanager
def capture_routing(sink: list):
    """Record every router call's expert ids (tracers of the traced program) into `sink`."""
    import ling_jax.layers.moe as moe

    orig = moe.route

    def route(logits, bias, cfg):
        ids, w = orig(logits, bias, cfg)
        sink.append(ids)
        return ids, w

    moe.route = route
    try:
        yield
    finally:
        moe.route = orig


def distinct_experts(prog: Program, params, state) -> list[int]:
    """Distinct experts per router call of one step (its own jit; not the timed program). The copy routes in jnp
    (kernels="reference"): the Pallas router computes the same ids but does not pass through `moe.route`."""
    sink: list = []
    fn = dataclasses.replace(prog, opts=RuntimeOptions(kernels="reference")).fn()

    def run(p, s):
        sink.clear()
        with capture_routing(sink):
            fn(p, s)
        return list(sink)

    ids = jax.jit(run)(params, state)
    n_moe = sum(1 for i in range(prog.cfg.num_hidden_layers) if prog.cfg.is_moe(i))
    if n_moe and not ids:
        raise RuntimeError("routing capture returned no router calls for a MoE model: the floor would count no "
                           "expert bytes")
    return [len(np.unique(np.asarray(i))) for i in ids]


def layer_passes(cfg, mode: str, K: int) -> int:
    """Decoder-layer passes in one step: the target's layers once, plus (NEXTN) K MTP passes (K-1 drafts + extend)."""
    return cfg.num_hidden_layers + (0 if mode == "plain" else K * len(cfg.mtp_layers))


def routing_from(path, cfg, mode, K) -> list[float]:
    """Distinct experts per router call for this config, from the means of a (slice) run's rows."""
    rows = {r["name"]: r["distinct_experts_per_router_call"] for r in json.load(open(path))["rows"]}
    n_moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    if mode == "plain":
        return [float(np.mean(rows["plain decode step"]))] * n_moe
    src = next(v for k, v in rows.items() if k.startswith(f"NEXTN step (steps={K}"))
    return src[:K - 1] + [float(np.mean(src[K - 1:-1]))] * n_moe + src[-1:]


def byte_model(cfg, mesh, rules, dtype_bytes=2):
    """Per-device bytes of each weight group (sharded arrays divided by their mesh axes)."""
    specs = param_specs(cfg, rules)
    tp = mesh.devices.size
    groups = collections.Counter()
    for a in array_spec(cfg):
        n = int(np.prod(a.shape)) * (4 if a.dtype == "float32" else dtype_bytes)
        split = tp if any(ax is not None for ax in specs[a.path]) else 1
        name = a.path[-1]
        if a.path[0] in ("embed", "lm_head", "final_norm"):
            key = a.path[0]
        elif name in ("w_gate", "w_up", "w_down"):
            key = "routed"
        else:
            key = ("mtp" if a.path[0] == "mtp" else "layer") + f"{a.path[1]}"
        groups[key] += n / split
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * dtype_bytes / (
        1 if rules.expert_mlp is None else tp)
    return groups, per_expert


def floor_bytes(cfg, mesh, rules, mode, K, routing, ctx) -> float:
    """Bytes one device must move in one step (see module doc). routing: distinct experts per router call."""
    g, per_expert = byte_model(cfg, mesh, rules)
    tp = mesh.devices.size
    D, H, Kd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    kda_state = len(cfg.kda_layers) * H * Kd * Kd * 4 / tp
    mla_read = ctx * cfg.mla_cache_dim * 2  # per MLA layer per pass (replicated cache)
    target = sum(v for k, v in g.items() if k.startswith("layer"))
    mtp = sum(v for k, v in g.items() if k.startswith("mtp"))
    lm = g["lm_head"]
    experts = sum(routing) * per_expert
    if mode == "plain":
        return target + lm + experts + 2 * kda_state + len(cfg.mla_layers) * mla_read + D * 2
    passes_mtp = K  # K-1 draft forwards + 1 extend
    return (target + lm + experts + 3 * kda_state + len(cfg.mla_layers) * mla_read
            + passes_mtp * (mtp + lm + mla_read) + (K + 1) * 2 * D * 2)


def census(step, params, state, n_steps, unprofiled_s, logdir, passes: int):
    """Profile n_steps; kernels grouped by name and category; calibrated against the unprofiled step time.
    passes: decoder-layer passes per step (for kernels per layer pass)."""
    try:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            for _ in range(n_steps):
                state, out = step(params, state)
            jax.block_until_ready((state, out))
    except Exception as e:  # noqa: BLE001
        return {"error": f"profiler: {e}"}, state
    files = glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True) + \
        glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return {"error": "no trace json written"}, state
    with gzip.open(files[0]) as f:
        tr = json.load(f)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    pnames = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in pnames.items() if "GPU" in n or "gpu" in n or "stream" in n.lower()}
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e:
            per[e["name"]][0] += 1
            per[e["name"]][1] += float(e["dur"])
    used = {e["pid"] for e in events if e.get("ph") == "X" and e.get("pid") in gpu}
    devs = max(1, len(used))
    total_us = sum(v[1] for v in per.values()) / n_steps
    kernels = sum(v[0] for v in per.values()) / n_steps
    cats, ccount = collections.Counter(), collections.Counter()
    for name, (c, d) in per.items():
        cats[_category(name)] += d / n_steps
        ccount[_category(name)] += c / n_steps / devs
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:80]
    gaps = _gaps(events, gpu, n_steps)
    host = collections.defaultdict(float)
    for e in events:  # what the host spends its time on while the step runs (dispatch, thunks, graph updates)
        if e.get("ph") == "X" and e.get("pid") not in gpu and "dur" in e:
            host[e["name"][:80]] += float(e["dur"]) / n_steps
    return {
        **gaps, "host_events_us_per_step": dict(sorted(host.items(), key=lambda kv: -kv[1])[:25]),
        "gpu_processes": [pnames[p] for p in gpu], "kernels_per_step_all_streams": kernels,
        "kernels_per_step_per_device": kernels / devs, "layer_passes_per_step": passes,
        "kernels_per_layer_pass": kernels / devs / passes,
        "kernels_by_category_per_step": dict(ccount.most_common()),
        "kernel_us_per_step_all_streams": total_us, "unprofiled_step_us": unprofiled_s * 1e6,
        "busy_fraction_per_device": total_us / devs / (unprofiled_s * 1e6),
        "by_category_us": dict(cats.most_common()),
        "top_kernels": [{"name": n[:120], "count_per_step": c / n_steps, "us_per_step": d / n_steps}
                        for n, (c, d) in top],
    }, state


def _gaps(events, gpu, n_steps):
    """Idle time between consecutive kernels of one device stream, and the 12 largest gaps with the kernel after
    them: where the step waits on the host (a graph boundary, a custom call outside the graph) rather than the GPU."""
    ks = sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in events
                if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e)
    if len(ks) < 2:
        return {}
    gaps = [(ks[i + 1][0] - (ks[i][0] + ks[i][1]), ks[i][2][:60], ks[i + 1][2][:60]) for i in range(len(ks) - 1)]
    inside = [g for g in gaps if g[0] < 500]  # the gaps between steps of the traced chain (host loop) excluded
    big = sorted(inside, reverse=True)[:12]
    return {"idle_us_per_step": sum(max(g[0], 0) for g in inside) / n_steps,
            "gaps_over_5us_per_step": sum(1 for g in inside if g[0] > 5) / n_steps,
            "largest_gaps": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in big]}


def _category(name: str) -> str:
    n = name.lower()
    for cat, keys in (("all-reduce/nccl", ("nccl", "all-reduce", "allreduce")), ("gemm", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "matmul", "dot")),
                      ("triton/pallas", ("triton", "pallas", "_kernel", "moe_", "kda_")), ("reduce", ("reduce", "reduction")),
                      ("copy/slice", ("copy", "memcpy", "slice", "dynamic", "concatenate", "gather", "scatter")),
                      ("loop fusion", ("loop_", "fusion")), ("sort/topk", ("sort", "topk", "top_k"))):
        if any(k in n for k in keys):
            return cat
    return "other"


def row(name, t_s, nbytes, bw, **kw):
    """A result row. `baseline` fields are only ever set from a run of the same bench (--baseline-kernels);
    the seed's published NEXTN step is a `reference`."""
    t_us = t_s * 1e6
    floor_us = nbytes / bw * 1e6
    r = {"name": name, "time_us": t_us, "bytes": nbytes, "floor_us": floor_us, "fraction_of_floor": floor_us / t_us,
         "reference": "SGLang NEXTN step, 4xB200 (published TPOT 1.53 ms x accept 3.25)",
         "reference_time_us": SEED_NEXTN_US}
    r.update(kw)
    return r


def write(out_dir, prefix, rows, extra, device, command: str | None = None):
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    command = command or "python3 -m bench." + os.path.basename(__file__)[:-3] + " " + " ".join(os.sys.argv[1:])
    d = {"command": command,
         "device": device, "jax_version": jax.__version__, "date": date, "git_commit": commit, "rows": rows, **extra}
    path = os.path.join(out_dir, f"{prefix}-{device.lower().replace('nvidia ', '').replace(' ', '')}-{date}.json")
    with open(path, "w") as f:
        json.dump(d, f, indent=1)
    return path


def load_model(a, mesh, rules):
    """(cfg, params): a checkpoint directory (--model, its own weights) or a preset (random bf16, --layers slice)."""
    if a.model:
        from compile.sharding import shardings_for
        from ling_jax.config import from_hf_config
        from ling_jax.weights import load_hf_checkpoint

        cfg = from_hf_config(a.model)
        return cfg, load_hf_checkpoint(cfg, a.model, jnp.bfloat16, shardings_for(cfg, mesh, rules))
    cfg = get_preset(a.preset)
    cfg = slice_config(cfg, a.layers) if a.layers else cfg
    return cfg, sharded_params(cfg, mesh, rules, seed=0, dtype=jnp.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ling3-flash", help="a small preset smoke-tests the script on CPU")
    ap.add_argument("--model", default=None, help="a checkpoint directory (e.g. models/ling-demo): its config and "
                    "weights instead of --preset (the demo model's step is almost all fixed cost)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", default="3,5", help="NEXTN steps to time (--spec-parts needs 5 among them)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name (e.g. -pdl)")
    ap.add_argument("--spec-parts", action="store_true", help="also run bench_spec's parts on the same params")
    ap.add_argument("--no-census", action="store_true")
    ap.add_argument("--dump-hlo", action="store_true", help="write each step's optimised HLO (gzip) to --out")
    ap.add_argument("--kernels", default="auto", help="RuntimeOptions.kernels (auto: Pallas on GPU, run per "
                    "device under shard_map over TP)")
    ap.add_argument("--kda-impl", default="verify", choices=("chain", "verify"), help="KernelCalls.kda_impl")
    ap.add_argument("--no-fused-linear", action="store_true", help="KernelCalls.fused_linear=False: the layers' "
                    "projections in XLA instead of pallas_kernels/fused_linear.py")
    ap.add_argument("--baseline-fused-linear", action="store_true", help="also time the steps with fused_linear "
                    "flipped (same kernels otherwise) in the same run, as the baseline")
    ap.add_argument("--baseline-kernels", default=None, help="also time the steps with these kernels (e.g. "
                    "reference: the XLA-only model) in the same run, as the baseline")
    ap.add_argument("--routing-from", default=None, help="a slice run's step JSON: reuse its mean distinct experts "
                    "per router call (saves compiling a routing-capture copy of the full model)")
    a = ap.parse_args()
    if a.model and a.layers:
        ap.error("--layers slices a preset; --model loads a whole checkpoint")
    if a.baseline_kernels and a.baseline_fused_linear:
        ap.error("one baseline per run: --baseline-kernels or --baseline-fused-linear")
    tp = a.tp or len(jax.devices())
    mesh, rules = make_mesh(tp), ShardingRules.tensor_parallel()
    device = f"{jax.devices()[0].device_kind} x{tp}"
    t0 = time.perf_counter()
    ceiling = Ceiling.measure(jax.devices()[0])
    bw = ceiling.bytes_per_s
    print(f"HBM ceiling {bw / 1e12:.2f} TB/s ({ceiling.source}; streaming read {ceiling.stream_bytes_per_s / 1e12:.2f},"
          f" XLA copy {ceiling.copy_bytes_per_s / 1e12:.2f})", flush=True)
    cfg, params = load_model(a, mesh, rules)
    jax.block_until_ready(params)
    print(f"params {cfg.name} TP{tp}: init {time.perf_counter() - t0:.1f} s", flush=True)
    rows, extra = [], {"hbm_bw_bytes_per_s": bw, **ceiling.summary(), "model": a.model or cfg.name, "tp": tp,
                       "ctx": a.ctx, "census": {}, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       "routing_source": a.routing_from or "captured from this run's router (jnp copy of the step)"}
    max_len = a.ctx + 1024
    fused = not a.no_fused_linear
    extra.update(kernels=a.kernels, fused_linear=fused)
    runs = [("plain", 0, a.kernels, fused)] + [("nextn", int(k), a.kernels, fused) for k in a.steps.split(",")]
    if a.baseline_kernels:
        runs += [(m, k, a.baseline_kernels, fused) for m, k, _, _ in runs]
    if a.baseline_fused_linear:
        runs += [(m, k, kern, not fused) for m, k, kern, _ in runs]
    prefix = ("step" + ("-" + os.path.basename(os.path.normpath(a.model)) if a.model else "") + f"-kda{a.kda_impl}"
              + ("" if fused else "-nofl"))
    for mode, K, kernels, fl in runs:
        baseline = kernels != a.kernels or fl != fused
        calls = kernel_calls(kernels, kda_impl=a.kda_impl, fused_linear=fl) if kernels != "reference" else None
        opts = kernel_calls_for(RuntimeOptions(kernels=calls), mesh, rules)
        prog = Program(cfg, mode=mode, steps=max(K, 1), max_len=max_len, opts=opts)
        fn = prog.fn()
        step = jax.jit(lambda p, s, _f=fn: constrain(_f(p, s), mesh, rules), donate_argnums=(1,))
        state = random_state(prog, mesh, rules, a.ctx)
        routing = routing_from(a.routing_from, cfg, mode, K) if a.routing_from else distinct_experts(prog, params, state)
        tc = time.perf_counter()
        disp: list = []
        t, state = time_chain(step, params, state, reps=a.reps, dispatch=disp)
        nbytes = floor_bytes(cfg, mesh, rules, mode, K, routing, a.ctx)
        name = "plain decode step" if mode == "plain" else f"NEXTN step (steps={K}, {K + 1} verify rows)"
        name += f" [kernels={kernels}]" if kernels != a.kernels else ""
        name += f" [fused_linear={'on' if fl else 'off'}]" if fl != fused else ""
        r = row(name, t, nbytes, bw, distinct_experts_per_router_call=routing, compile_and_time_s=time.perf_counter() - tc,
                kernels=kernels, layer_passes=layer_passes(cfg, mode, K), host_dispatch_us=disp[0] * 1e6)
        if baseline:
            main_row = next(x for x in rows if x["name"] == name.split(" [")[0])
            what = f"kernels={kernels}" if kernels != a.kernels else f"fused_linear={'on' if fl else 'off'}"
            main_row.update(baseline=f"the same step with {what}, same run", baseline_time_us=t * 1e6)
        if mode == "nextn":
            r["projected_tpot_us_at_seed_accept"] = t * 1e6 / SEED_ACCEPT
        rows.append(r)
        print(f"{name:42s} {t * 1e6:9.1f} us  floor {r['floor_us']:8.1f} us  {100 * r['fraction_of_floor']:5.1f} %  "
              f"({nbytes / 1e9:.3f} GB/device)  host dispatch {disp[0] * 1e6:.0f} us/call", flush=True)
        # the census of a fused_linear baseline too: its kernels per layer pass are the A/B's other half
        if not a.no_census and kernels == a.kernels and (mode == "plain" or K == 5):
            c, state = census(step, params, state, 5, t, tempfile.mkdtemp(prefix=f"prof-{mode}{K}-"),
                              layer_passes(cfg, mode, K))
            extra["census"][name] = c
            r["kernels_per_step"] = c.get("kernels_per_step_per_device")
            r["kernels_per_layer_pass"] = c.get("kernels_per_layer_pass")
            print(json.dumps({k: v for k, v in c.items() if k != "top_kernels"})[:1500], flush=True)
        del state
        os.makedirs(a.out, exist_ok=True)
        write(a.out, prefix + a.tag, rows, extra, device)  # partial results survive a timeout
        if mode == "nextn" and K == 5 and not baseline:
            kept = (step, routing)
        if a.dump_hlo and not baseline:  # the optimised HLO of the timed program (what the census counts)
            state = random_state(prog, mesh, rules, a.ctx)
            with gzip.open(os.path.join(a.out, f"hlo-{prefix}{a.tag}-{mode}{K}.txt.gz"), "wt") as f:
                f.write(step.lower(params, state).compile().as_text())
            del state
    os.makedirs(a.out, exist_ok=True)
    print("wrote", write(a.out, prefix + a.tag, rows, extra, device))
    if a.spec_parts:
        from bench import bench_spec

        srows = bench_spec.run(cfg, mesh, rules, params, bw, a.ctx, a.reps, K=5, fused=kept[0], routing=kept[1])
        print("wrote", write(a.out, "spec" + a.tag, srows, {"hbm_bw_bytes_per_s": bw, "model": cfg.name, "tp": tp,
                                                             "ctx": a.ctx}, device))


if __name__ == "__main__":
    main()
