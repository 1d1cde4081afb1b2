"""Step bench: plain decode step and NEXTN step (steps 3 and 5) at context 8192, with floors and a kernel census.

  python3 -m bench.bench_step --layers 12 --out $OUT [--spec-parts]     (one H200: a layer slice, random bf16)
  python3 -m bench.bench_step --model models/ling-demo --out $OUT       (the shipped demo model: pure fixed cost)
  python3 -m bench.bench_step --tp 2 --out $OUT                         (two H200: the full model)
  python3 -m bench.bench_step --quantization fp8 --tp 1 --ttft 8192 --out $OUT   (one H200: the full model in fp8)
  python3 -m bench.bench_step --quantization fp8 --tp 1 --dry-run       (CPU: its memory plan, see step_budget.py)
  ... --fused-linear [--baseline-fused-linear]   (KernelCalls.fused_linear on; A/B with it and fused_linear_fp8
                                                 flipped in the same run, each step's baseline right after it)
  ... --quantization fp8 --baseline-fused-linear (fp8 projections fused, the default, against XLA's dequantise)
  ... --tree <commit>                           (recorded as the JSON's `tree`; the JSON is rewritten after each row)
  ... --tp 2 --p2p-allreduce                    (KernelCalls.p2p_allreduce: the MoE boundaries through
                                                 pallas_kernels/allreduce.py; A/B: the same command without it)

Floor = bytes the step must move per device (block-fp8 weights: their fp8 bytes + f32 scales) / the one HBM ceiling (bench/ceiling.py: best of a streaming-read
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
from compile.runner import constrain
from compile.sharding import ShardingRules, kernel_calls_for, param_specs, state_shardings, with_shardings
from compile.stages import Program, slice_config
from ling_jax.aliased_step import AliasedStep
from ling_jax import dspark
from ling_jax.config import get_preset
from ling_jax.draft_vocab import with_draft_vocab
from ling_jax.kernel_calls import FP8_LINEAR_SCALES, GPU_DEFAULTS, MOE_FP8_SCHEMES, KernelCalls, kernel_calls
from ling_jax.model import Numerics, RuntimeOptions
from ling_jax.sampling import SamplingOptions, TokenHistory
from ling_jax import quant
from ling_jax.weights import abstract_params, array_spec, get_path, init_params

from bench import step_budget  # noqa: E402
from bench.bench_kernels import tree_of  # noqa: E402
from bench.ceiling import Ceiling  # noqa: E402
from ling_jax.memory import device_memory_bytes  # noqa: E402

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


def time_chain(step, params, state, n_steps=10, reps=20, dispatch: list | None = None, hold: int = 0):
    """Median seconds per step over `reps` chains of n_steps (donated state carried). Returns (s, state).
    dispatch: receives the median host seconds one call takes to return (dispatch only, nothing blocks): when
    it is close to the step time, the step is host-bound. hold: keep the last `hold` calls' outputs alive (a host
    reading them late), else each is dropped when the next call returns."""
    state, _ = step(params, state)  # warm-up (compile)
    jax.block_until_ready(state)
    ts, ds = [], []
    held = collections.deque(maxlen=max(hold, 1))
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n_steps):
            t1 = time.perf_counter()
            state, out = step(params, state)
            ds.append(time.perf_counter() - t1)
            if hold:
                held.append(out)
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
    fn = dataclasses.replace(prog, opts=prog.opts.replace(kernels="reference")).fn()  # (the same numerics)

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


def layer_passes(cfg, mode: str, K: int, draft_layers: int = 0) -> int:
    """Decoder-layer passes in one step: the target's layers once, plus (NEXTN) K MTP passes (K-1 drafts + extend)
    or (DSPARK) the draft's draft_layers once (one parallel forward over the block)."""
    if mode == "dspark":
        return cfg.num_hidden_layers + draft_layers
    return cfg.num_hidden_layers + (0 if mode == "plain" else K * len(cfg.mtp_layers))


def routing_from(path, cfg, mode, K) -> list[float]:
    """Distinct experts per router call for this config, from the means of a (slice) run's rows."""
    rows = {r["name"]: r["distinct_experts_per_router_call"] for r in json.load(open(path))["rows"]
            if "distinct_experts_per_router_call" in r}  # the step rows (not TTFT or error rows)
    n_moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    if mode == "plain":
        return [float(np.mean(rows["plain decode step"]))] * n_moe
    src = next(v for k, v in rows.items() if k.startswith(f"NEXTN step (steps={K}"))
    return src[:K - 1] + [float(np.mean(src[K - 1:-1]))] * n_moe + src[-1:]


def byte_model(cfg, mesh, rules, quantization=None):
    """Per-device bytes of each weight group (sharded arrays divided by their mesh axes), counted from the
    abstract parameter tree: block-fp8 weights as their w8 bytes + f32 scales, the rest in bf16 / f32."""
    specs = param_specs(cfg, rules)
    params = abstract_params(cfg, jnp.bfloat16, quantization=quantization)
    tp = mesh.devices.size
    groups = collections.Counter()
    for a in array_spec(cfg):
        n = quant.nbytes(get_path(params, a.path))
        split = tp if any(ax is not None for ax in specs[a.path]) else 1
        name = a.path[-1]
        if a.path[0] in ("embed", "lm_head", "final_norm"):
            key = a.path[0]
        elif name in ("w_gate", "w_up", "w_down"):
            key = "routed"
        else:
            key = ("mtp" if a.path[0] == "mtp" else "layer") + f"{a.path[1]}"
        groups[key] += n / split
    moe = next((a for a in array_spec(cfg) if a.path[-1] == "w_gate"), None)
    per_expert = 0.0 if moe is None else sum(  # one expert's gate, up and down rows (with their scales)
        quant.nbytes(get_path(params, moe.path[:-1] + (w,))) for w in ("w_gate", "w_up", "w_down")) / (
        cfg.num_experts * (1 if rules.expert_mlp is None else tp))
    return groups, per_expert


def floor_bytes(cfg, mesh, rules, mode, K, routing, ctx, quantization=None, draft_vocab=None) -> float:
    """Bytes one device must move in one step (see module doc). routing: distinct experts per router call.
    draft_vocab: the draft lm_head's rows (ling_jax.draft_vocab; None: the full vocabulary)."""
    g, per_expert = byte_model(cfg, mesh, rules, quantization)
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
    lm_draft = lm if draft_vocab is None else lm * draft_vocab / cfg.vocab_size
    return (target + lm + experts + 3 * kda_state + len(cfg.mla_layers) * mla_read
            + passes_mtp * (mtp + lm_draft + mla_read) + (K + 1) * 2 * D * 2)


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
    # the script that runs (every bench writes through here: __file__ would name bench_step for all of them)
    command = command or "python3 -m bench." + os.path.basename(os.sys.argv[0])[:-3] + " " + " ".join(os.sys.argv[1:])
    d = {"command": command,
         "device": device, "jax_version": jax.__version__, "date": date, "git_commit": commit, "rows": rows, **extra}
    path = os.path.join(out_dir, f"{prefix}-{device.lower().replace('nvidia ', '').replace(' ', '')}-{date}.json")
    os.makedirs(out_dir, exist_ok=True)  # a fresh --out (the gate wrote into a missing dir and lost its rows)
    with open(path, "w") as f:
        json.dump(d, f, indent=1)
    return path


def load_model(a, mesh, rules, cfg):
    """params: a checkpoint directory (--model: its own weights, streamed array by array to the device) or random
    init of the preset (--layers slice), drawn on device array by array: with --quantization fp8 directly in fp8,
    so the bf16 model never exists (Ling-3.0-flash: 128 GB fp8 on one H200)."""
    from compile.sharding import shardings_for
    from ling_jax.weights import load_hf_checkpoint

    every = max(1, len(array_spec(cfg)) // 8)
    t0 = time.perf_counter()
    progress = lambda i, n: i % every == 0 and print(f"  params {i}/{n} arrays, {time.perf_counter() - t0:.1f} s",
                                                     flush=True)
    if a.model:
        return load_hf_checkpoint(cfg, a.model, jnp.bfloat16, shardings_for(cfg, mesh, rules), progress,
                                  a.quantization)
    return init_params(cfg, 0, jnp.bfloat16, shardings_for(cfg, mesh, rules), a.quantization, progress)


def model_config(a):
    if a.model:
        from ling_jax.config import from_hf_config

        return from_hf_config(a.model)
    cfg = get_preset(a.preset)
    return slice_config(cfg, a.layers) if a.layers else cfg


# flags whose 0 means None (main normalises them after parsing; a --baseline-set value is normalised the same way)
ZERO_IS_NONE = ("moe_fp8_n_tokens", "moe_fp8_split_k")


def parse_baseline_set(ap, a, spec: str) -> dict:
    """--baseline-set "flag=value,..." -> {dest: value}, each value parsed by its flag's own argparse action (its
    type and choices; a switch takes 1/0, true/false, on/off): an unknown flag or a value it does not take is an
    argparse error."""
    actions = {act.dest: act for act in ap._actions if not act.dest.startswith("baseline")}
    out = {}
    for item in spec.split(","):
        key, eq, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        act = actions.get(key)
        if not eq or act is None or key == "help":
            ap.error(f"--baseline-set {item!r}: expected FLAG=VALUE with FLAG one of this script's flags")
        if act.nargs == 0:  # store_true / store_false
            if raw.lower() not in ("1", "true", "on", "0", "false", "off"):
                ap.error(f"--baseline-set {item!r}: {key} is a switch (1/0, true/false, on/off)")
            val = raw.lower() in ("1", "true", "on")
        else:
            try:
                val = act.type(raw) if act.type else raw
            except ValueError:
                ap.error(f"--baseline-set {item!r}: {raw!r} is not a value of {key} ({act.type.__name__})")
            if act.choices is not None and val not in act.choices:
                ap.error(f"--baseline-set {item!r}: {raw!r} is not one of {key}'s choices {tuple(act.choices)}")
        out[key] = (val or None) if key in ZERO_IS_NONE else val
    return out


def numerics_of(a) -> Numerics:
    """The flags' Numerics (--fp8-activations; the rest as the model's defaults)."""
    return Numerics(fp8_activations=a.fp8_activations)


def fused_of(a) -> tuple[bool, bool]:
    """The flags' KernelCalls (fused_linear, fused_linear_fp8)."""
    return a.fused_linear, a.fused_linear_fp8


def fused_label(fl: tuple[bool, bool]) -> str:
    on = lambda b: "on" if b else "off"
    return f"fused_linear={on(fl[0])}, fused_linear_fp8={on(fl[1])}"


def programs(a, cfg, mesh, rules, kernels, fused: tuple[bool, bool] = (False, True)):
    """[(mode, K, Program, draft vocabulary N or None)] of the runs, in order: plain (unless --skip-plain), each
    NEXTN --steps, then each NEXTN --steps again with --draft-vocab. fused: KernelCalls (fused_linear,
    fused_linear_fp8)."""
    out = []
    calls = (kernel_calls(kernels, kda_verify_epilogue=a.kda_verify_epilogue, norm_linear_triton=a.norm_linear_triton,
                          linear_residual_triton=a.linear_residual_triton, lm_head_argmax=a.lm_head_argmax,
                          mtp_input_triton=a.mtp_input_triton, fused_linear=fused[0], fused_linear_fp8=fused[1],
                          p2p_allreduce=a.p2p_allreduce,
                          moe_router_tables=a.moe_router_tables, moe_router_norm=a.moe_router_norm,
                          moe_router_scatter=a.moe_router_scatter, moe_shared_segments=a.moe_shared_segments,
                          moe_residual_epilogue=a.moe_residual_epilogue,
                          mla_live_prefix=a.mla_live_prefix, mla_triton=a.mla_triton, moe_fp8_scheme=a.moe_fp8_scheme,
                          moe_n_tokens=a.moe_n_tokens, moe_fp8_n_tokens=a.moe_fp8_n_tokens,
                          moe_fp8_split_k=a.moe_fp8_split_k, moe_fp8_tables=a.moe_fp8_tables,
                          fp8_linear_scale=a.fp8_linear_scale)
             if kernels != "reference" else None)
    opts = kernel_calls_for(RuntimeOptions(numerics=numerics_of(a), kernels=calls), mesh, rules)
    nextn = [int(k) for k in a.steps.split(",")]
    for mode, K, dv in ([] if a.skip_plain else [("plain", 0, None)]) + [("nextn", k, None) for k in nextn] + (
            [("nextn", k, a.draft_vocab) for k in (nextn if a.draft_vocab else [])]):
        # adjusts_logits=False: random_state's sampling is greedy with neutral transforms (lets --lm-head-argmax in)
        out.append((mode, K, Program(cfg, mode=mode, steps=max(K, 1), max_len=a.ctx + 1024, opts=opts,
                                     adjusts_logits=False), dv))
    if a.speculative_algorithm == "DSPARK":  # the DSpark step after them, per --speculative-dspark-verify
        dcfg = dspark_config(a, cfg)
        for verify in a.speculative_dspark_verify.split(","):
            out.append(("dspark", dcfg.block_size, Program(cfg, mode="dspark", steps=dcfg.block_size,
                                                           max_len=a.ctx + 1024, opts=opts, adjusts_logits=False,
                                                           draft=dcfg, dspark_verify=verify), None))
    return out


def dspark_config(a, cfg):
    """--speculative-draft-model-path's DSparkConfig, checked against the target's shapes."""
    if not a.speculative_draft_model_path:
        raise SystemExit("--speculative-algorithm DSPARK needs --speculative-draft-model-path (a DSpark draft dir)")
    dcfg = dspark.load_config(a.speculative_draft_model_path)
    dcfg.check_target(cfg)
    return dcfg


def random_draft_vocab(cfg, n: int):
    """n distinct token ids (a random model has no frequent tokens: any n rows cost the same)."""
    return np.sort(np.random.default_rng(0).choice(cfg.vocab_size, n, replace=False)).astype(np.int32)


def aliased_step(prog, mesh, rules, multi_step: int = 1) -> AliasedStep:
    """The runner's form of the step (outputs aliased to donated inputs, constrained to the sharding rules);
    multi_step = N > 1: N steps in one program (lax.scan), the host dispatching once per N steps
    (runner.Generator(decode_steps=N))."""
    fn = prog.fn()
    if multi_step > 1:
        fn = functools.partial(lambda p, s, _f, n: jax.lax.scan(lambda c, _: _f(p, c), s, None, length=n),
                               _f=fn, n=multi_step)
    return AliasedStep(lambda p, s, _f=fn: constrain(_f(p, s), mesh, rules),
                       out_shardings=lambda out: state_shardings(out, mesh, rules))


def compile_step(prog, mesh, rules, params, plan, multi_step: int = 1):
    """The step compiled ahead of time on the abstract state (nothing allocated for it yet), and XLA's temporaries
    for it, checked against the memory plan before the state is made. multi_step = N > 1: N steps in one program
    (lax.scan), so the host dispatches once per N steps (runner.Generator(decode_steps=N))."""
    step = aliased_step(prog, mesh, rules, multi_step)
    abstract = prog.abstract_state()
    compiled = step.compile(params, with_shardings(abstract, state_shardings(abstract, mesh, rules)))
    mem = compiled.memory_analysis()
    temp = 0 if mem is None else int(mem.temp_size_in_bytes)
    print(f"  compiled: XLA temporaries {temp / 2**30:.2f} GiB, headroom after weights + state + temp "
          f"{plan.headroom(temp) / 2**30:.2f} GiB", flush=True)
    plan.check(temp, f"for the {prog.mode} step")
    return step, temp


def time_ttft(a, cfg, params, kernels) -> list[dict]:
    """TTFT of one --ttft-token prompt through the serving path (Generator.prefill: fixed-size chunks, one program
    for every prompt length), per --ttft-chunks; the compile (a short prompt first) is excluded."""
    from ling_jax.runner import Generator
    from ling_jax.spec import SpecConfig

    calls = kernel_calls(kernels) if kernels != "reference" else None
    rows, prompt = [], np.random.default_rng(0).integers(2, cfg.vocab_size, a.ttft).tolist()
    sp, key = SamplingOptions().device(cfg.vocab_size), jax.random.key(0)
    for chunk in map(int, a.ttft_chunks.split(",")):
        spec = SpecConfig("NEXTN", 3) if cfg.mtp_layers else SpecConfig("NONE")
        gen = Generator(cfg, params, spec=spec, max_len=a.ttft + 1024, chunked_prefill_size=chunk,
                        opts=RuntimeOptions(numerics=numerics_of(a), kernels=calls))
        tc = time.perf_counter()
        jax.block_until_ready(gen.prefill(prompt[:8], sp, key, True)[1])  # compiles the one prefill program
        compile_s, ts = time.perf_counter() - tc, []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(gen.prefill(prompt, sp, key, True)[1])
            ts.append(time.perf_counter() - t0)
        t = float(np.median(ts))
        rows.append({"name": f"TTFT prompt {a.ttft}, chunk {chunk}", "prompt_tokens": a.ttft, "chunk": chunk,
                     "ttft_ms": t * 1e3, "prompt_tokens_per_s": a.ttft / t, "compile_s": compile_s})
        print(f"TTFT prompt {a.ttft} chunk {chunk}: {t * 1e3:.1f} ms ({a.ttft / t:.0f} tok/s; compile "
              f"{compile_s:.1f} s)", flush=True)
        del gen
    return rows


def dry_run(a, cfg, mesh, rules):
    """The plan on CPU with abstract arrays only: layer table, init programs, budget, and each step traced
    (jax.eval_shape) on the abstract (fp8) parameters with the Pallas kernel wiring."""
    plan = step_budget.budget(cfg, jnp.bfloat16, a.quantization, {f"{m}{K}": p for m, K, p, _ in
                                                                   programs(a, cfg, mesh, rules, "reference")},
                              int(a.device_gib * 2**30) if a.device_gib else step_budget.H200_ASSUMED_BYTES, 1,
                              "--device-gib" if a.device_gib else "assumed: 0.95 x 139 GiB, one H200")
    step_budget.print_dry_run(cfg, jnp.bfloat16, a.quantization, plan, compile_temp=not a.no_init_compile)
    params = abstract_params(cfg, jnp.bfloat16, quantization=a.quantization)
    for mode, K, prog, _ in programs(a, cfg, mesh, rules, "pallas" if a.kernels == "auto" else a.kernels,
                                     fused_of(a)):
        t0 = time.perf_counter()
        out = jax.eval_shape(prog.fn(), params, prog.abstract_state())
        print(f"traced {mode}{K} ({len(jax.tree.leaves(out))} output leaves) in {time.perf_counter() - t0:.1f} s")
    plan.check()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ling3-flash", help="a small preset smoke-tests the script on CPU")
    ap.add_argument("--model", default=None, help="a checkpoint directory (e.g. models/ling-demo): its config and "
                    "weights instead of --preset (the demo model's step is almost all fixed cost)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", default="3,5", help="NEXTN steps to time (--spec-parts needs 5 among them)")
    ap.add_argument("--skip-plain", action="store_true", help="time the NEXTN steps only (no plain decode step)")
    ap.add_argument("--speculative-algorithm", choices=("NEXTN", "DSPARK"), default="NEXTN", help="DSPARK: also "
                    "the DSpark step of --speculative-draft-model-path's draft (block = its block_size), after the "
                    "plain and NEXTN --steps rows; bench.census_offline only for now (its time: bench.bench_dspark)")
    ap.add_argument("--speculative-draft-model-path", default=None, help="DSPARK: the draft checkpoint dir (its "
                    "config.json; the census needs no weights)")
    ap.add_argument("--speculative-dspark-verify", default="static", help="DSPARK: comma list of static, confidence "
                    "(SpecConfig.dspark_verify), one DSpark step per entry")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name (e.g. -pdl)")
    ap.add_argument("--tree", default=None, help="the commit / tree benched, recorded as the JSON's `tree` (the "
                    "device copy's git metadata may be stale; default: its git HEAD, marked as such)")
    ap.add_argument("--spec-parts", action="store_true", help="also run bench_spec's parts on the same params")
    ap.add_argument("--no-census", action="store_true")
    ap.add_argument("--multi-step", type=int, default=1, help="run N steps per dispatch (lax.scan over the step "
                    "inside one program; times are per step): is the host's per-dispatch cost the fixed cost?")
    ap.add_argument("--dump-hlo", action="store_true", help="write each step's optimised HLO (gzip) to --out")
    ap.add_argument("--kernels", default="auto", help="RuntimeOptions.kernels (auto: Pallas on GPU, run per "
                    "device under shard_map over TP)")
    ap.add_argument("--fused-linear", action="store_true", help="KernelCalls.fused_linear=True: the layers' "
                    "projections through pallas_kernels/fused_linear.py instead of XLA (off by default)")
    ap.add_argument("--no-fused-linear-fp8", dest="fused_linear_fp8", action="store_false", help="KernelCalls."
                    "fused_linear_fp8=False: block-fp8 weights' projections through XLA (dequantised to bf16 every step) "
                    "instead of pallas_kernels/fused_linear_fp8.py (the default)")
    ap.add_argument("--no-moe-router-tables", dest="moe_router_tables", action="store_false",
                    help="KernelCalls.moe_router_tables=False: the router without the MoE's tables, the alignment in "
                    "XLA (the default before 2026-12-02)")
    ap.add_argument("--moe-router-norm", action=argparse.BooleanOptionalAction,
                    default=GPU_DEFAULTS["moe_router_norm"], help="KernelCalls.moe_router_norm=True: the MoE "
                    "layer's input RMSNorm in router_segments' program (with moe_router_tables; on by default)")
    ap.add_argument("--no-moe-router-scatter", dest="moe_router_scatter", action="store_false",
                    help="KernelCalls.moe_router_scatter=False: router_segments' 'onehot' program (the default "
                    "before 2026-12-03)")
    ap.add_argument("--moe-shared-segments", action=argparse.BooleanOptionalAction,
                    default=GPU_DEFAULTS["moe_shared_segments"], help="KernelCalls.moe_shared_segments=True: a "
                    "shared expert of width n x I (the v2 demo: 192 = 3 x 64) inside the Triton MoE kernels as n "
                    "chunks instead of XLA's dots (on by default; A/B: --baseline-set moe_shared_segments=0)")
    ap.add_argument("--moe-residual-epilogue", action="store_true", help="KernelCalls.moe_residual_epilogue=True: "
                    "the MoE layer's residual add in the Triton MoE's down launch (moe_down_residual: the fused "
                    "combine + add) instead of moe_down + XLA's combine-and-add fusion (router-tables chain, T <= 32; "
                    "off by default; A/B: --baseline-set moe_residual_epilogue=0)")
    ap.add_argument("--kda-verify-epilogue", action=argparse.BooleanOptionalAction,
                    default=GPU_DEFAULTS["kda_verify_epilogue"], help="KernelCalls.kda_verify_epilogue=True: the "
                    "KDA output norm + gate inside the verify kernel (one program per head, heads V <= 64: the demo) "
                    "instead of XLA's (on by default; A/B: --baseline-set kda_verify_epilogue=0)")
    ap.add_argument("--norm-linear-triton", action=argparse.BooleanOptionalAction,
                    default=GPU_DEFAULTS["norm_linear_triton"], help="KernelCalls.norm_linear_triton=True: "
                    "the RMSNorm + projections of one input at T <= 17 rows (bf16) in ONE Triton launch "
                    "(pallas_kernels/norm_linear_triton.py) instead of XLA's reduce + matvecs (on by default; "
                    "A/B: --baseline-set norm_linear_triton=0)")
    ap.add_argument("--linear-residual-triton", action=argparse.BooleanOptionalAction,
                    default=GPU_DEFAULTS["linear_residual_triton"], help="KernelCalls.linear_residual_triton=True: "
                    "the output projections + residual add at T <= 17 rows (bf16) in ONE Triton launch instead of "
                    "XLA's matvec + add (on by default; A/B: --baseline-set linear_residual_triton=0)")
    # off by default (not in GPU_DEFAULTS until timed): --lm-head-argmax turns it on, --no-lm-head-argmax off
    ap.add_argument("--lm-head-argmax", action=argparse.BooleanOptionalAction,
                    default=GPU_DEFAULTS.get("lm_head_argmax", KernelCalls.lm_head_argmax),
                    help="KernelCalls.lm_head_argmax=True: the greedy steps' final norm + lm_head + argmax as two "
                    "Triton launches, no logits (pallas_kernels/lm_head_argmax_triton.py; off by default; A/B: "
                    "--baseline-set lm_head_argmax=0)")
    ap.add_argument("--mtp-input-triton", action=argparse.BooleanOptionalAction,
                    default=GPU_DEFAULTS.get("mtp_input_triton", KernelCalls.mtp_input_triton),
                    help="KernelCalls.mtp_input_triton=True: the MTP's embedding gather + enorm / hnorm + eh_proj at "
                    "T <= 17 rows in ONE Triton launch (pallas_kernels/mtp_input_triton.py; off by default; A/B: "
                    "--baseline-set mtp_input_triton=0)")
    ap.add_argument("--mla-live-prefix", action="store_true", help="KernelCalls.mla_live_prefix=True: decode/verify "
                    "MLA attention over the live prefix only (pallas_kernels/mla_attention.py; off by default)")
    ap.add_argument("--mla-triton", action=argparse.BooleanOptionalAction, default=GPU_DEFAULTS["mla_triton"],
                    help="KernelCalls.mla_triton=True: decode/verify MLA "
                    "attention + W_uv (and, at small heads, q_nope W_uk and the q rope) in 2 Triton launches over the "
                    "live prefix (pallas_kernels/mla_triton.py) instead of XLA's over every slot (on by default; A/B: "
                    "--baseline-set mla_triton=0)")
    ap.add_argument("--p2p-allreduce", action="store_true", help="KernelCalls.p2p_allreduce=True (--tp >= 2): each "
                    "MoE layer's all-reduce + residual add + next RMSNorm as one peer-to-peer Mosaic kernel instead "
                    "of psum (shapes the kernel rejects stay on psum)")
    ap.add_argument("--moe-fp8-scheme", default=KernelCalls.moe_fp8_scheme, choices=MOE_FP8_SCHEMES, help="KernelCalls.moe_fp8_scheme: "
                    "what the fp8 MoE kernel's steps do with their e4m3 tiles under --fp8-activations none (dynamic "
                    "runs its w8a8 form)")
    ap.add_argument("--moe-n-tokens", type=int, default=64, help="KernelCalls.moe_n_tokens: the Mosaic MoE's token "
                    "columns (16, 32 or a multiple of 64)")
    ap.add_argument("--moe-fp8-n-tokens", type=int, default=KernelCalls.moe_fp8_n_tokens, help="KernelCalls.moe_fp8_n_tokens: the fp8 "
                    "Mosaic MoE's token columns (16: 16 / 32 / 64 as T grows; 0: --moe-n-tokens)")
    ap.add_argument("--moe-fp8-split-k", type=int, default=KernelCalls.moe_fp8_split_k, help="KernelCalls."
                    "moe_fp8_split_k: the fp8 MoE's down-GEMM split of I where it divides (0: the tiles' own)")
    ap.add_argument("--moe-fp8-tables", action=argparse.BooleanOptionalAction,
                    default=GPU_DEFAULTS.get("moe_fp8_tables", KernelCalls.moe_fp8_tables),
                    help="KernelCalls.moe_fp8_tables=True: the fp8 MoE's alignment, scale tables and x pad at T <= 32 "
                    "rows in ONE Triton launch (pallas_kernels/moe_fp8_tables.py) instead of XLA's ~8 (off by "
                    "default; A/B: --baseline-set moe_fp8_tables=0)")
    ap.add_argument("--fp8-linear-scale", default=KernelCalls.fp8_linear_scale, choices=FP8_LINEAR_SCALES,
                    help="KernelCalls.fp8_linear_scale: where the fp8 projections apply the block scale under "
                    "--fp8-activations none (dynamic runs the e4m3 form)")
    ap.add_argument("--fp8-activations", default=Numerics.fp8_activations, choices=quant.ACTIVATIONS,
                    help="Numerics.fp8_activations: dynamic quantises every fp8-weight GEMM's input per token and "
                    "128 columns (w8a8: the e4m3 fused projections and the w8a8 MoE kernel, the jnp with the same "
                    "quantisation where they do not take a call); none keeps it bf16 (weight-only fp8)")
    ap.add_argument("--baseline-set", default=None, metavar="FLAG=VALUE[,FLAG=VALUE]", help="also time the steps "
                    "with these flags changed (their argparse names with underscores, e.g. moe_fp8_scheme=partial-bits,"
                    "fp8_activations=none) in the same run, as the baseline")
    ap.add_argument("--baseline-fused-linear", action="store_true", help="also time the steps with fused_linear "
                    "and fused_linear_fp8 both flipped (the fused projections against XLA's; same kernels otherwise) in "
                    "the same run, as the baseline")
    ap.add_argument("--baseline-moe-fp8", default=None, metavar="SCHEME[:N]", help="also time the steps with "
                    "moe_fp8_scheme=SCHEME (and moe_fp8_n_tokens=N) in the same run, as the baseline")
    ap.add_argument("--baseline-kernels", default=None, help="also time the steps with these kernels (e.g. "
                    "reference: the XLA-only model) in the same run, as the baseline")
    ap.add_argument("--routing-from", default=None, help="a slice run's step JSON: reuse its mean distinct experts "
                    "per router call (saves compiling a routing-capture copy of the full model)")
    ap.add_argument("--quantization", default=None, choices=quant.QUANTIZATIONS, help="fp8: the weights "
                    "quant.fp8_policy picks as block fp8 (random init drawn in fp8; a bf16 --model quantised while "
                    "it loads; an fp8 checkpoint's tensors are fp8 either way)")
    ap.add_argument("--ttft", type=int, default=0, help="also time the first token of a prompt of this many tokens "
                    "(chunked prefill, the serving path; 0: off)")
    ap.add_argument("--ttft-chunks", default="1024", help="--chunked-prefill-size values for --ttft (fp8 on one "
                    "H200: the MLA scores of a chunk, 2 x H x chunk x slots x 4 B, and the dequantised expert stacks "
                    "of a layer, 6 GB, share ~12 GiB of headroom)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="also time each NEXTN step with the draft's "
                    "lm_head over this many tokens (ling_jax.draft_vocab; e.g. 32768; verification stays full)")
    ap.add_argument("--dry-run", action="store_true", help="print the memory plan, per-layer shapes and init "
                    "programs, and trace each step on abstract arrays; allocate nothing (runs on CPU)")
    ap.add_argument("--device-gib", type=float, default=None, help="--dry-run: the device's bytes (default: one "
                    "H200 at XLA_PYTHON_CLIENT_MEM_FRACTION 0.95)")
    ap.add_argument("--no-init-compile", action="store_true", help="--dry-run: skip compiling the init programs "
                    "on CPU (their temporaries)")
    return ap


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    for key in ZERO_IS_NONE:  # moe_fp8_n_tokens 0: the bf16 kernel's --moe-n-tokens; moe_fp8_split_k 0: the tiles'
        setattr(a, key, getattr(a, key) or None)
    if a.model and a.layers:
        ap.error("--layers slices a preset; --model loads a whole checkpoint")
    if a.speculative_algorithm == "DSPARK":
        ap.error("--speculative-algorithm DSPARK: the offline kernel census only (bench.census_offline); the DSpark "
                 "step's time is bench.bench_dspark's")
    if a.spec_parts and a.quantization:
        ap.error("--spec-parts counts bf16 bytes (bench_spec.byte_model): not with --quantization")
    if sum(map(bool, (a.baseline_kernels, a.baseline_fused_linear, a.baseline_moe_fp8, a.baseline_set))) > 1:
        ap.error("one baseline per run: --baseline-kernels, --baseline-fused-linear, --baseline-moe-fp8 or "
                 "--baseline-set")
    if a.baseline_moe_fp8:  # the same kernels with another fp8 MoE form: a --baseline-set of its two flags
        scheme, _, n = a.baseline_moe_fp8.partition(":")
        a.baseline_set = f"moe_fp8_scheme={scheme},moe_fp8_n_tokens={n or 0}"
    if a.baseline_set:
        a.baseline_set = parse_baseline_set(ap, a, a.baseline_set)
    tp = a.tp or len(jax.devices())
    if a.p2p_allreduce and tp < 2:
        ap.error(f"--p2p-allreduce needs --tp >= 2 (got TP{tp}: one device has no all-reduce)")
    mesh, rules = make_mesh(tp), ShardingRules.tensor_parallel()
    cfg = model_config(a)
    if a.dry_run:
        return dry_run(a, cfg, mesh, rules)
    run_all(a, cfg, tp, mesh, rules)


def run_all(a, cfg, tp, mesh, rules):
    device = f"{jax.devices()[0].device_kind} x{tp}"
    t0 = time.perf_counter()
    ceiling = Ceiling.measure(jax.devices()[0])
    bw = ceiling.bytes_per_s
    print(f"HBM ceiling {bw / 1e12:.2f} TB/s ({ceiling.source}; streaming read {ceiling.stream_bytes_per_s / 1e12:.2f},"
          f" XLA copy {ceiling.copy_bytes_per_s / 1e12:.2f})", flush=True)
    fl = fused_of(a)
    runs = [(m, K, p, dv, a.kernels, fl) for m, K, p, dv in programs(a, cfg, mesh, rules, a.kernels, fl)]
    base = []
    if a.baseline_kernels:
        base = [(m, K, p, dv, a.baseline_kernels, fl) for m, K, p, dv in programs(a, cfg, mesh, rules,
                                                                                 a.baseline_kernels, fl)]
    if a.baseline_fused_linear:
        flip = (not fl[0], not fl[1])  # the fused projections against XLA's, bf16 and fp8 weights alike
        base = [(m, K, p, dv, a.kernels, flip) for m, K, p, dv in programs(a, cfg, mesh, rules, a.kernels, flip)]
    if a.baseline_set:  # the same kernels with some flags changed; labelled through the kernels field
        b = argparse.Namespace(**{**vars(a), **a.baseline_set})
        label = f"{a.kernels}, " + ", ".join(f"{k}={v}" for k, v in a.baseline_set.items())
        base = [(m, K, p, dv, label, fused_of(b)) for m, K, p, dv in programs(b, cfg, mesh, rules, a.kernels,
                                                                                fused_of(b))]
    if base:  # each step's baseline right after it: a run cut short by a timeout keeps whole A/B pairs
        runs = [r for pair in zip(runs, base) for r in pair]
    plan = step_budget.budget(cfg, jnp.bfloat16, a.quantization, {f"{m}{K}": p for m, K, p, *_ in runs},
                              device_memory_bytes(), tp)
    print("memory plan (per device, before allocating):\n  " + "\n  ".join(plan.lines()), flush=True)
    plan.check(what="(weights + state)")
    params = load_model(a, mesh, rules, cfg)
    jax.block_until_ready(params)
    host = step_budget.host_peak_bytes()
    print(f"params {cfg.name} TP{tp} quantization={a.quantization}: ready {time.perf_counter() - t0:.1f} s, host peak "
          f"RSS {'?' if host is None else f'{host / 2**30:.2f} GiB'}", flush=True)
    rows, extra = [], {"hbm_bw_bytes_per_s": bw, **ceiling.summary(), "model": a.model or cfg.name, "tp": tp,
                       "ctx": a.ctx, "census": {}, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       "quantization": a.quantization, "memory_plan": plan.lines(), "host_peak_rss_bytes": host,
                       "routing_source": a.routing_from or "captured from this run's router (jnp copy of the step)"}
    fused = a.fused_linear
    extra.update(kernels=a.kernels, kda_verify_epilogue=a.kda_verify_epilogue,
                 norm_linear_triton=a.norm_linear_triton, linear_residual_triton=a.linear_residual_triton,
                 lm_head_argmax=a.lm_head_argmax, mtp_input_triton=a.mtp_input_triton, fused_linear=fused,
                 fused_linear_fp8=a.fused_linear_fp8,
                 p2p_allreduce=a.p2p_allreduce,
                 moe_router_tables=a.moe_router_tables, moe_router_norm=a.moe_router_norm,
                 moe_router_scatter=a.moe_router_scatter, moe_shared_segments=a.moe_shared_segments,
                 moe_residual_epilogue=a.moe_residual_epilogue,
                 mla_live_prefix=a.mla_live_prefix, mla_triton=a.mla_triton, moe_fp8_scheme=a.moe_fp8_scheme,
                 moe_n_tokens=a.moe_n_tokens,
                 moe_fp8_n_tokens=a.moe_fp8_n_tokens, moe_fp8_split_k=a.moe_fp8_split_k,
                 moe_fp8_tables=a.moe_fp8_tables, fp8_linear_scale=a.fp8_linear_scale,
                 fp8_activations=a.fp8_activations,
                 baseline_set=a.baseline_set, tree=tree_of(a.tree),
                 multi_step=a.multi_step, reps=a.reps)
    # "-kdaverify": the name the step files had while a second KDA path (the deleted KDA chain) existed
    prefix = "step" + ("-" + os.path.basename(os.path.normpath(a.model)) if a.model else "") + "-kdaverify"
    prefix += (f"-{a.quantization}" if a.quantization else "") + ("-fl" if fused else "")
    prefix += "-nofl8" if a.quantization and not a.fused_linear_fp8 else ""
    prefix += "-p2p" if a.p2p_allreduce else ""
    prefix += "" if a.moe_router_tables else "-nomrt"
    # GPU_DEFAULTS' fields are on by default (2026-12-07): tagged when off
    prefix += "" if a.moe_router_norm else "-normxla"
    prefix += "" if a.moe_router_scatter else "-onehot"
    prefix += "" if a.moe_shared_segments else "-nomss"
    prefix += "" if a.kda_verify_epilogue else "-nokvep"
    prefix += "" if a.norm_linear_triton else "-nonlt"
    prefix += "" if a.linear_residual_triton else "-nolrt"
    prefix += "-mre" if a.moe_residual_epilogue else ""
    prefix += "-lha" if a.lm_head_argmax else ""
    prefix += "-mit" if a.mtp_input_triton else ""
    prefix += "-live" if a.mla_live_prefix else ""
    prefix += "" if a.mla_triton else "-nomlat"
    prefix += "" if a.moe_fp8_scheme == KernelCalls.moe_fp8_scheme else f"-moe{a.moe_fp8_scheme}"
    prefix += "" if a.moe_n_tokens == 64 else f"-n{a.moe_n_tokens}"
    prefix += "" if a.moe_fp8_n_tokens == KernelCalls.moe_fp8_n_tokens else f"-fp8n{a.moe_fp8_n_tokens}"
    prefix += "" if a.moe_fp8_split_k == KernelCalls.moe_fp8_split_k else f"-fp8ks{a.moe_fp8_split_k}"
    prefix += "" if a.fp8_linear_scale == KernelCalls.fp8_linear_scale else f"-fl8{a.fp8_linear_scale}"
    prefix += "-mft" if a.moe_fp8_tables else ""
    prefix += "" if a.fp8_activations == Numerics.fp8_activations else f"-act{a.fp8_activations}"
    kept = None
    os.makedirs(a.out, exist_ok=True)
    write(a.out, prefix + a.tag, rows, extra, device)  # the plan and ceiling survive a crash of the first step
    for mode, K, prog, dv, kernels, fl in runs:
        p = params if dv is None else with_draft_vocab(params, random_draft_vocab(cfg, dv))
        try:
            kept = run_one(a, cfg, mesh, rules, p, bw, plan, rows, extra, mode, K, prog, kernels, prefix, dv,
                           fl) or kept
        except Exception as e:  # noqa: BLE001  (one step's compile / OOM must not cost the other rows)
            rows.append({"name": f"{mode}{K} [kernels={kernels}, {fused_label(fl)}]",
                         "error": f"{type(e).__name__}: {str(e)[:1500]}"})
            print(f"FAILED {rows[-1]['name']}: {rows[-1]['error'][:600]}", flush=True)
        del p
        write(a.out, prefix + a.tag, rows, extra, device)  # partial results survive a timeout
    if a.ttft:
        try:
            rows += time_ttft(a, cfg, params, a.kernels)
        except Exception as e:  # noqa: BLE001  (an OOM of the prefill program must not cost the step rows)
            rows.append({"name": f"TTFT prompt {a.ttft}", "error": f"{type(e).__name__}: {str(e)[:600]}"})
            print(f"TTFT failed: {rows[-1]['error']}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    print("wrote", write(a.out, prefix + a.tag, rows, extra, device))
    if a.spec_parts and kept is None:
        print("--spec-parts skipped: the NEXTN 5 step did not run (its error row above)", flush=True)
    elif a.spec_parts:
        from bench import bench_spec

        srows = bench_spec.run(cfg, mesh, rules, params, bw, a.ctx, a.reps, K=5, fused=kept[0], routing=kept[1])
        print("wrote", write(a.out, "spec" + a.tag, srows, {"hbm_bw_bytes_per_s": bw, "model": cfg.name, "tp": tp,
                                                             "ctx": a.ctx}, device))


def run_one(a, cfg, mesh, rules, params, bw, plan, rows, extra, mode, K, prog, kernels, prefix, dv=None,
            fl: tuple[bool, bool] = (False, True)):
    """Compile, time (and census) one step; appends its row. Returns (step, routing) of the main NEXTN 5 step.
    dv: the draft vocabulary's size when params carry one (ling_jax.draft_vocab). fl: its KernelCalls.fused_linear
    and fused_linear_fp8 (a baseline when they differ from the flags')."""
    baseline = kernels != a.kernels or fl != fused_of(a)
    step, temp = compile_step(prog, mesh, rules, params, plan, a.multi_step)
    state = random_state(prog, mesh, rules, a.ctx)
    routing = routing_from(a.routing_from, cfg, mode, K) if a.routing_from else distinct_experts(prog, params, state)
    tc = time.perf_counter()
    disp: list = []
    t, state = time_chain(step, params, state, reps=a.reps, dispatch=disp)
    t, disp[0] = t / a.multi_step, disp[0] / a.multi_step  # per step
    nbytes = floor_bytes(cfg, mesh, rules, mode, K, routing, a.ctx, a.quantization, dv)
    name = "plain decode step" if mode == "plain" else f"NEXTN step (steps={K}, {K + 1} verify rows)"
    name += f" [draft vocab {dv}]" if dv else ""
    name += f" [kernels={kernels}]" if kernels != a.kernels else ""
    name += f" [{fused_label(fl)}]" if fl != fused_of(a) else ""
    r = row(name, t, nbytes, bw, distinct_experts_per_router_call=routing, compile_and_time_s=time.perf_counter() - tc,
            kernels=kernels, layer_passes=layer_passes(cfg, mode, K), host_dispatch_us=disp[0] * 1e6,
            xla_temp_bytes=temp)
    if baseline:
        main_row = next((x for x in rows if x["name"] == name.split(" [kernels=")[0].split(" [fused_linear=")[0]),
                        None)  # None: the main step failed (its error row)
        what = f"kernels={kernels}" if kernels != a.kernels else fused_label(fl)
        if main_row is not None:
            main_row.update(baseline=f"the same step with {what}, same run", baseline_time_us=t * 1e6)
    if mode == "nextn":
        r["projected_tpot_us_at_seed_accept"] = t * 1e6 / SEED_ACCEPT
    rows.append(r)
    print(f"{name:42s} {t * 1e6:9.1f} us  floor {r['floor_us']:8.1f} us  {100 * r['fraction_of_floor']:5.1f} %  "
          f"({nbytes / 1e9:.3f} GB/device)  host dispatch {disp[0] * 1e6:.0f} us/call", flush=True)
    # a fused_linear baseline gets its census too: its kernels per layer pass are the A/B's other half
    if not a.no_census and kernels == a.kernels and not dv and (mode == "plain" or K == 5):
        n = a.multi_step  # the census profiles whole dispatches: n steps each
        c, state = census(step, params, state, 5, t * n, tempfile.mkdtemp(prefix=f"prof-{mode}{K}-"),
                          layer_passes(cfg, mode, K) * n)
        extra["census"][name] = c
        per_call = c.get("kernels_per_step_per_device")
        r["kernels_per_step"] = per_call / n if per_call is not None else None
        r["kernels_per_layer_pass"] = c.get("kernels_per_layer_pass")
        print(json.dumps({k: v for k, v in c.items() if k != "top_kernels"})[:1500], flush=True)
    if a.dump_hlo and not baseline:  # the optimised HLO of the timed program (what the census counts)
        with gzip.open(os.path.join(a.out, f"hlo-{prefix}{a.tag}-{mode}{K}.txt.gz"), "wt") as f:
            f.write(step.advance.as_text())
    del state
    return (step, routing) if mode == "nextn" and K == 5 and not baseline and not dv else None


if __name__ == "__main__":
    main()
