"""The compile report: programs, collectives per step and per layer, custom calls, kernels, HBM bytes, times."""

from __future__ import annotations

import jax

from compile.sharding import ShardingRules, bytes_per_device, shardings_for, state_shardings
from compile.stages import Built
from ling_jax.weights import abstract_params


def layer_passes(built: Built) -> int:
    """Decoder-layer evaluations in one step: the target layers (+ MTP draft forwards and the extend)."""
    p = built.prog
    n = p.cfg.num_hidden_layers
    return n + (p.steps - 1) + 1 if p.mode == "nextn" else n


def report_dict(built: Built, mesh, rules: ShardingRules) -> dict:
    p = built.prog
    params = abstract_params(p.cfg, jax.numpy.dtype(p.dtype))
    param_sh = jax.tree.map(shardings_for(p.cfg, mesh, rules), _infos(p.cfg))
    state = p.abstract_state()
    c = built.census
    passes = layer_passes(built)
    mem = built.compiled.memory_analysis()
    mem_d = {}
    if mem is not None:
        for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                  "generated_code_size_in_bytes"):
            mem_d[k] = int(getattr(mem, k, 0) or 0)
    return {
        "model": p.cfg.name,
        "mode": p.mode,
        "steps": p.steps if p.mode == "nextn" else 0,
        "tp_size": int(mesh.devices.size),
        "platform": mesh.devices.flat[0].platform,
        "rules": {k: v for k, v in vars(rules).items()},
        "max_len": p.max_len,
        "dtype": p.dtype,
        "programs_per_step": built.checks.programs,
        "host_callbacks": built.checks.host_callbacks,
        "donated_leaves": built.checks.donated_leaves,
        "aliased_outputs": built.checks.aliased_outputs,
        "collectives_per_step": c.collectives,
        "collectives_total": c.total_collectives,
        "layer_passes_per_step": passes,
        "collectives_in_layers": c.in_layers(),
        "collectives_per_layer_pass": c.in_layers() / passes,
        "collectives_by_op": c.collectives_by_source,
        "custom_calls_lowered": built.checks.custom_calls,
        "custom_calls_compiled": c.custom_calls,
        "kernels_static": c.kernels,
        "while_loops": c.while_loops,
        "param_bytes_per_device": bytes_per_device(params, param_sh),
        "param_bytes_total": sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params)),
        "state_bytes_per_device": bytes_per_device(state, state_shardings(state, mesh, rules)),
        "memory_analysis": mem_d,
        "lower_s": round(built.lower_s, 2),
        "compile_s": round(built.compile_s, 2),
        "compiler_options": built.options,
        "executable_key": built.key,
    }


def _infos(cfg):
    from ling_jax.weights import array_spec, unflatten

    spec = array_spec(cfg)
    return unflatten(spec, spec)


def _gb(n):
    return f"{n / 1e9:.2f} GB"


def format_report(d: dict) -> str:
    lines = [
        f"model {d['model']}  mode {d['mode']} (steps {d['steps']})  TP {d['tp_size']} on {d['platform']}  "
        f"max_len {d['max_len']}  {d['dtype']}",
        f"programs per step        {d['programs_per_step']}   host callbacks {d['host_callbacks'] or 'none'}   "
        f"donated state leaves aliased {d['aliased_outputs']}/{d['donated_leaves']}",
        f"collectives per step     {d['collectives_total']}  {d['collectives_per_step']}",
        f"  in layers              {d['collectives_in_layers']} over {d['layer_passes_per_step']} layer passes = "
        f"{d['collectives_per_layer_pass']:.2f} per layer pass",
    ]
    for k, n in list(d["collectives_by_op"].items())[:12]:
        lines.append(f"    {n:4d}  {k}")
    lines += [
        f"custom calls             lowered {d['custom_calls_lowered'] or '{}'}  compiled {d['custom_calls_compiled']}",
        f"kernels (static, HLO)    {d['kernels_static']}  while loops {d['while_loops']}",
        f"HBM per device           params {_gb(d['param_bytes_per_device'])} (of {_gb(d['param_bytes_total'])}) + "
        f"state {_gb(d['state_bytes_per_device'])}",
        f"memory_analysis          " + "  ".join(f"{k.replace('_size_in_bytes', '')} {_gb(v)}"
                                                for k, v in d["memory_analysis"].items()),
        f"lower {d['lower_s']} s  compile {d['compile_s']} s  options {d['compiler_options']}",
    ]
    return "\n".join(lines)
