"""The staged compiler: trace -> lower -> compile -> serialize/load, each stage a function of its own.

  1. trace    `jax.jit(f, out_shardings, donate).trace(*abstract)` over ShapeDtypeStructs that carry their
              shardings: nothing is allocated on any device.
  2. lower    StableHLO, checked: one program (one public @main), no host callbacks / infeed / outfeed /
              host send-recv, every donated state leaf aliased to an output (`tf.aliasing_output`).
  3. compile  XLA with command buffers (WHILE/CONDITIONAL added on GPU), the latency-hiding scheduler, the
              persistent compilation cache; the compiled HLO is read for collectives, custom calls, kernels.
  4. serialize / load executables keyed by (config, mesh, mode, shapes + shardings, jax version, flags).
Programs: "nextn" (spec_step), "plain" (plain_step), "dspark" (dspark_step: params are (target, draft)); parts for
benches live in bench/.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import pickle
import re
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from compile.sharding import ShardingRules, kernel_calls_for, shardings_for, state_shardings, with_shardings
from ling_jax.config import ModelConfig
from ling_jax import dspark
from ling_jax.decode import PlainState, plain_step
from ling_jax.dspark_step import DSparkState, dspark_step
from ling_jax.model import RuntimeOptions
from ling_jax.sampling import SamplingParams, TokenHistory
from ling_jax.spec import SpecConfig, SpecState, spec_step
from ling_jax.state import state_shapes
from ling_jax.weights import abstract_params

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
HOST_CALLBACK_TARGETS = ("callback", "host_callback", "xla_python", "py_callback")

# GPU compile options (DebugOptions fields of jaxlib 0.11.2; names checked against the library's strings).
GPU_OPTIONS = {
    "xla_gpu_enable_command_buffer": "+WHILE,+CONDITIONAL",  # graphs also around loops and branches
    "xla_gpu_graph_min_graph_size": 1,
    "xla_gpu_enable_latency_hiding_scheduler": True,
}


@dataclass(frozen=True)
class Program:
    """One step program to build: which function, at which static shapes."""

    cfg: ModelConfig
    mode: str = "nextn"  # "nextn" | "plain" | "dspark"
    steps: int = 5  # NEXTN drafted tokens per step (DSPARK: the draft's block_size)
    batch: int = 1
    max_len: int = 8192
    dtype: str = "bfloat16"
    is_greedy: bool = True
    opts: RuntimeOptions = RuntimeOptions()
    # The step a request without `logprobs` runs (ling_jax.runner compiles the logprob outputs only when asked):
    # the top-k over the vocabulary is a sort on the GPU (32 us per step on the demo model, bench_step census).
    with_logprobs: bool = False
    # False: the program serves only requests with neutral penalties and no logit bias (the benches' states), so a
    # greedy step may take its tokens from the fused lm_head + argmax (ling_jax.spec.argmax_only)
    adjusts_logits: bool = True
    draft: dspark.DSparkConfig | None = None  # mode "dspark": the draft's config (its params: draft_abstract_params)
    dspark_verify: str = "static"  # mode "dspark": SpecConfig.dspark_verify

    def fn(self):
        """(params, state) -> (state, StepOutput); mode "dspark": params = (target params, draft params)."""
        kw = dict(cfg=self.cfg, is_greedy=self.is_greedy, opts=self.opts, with_logprobs=self.with_logprobs,
                  adjusts_logits=self.adjusts_logits)
        if self.mode == "nextn":
            return functools.partial(spec_step, steps=self.steps, **kw)
        if self.mode == "plain":
            return functools.partial(plain_step, **kw)
        if self.mode == "dspark":
            step = functools.partial(dspark_step, dcfg=self.draft, spec=self.spec(), **kw)
            return lambda pp, state: step(pp[0], pp[1], state)  # runner.Generator's run_params = (target, draft)
        raise ValueError(f"mode {self.mode!r}: expected 'nextn', 'plain' or 'dspark'")

    def spec(self) -> SpecConfig:
        """The DSPARK SpecConfig of a "dspark" program (num_steps = the draft's block size)."""
        if self.draft is None or self.steps != self.draft.block_size:
            raise ValueError(f"a dspark Program needs its draft config with steps = block_size (steps={self.steps}, "
                             f"draft={self.draft})")
        return SpecConfig("DSPARK", self.steps, dspark_verify=self.dspark_verify)

    def abstract_state(self):
        """ShapeDtypeStructs of the step's carry (SpecState or PlainState), built directly (no tracing)."""
        S = jax.ShapeDtypeStruct
        B, dt, cfg = self.batch, jnp.dtype(self.dtype), self.cfg
        target = state_shapes(cfg, B, self.max_len, dt)
        key = jax.eval_shape(lambda: jax.random.key(0))
        sampling, history = SamplingParams.shapes(cfg.vocab_size), TokenHistory.shapes(B, cfg.vocab_size)
        tok = S((B,), jnp.int32)
        if self.mode == "plain":
            return PlainState(target=target, bonus=tok, key=key, sampling=sampling, history=history)
        if self.mode == "dspark":
            d = self.draft
            ctx = S((d.num_hidden_layers, B, self.max_len, d.num_key_value_heads, d.head_dim), dt)  # as dspark_init
            hist = S((d.block_size + 1,), jnp.int32)
            return DSparkState(target=target, bonus=tok, ctx_k=ctx, ctx_v=ctx, key=key, sampling=sampling,
                               history=history, accept_hist=hist, length_hist=hist)
        return SpecState(target=target, bonus=tok, draft_cache=S((B, self.max_len, cfg.mla_cache_dim), dt),
                         seed=tok, draft_hidden=S((B, cfg.hidden_size), dt),
                         seed_q=None if self.is_greedy else S((B, cfg.vocab_size), jnp.float32),
                         key=key, sampling=sampling, accept_hist=S((self.steps + 1,), jnp.int32), history=history)


def draft_abstract_params(dcfg: dspark.DSparkConfig, dtype, sharding=None):
    """The DSpark draft's params (dspark.init_params' tree) as ShapeDtypeStructs; sharding: every leaf's (the draft
    runs replicated)."""
    return dspark.unflatten({name: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
                             for name, shape in dspark.weight_shapes(dcfg).items()})


# ---- stage 1: trace ---------------------------------------------------------------------------------------------


def abstract_inputs(prog: Program, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """(params, state) as ShapeDtypeStructs with their shardings (mode "dspark": params = (target, draft), the
    draft replicated)."""
    params = abstract_params(prog.cfg, jnp.dtype(prog.dtype), shardings_for(prog.cfg, mesh, rules))
    if prog.mode == "dspark":
        params = (params, draft_abstract_params(prog.draft, prog.dtype, NamedSharding(mesh, PartitionSpec())))
    state = prog.abstract_state()
    return params, with_shardings(state, state_shardings(state, mesh, rules))


def trace(prog: Program, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """Stage 1. Returns (jax.stages.Traced, jitted function). The state (argument 1) is donated and comes back
    with the same shardings, so XLA can update it in place."""
    params, state = abstract_inputs(prog, mesh, rules)
    fn = dataclasses.replace(prog, opts=kernel_calls_for(prog.opts, mesh, rules)).fn()
    out = jax.eval_shape(fn, params, state)
    jitted = jax.jit(fn, out_shardings=state_shardings(out, mesh, rules), donate_argnums=(1,))
    return jitted.trace(params, state), jitted


# ---- stage 2: lower + checks ------------------------------------------------------------------------------------


@dataclass
class LoweringChecks:
    programs: int  # public entry functions in the module (1 = the whole step is one program)
    host_callbacks: list[str]  # custom-call targets / ops that would reach the host
    donated_leaves: int
    aliased_outputs: int
    custom_calls: dict[str, int]  # StableHLO custom_call targets (Pallas kernels show up here)

    @property
    def ok(self) -> bool:
        return self.programs == 1 and not self.host_callbacks and self.aliased_outputs == self.donated_leaves

    def raise_if_failed(self):
        if not self.ok:
            raise AssertionError(f"lowering checks failed: {self}")


def lower(traced) -> jax.stages.Lowered:
    """Stage 2: StableHLO."""
    return traced.lower()


def check_lowered(lowered, donated_leaves: int) -> LoweringChecks:
    text = lowered.as_text()
    programs = len(re.findall(r"func\.func public @", text))
    targets = collections.Counter(re.findall(r"custom_call @([\w.$-]+)", text))
    targets.update(re.findall(r'call_target_name = "([^"]+)"', text))
    bad = [t for t in targets if any(h in t.lower() for h in HOST_CALLBACK_TARGETS)]
    for op in ("stablehlo.infeed", "stablehlo.outfeed", "stablehlo.send", "stablehlo.recv"):
        if op in text:
            bad.append(op)
    aliased = len(re.findall(r"tf\.aliasing_output", text)) + len(re.findall(r"jax\.buffer_donor", text))
    return LoweringChecks(programs, bad, donated_leaves, aliased, dict(targets))


# ---- stage 3: compile -------------------------------------------------------------------------------------------


def enable_persistent_cache(cache_dir: str) -> None:
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def compiler_options(platform: str) -> dict:
    return dict(GPU_OPTIONS) if platform in ("gpu", "cuda", "rocm") else {}


def compile_lowered(lowered, options: dict | None = None):
    """Stage 3. Returns (compiled, seconds, options actually used). If the GPU options are refused, retry with
    XLA's defaults (and say so in the returned options)."""
    options = compiler_options(jax.default_backend()) if options is None else options
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    except Exception as e:  # noqa: BLE001 - a flag this build refuses: fall back, and record it
        if not options:
            raise
        compiled = lowered.compile()
        options = {"fallback_to_defaults": f"{type(e).__name__}: {str(e)[:200]}"}
    return compiled, time.perf_counter() - t0, options


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = [^=]*?\b([a-z][a-z0-9\-]*)\(", re.M)
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-done", "all-reduce-done",
                "all-gather-done", "collective-permute-done", "async-done", "partition-id", "replica-id",
                "after-all", "opt-barrier", "add-dependency"}


def _computations(hlo: str) -> dict[str, str]:
    """Computation name -> body text of an HLO module."""
    out, name, buf = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            name, buf = ("ENTRY" if line.startswith("ENTRY") else m.group(1)), []
            continue
        if line.startswith("}") and name:
            out[name] = "\n".join(buf)
            name = None
            continue
        if name:
            buf.append(line)
    return out


def _op_name(line: str) -> str:
    """The JAX op an HLO instruction came from (its metadata op_name, without the jit(...) prefixes)."""
    m = re.search(r'op_name="([^"]+)"', line)
    if not m:
        return "?"
    parts = m.group(1).split("/")
    return "/".join(parts[1:] if parts[0].startswith("jit(") else parts) or m.group(1)


# Collectives that belong to no decoder layer: embedding lookup, lm_head / argmax over the vocab shards.
OUTSIDE_LAYERS = ("_take", "reduce", "argmax", "vd->", "sort", "cumsum", "top_k", "log_softmax", "take_along_axis")


@dataclass
class HloCensus:
    collectives: dict[str, int]  # kind -> count (static, in the whole module)
    collectives_by_source: dict[str, int]  # "kind @ jax op" -> count
    custom_calls: dict[str, int]
    kernels: int  # top-level launches in ENTRY + while/conditional bodies (static count)
    while_loops: int

    @property
    def total_collectives(self) -> int:
        return sum(self.collectives.values())

    def in_layers(self) -> int:
        """Collectives attributed to decoder layers (everything but embedding / vocab reductions). XLA's combiner
        may merge reductions into one collective (sources joined by ':'): it is a layer's if any source is."""
        def inside(src: str) -> bool:
            return any(not any(o in part for o in OUTSIDE_LAYERS) for part in src.strip("()").split(":"))

        return sum(n for k, n in self.collectives_by_source.items() if inside(k.split(" @ ", 1)[1]))


def hlo_census(compiled) -> HloCensus:
    """Read the optimised (partitioned) HLO: collectives with their source lines, custom calls, kernel count."""
    hlo = compiled.as_text()
    comps = _computations(hlo)
    coll, by_src, ccalls = collections.Counter(), collections.Counter(), collections.Counter()
    for line in hlo.splitlines():
        m = re.search(r"= [^=]*?\b(" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if m:
            coll[m.group(1)] += 1
            by_src[f"{m.group(1)} @ {_op_name(line)}"] += 1
        c = re.search(r'custom_call_target="([^"]+)"', line)
        if c:
            ccalls[c.group(1)] += 1
    # kernels: instructions of ENTRY and of computations called as while/conditional bodies (not fusions'
    # insides, which are one kernel each)
    loop_bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo)) | set(re.findall(r"condition=%?([\w.\-]+)", hlo))
    for names in re.findall(r"branch_computations=\{([^}]*)\}", hlo):
        loop_bodies |= {n.strip().lstrip("%") for n in names.split(",")}
    kernels = 0
    for name in {"ENTRY"} | loop_bodies:
        body = comps.get(name, "")
        kernels += sum(1 for op in _INSTR.findall(body) if op not in _NOT_KERNELS)
    whiles = len(re.findall(r"\bwhile\(", hlo))
    return HloCensus(dict(coll), dict(by_src.most_common()), dict(ccalls), kernels, whiles)


# ---- stage 4: serialize / load ----------------------------------------------------------------------------------


def cache_key(prog: Program, mesh: Mesh, abstract_args, options: dict) -> str:
    """Everything an executable depends on: config, mesh (shape + device kind), program, shapes and shardings
    of every argument, jax version, backend, compiler options."""
    cfg = dataclasses.asdict(prog.cfg)
    devs = mesh.devices.flatten()
    args = jax.tree.map(lambda a: (a.shape, str(a.dtype), str(getattr(a, "sharding", None))), abstract_args)
    parts = [repr(sorted(cfg.items())), repr(dict(mesh.shape)), devs[0].device_kind, devs[0].platform,
             repr((prog.mode, prog.steps, prog.batch, prog.max_len, prog.dtype, prog.is_greedy, prog.opts,
                   prog.with_logprobs) + (() if prog.adjusts_logits else (False,))
             + (() if prog.draft is None else (repr(prog.draft), prog.dspark_verify))),
             repr(jax.tree.leaves(args)), str(jax.tree.structure(args)), jax.__version__, repr(sorted(options.items()))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def serialize(compiled) -> bytes:
    from jax.experimental.serialize_executable import serialize as _ser

    payload, in_tree, out_tree = _ser(compiled)
    return pickle.dumps((payload, in_tree, out_tree))


def deserialize(blob: bytes):
    from jax.experimental.serialize_executable import deserialize_and_load

    payload, in_tree, out_tree = pickle.loads(blob)
    return deserialize_and_load(payload, in_tree, out_tree)


def save_executable(compiled, directory: str, key: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{key}.xla")
    with open(path, "wb") as f:
        f.write(serialize(compiled))
    return path


def load_executable(directory: str, key: str):
    """The executable stored under `key`, or None."""
    path = os.path.join(directory, f"{key}.xla")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return deserialize(f.read())


@dataclass
class Built:
    prog: Program
    traced: object
    lowered: object
    compiled: object
    checks: LoweringChecks
    census: HloCensus
    compile_s: float
    lower_s: float
    options: dict
    key: str
    loaded_from_cache: bool = False


def build(prog: Program, mesh: Mesh, rules: ShardingRules = ShardingRules(), *, exec_dir: str | None = None,
          options: dict | None = None, check: bool = True) -> Built:
    """All four stages. With exec_dir, a stored executable of the same key is loaded instead of compiling."""
    t0 = time.perf_counter()
    traced, _ = trace(prog, mesh, rules)
    lowered = lower(traced)
    lower_s = time.perf_counter() - t0
    donated = len(jax.tree.leaves(prog.abstract_state()))
    checks = check_lowered(lowered, donated)
    if check:
        checks.raise_if_failed()
    options = compiler_options(mesh.devices.flat[0].platform) if options is None else options
    key = cache_key(prog, mesh, abstract_inputs(prog, mesh, rules), options)
    compiled = load_executable(exec_dir, key) if exec_dir else None
    loaded = compiled is not None
    compile_s = 0.0
    if compiled is None:
        compiled, compile_s, options = compile_lowered(lowered, options)
        if exec_dir:
            save_executable(compiled, exec_dir, key)
    census = hlo_census(compiled)
    return Built(prog, traced, lowered, compiled, checks, census, compile_s, lower_s, options, key, loaded)


def slice_config(cfg: ModelConfig, n_layers: int) -> ModelConfig:
    """The first n target layers (+ the MTP layers), keeping each kept layer's clamp limits. n must keep at least
    one MLA layer (a multiple of layer_group_size keeps the real layout) and one MoE layer."""
    if n_layers >= cfg.num_hidden_layers:
        return cfg
    if n_layers <= cfg.first_k_dense_replace:
        raise ValueError(f"--layers {n_layers}: need > {cfg.first_k_dense_replace} layers to keep a MoE layer")
    keep = list(range(n_layers)) + list(cfg.mtp_layers)
    pick = lambda lim: tuple(lim[i] for i in keep) if lim else lim
    out = cfg.replace(name=f"{cfg.name}-L{n_layers}", num_hidden_layers=n_layers,
                      routed_swiglu_limits=pick(cfg.routed_swiglu_limits),
                      shared_swiglu_limits=pick(cfg.shared_swiglu_limits))
    if not out.mla_layers:
        raise ValueError(f"--layers {n_layers} keeps no MLA layer")
    return out
