"""The memory plan of a step bench, printed before anything is allocated (so an OOM is explained), and the
dry run that verifies the plan on CPU with abstract arrays only (jax.eval_shape: nothing is allocated).

  python3 -m bench.bench_step --quantization fp8 --tp 1 --dry-run      (CPU: the whole Ling-3.0-flash on one H200)

Per device (TP divides the sharded arrays; weights are counted from the abstract parameter tree itself):
    weights  = fp8 w8 (1 B) + their f32 scales (4 B per 128 x 128 block) + bf16 (embedding, lm_head, norms,
               router, eh_proj) + f32 (A_log, dt_bias, expert_bias)
    state    = the step's carry (KDA recurrent states, conv windows, MLA latent caches, the draft cache), one at a
               time (each run's state is dropped before the next is made)
    temp     = XLA's temporaries of the step program (memory_analysis of the compiled step, printed after compile)
    headroom = device bytes - weights - state - temp
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax import quant
from ling_jax.weights import abstract_params, array_spec, get_path, init_program, is_fp8, resolve_dtype

GIB = 2**30
H200_ASSUMED_BYTES = int(0.95 * 139 * GIB)  # dry run on CPU: XLA_PYTHON_CLIENT_MEM_FRACTION 0.95 of ~139 GiB


def host_peak_bytes() -> int | None:
    """This process's peak resident host memory (VmHWM of /proc/self/status), or None where it is not readable."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def tree_bytes(tree) -> int:
    """Bytes of a pytree of arrays / ShapeDtypeStructs (PRNG keys: 8 B each)."""
    size = lambda dt: 8 if jnp.issubdtype(dt, jax.dtypes.prng_key) else jnp.dtype(dt).itemsize
    return sum(int(np.prod(x.shape)) * size(x.dtype) for x in jax.tree.leaves(tree))


def _storage(leaf) -> dict[str, int]:
    if isinstance(leaf, quant.Fp8Weight):
        return {"fp8": quant.nbytes(leaf.w8), "fp8 scales": quant.nbytes(leaf.scale_inv)}
    return {jnp.dtype(leaf.dtype).name: quant.nbytes(leaf)}


def layer_table(cfg, dtype, quantization) -> list[dict]:
    """One row per group of the parameter tree (embed, lm_head, final_norm, each layer, each MTP layer): its kind,
    bytes by storage, and its arrays' (name, shape, dtype)."""
    params = abstract_params(cfg, dtype, quantization=quantization)
    rows: dict[tuple, dict] = {}
    for a in array_spec(cfg):
        key = a.path[:2] if a.path[0] in ("layers", "mtp") else a.path[:1]
        if key not in rows:
            i = key[1] if key[0] == "layers" else (cfg.mtp_layers[key[1]] if key[0] == "mtp" else None)
            kind = "" if i is None else ("MLA" if cfg.is_mla(i) else "KDA") + (" + MoE" if cfg.is_moe(i) else " + dense")
            rows[key] = {"group": "/".join(map(str, key)), "kind": kind, "bytes": collections.Counter(), "arrays": []}
        leaf = get_path(params, a.path)
        rows[key]["bytes"].update(_storage(leaf))
        dt = "fp8 + scales" if isinstance(leaf, quant.Fp8Weight) else jnp.dtype(leaf.dtype).name
        rows[key]["arrays"].append(("/".join(map(str, a.path[len(key):])), a.shape, dt))
    return list(rows.values())


@dataclass(frozen=True)
class Budget:
    """Per-device bytes of one step bench (see module doc)."""

    device: int
    weights: dict[str, int]
    states: dict[str, int]  # program name -> bytes of its carry
    device_source: str = "measured"

    @property
    def weight_total(self) -> int:
        return sum(self.weights.values())

    def headroom(self, temp: int = 0) -> int:
        """Bytes left after the weights, the largest state and `temp`."""
        return self.device - self.weight_total - max(self.states.values(), default=0) - temp

    def lines(self) -> list[str]:
        g = lambda n: f"{n / GIB:8.2f} GiB"
        out = [f"device      {g(self.device)}  ({self.device_source})"]
        out += [f"weights     {g(self.weight_total)}  = " + " + ".join(f"{k} {v / GIB:.2f}" for k, v in self.weights.items())]
        out += [f"state       {g(v)}  {k}" for k, v in self.states.items()]
        out += [f"headroom    {g(self.headroom())}  for XLA temporaries and the runtime (after weights + the largest state)"]
        return out

    def check(self, temp: int = 0, what: str = "") -> None:
        """Raise before allocating when the plan cannot fit (the message says by how much and where)."""
        if self.headroom(temp) < 0:
            raise SystemExit(f"memory plan does not fit{' ' + what if what else ''}: weights {self.weight_total / GIB:.2f}"
                             f" GiB + state {max(self.states.values(), default=0) / GIB:.2f} GiB + temp "
                             f"{temp / GIB:.2f} GiB > device {self.device / GIB:.2f} GiB "
                             f"({-self.headroom(temp) / GIB:.2f} GiB short)")


def budget(cfg, dtype, quantization, programs: dict, device: int, tp: int = 1, source: str = "measured") -> Budget:
    """programs: name -> compile.stages.Program (its abstract state is counted; TP divides the weights)."""
    params = abstract_params(cfg, dtype, quantization=quantization)
    weights = collections.Counter()
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.Fp8Weight)):
        weights.update(_storage(leaf))
    weights = {k: v // tp for k, v in weights.items()}
    states = {name: tree_bytes(p.abstract_state()) for name, p in programs.items()}
    return Budget(device, dict(weights), states, source)


def init_programs(cfg, dtype, quantization, compile_temp: bool) -> list[dict]:
    """The distinct random-init programs (one per array signature; the 42 layers reuse them): shape, dtype, how
    many arrays use it, and (compile_temp) the temporaries XLA allocates to draw it, which must stay small next to
    the array itself (a stacked expert array is drawn 32 experts at a time)."""
    sigs: dict[tuple, dict] = {}
    for a in array_spec(cfg):
        sig = (a.init, a.shape, str(resolve_dtype(a, dtype)), a.fan_in, is_fp8(a, quantization))
        if sig in sigs:
            sigs[sig]["count"] += 1
            continue
        prog = init_program(a, dtype, None, quantization)
        out = jax.eval_shape(prog, jax.random.key(0))
        row = {"array": "/".join(map(str, a.path)), "shape": a.shape, "count": 1, "bytes": tree_bytes(out),
               "dtypes": [str(x.dtype) for x in jax.tree.leaves(out)]}
        if compile_temp:
            mem = prog.lower(jax.random.key(0)).compile().memory_analysis()
            row["temp_bytes"] = None if mem is None else int(mem.temp_size_in_bytes)
        sigs[sig] = row
    return list(sigs.values())


def print_dry_run(cfg, dtype, quantization, plan: Budget, compile_temp: bool) -> dict:
    """Print the layer table, the init programs and the budget; returns them as one dict (the JSON's)."""
    table = layer_table(cfg, dtype, quantization)
    print(f"{cfg.name}: {len(table)} parameter groups ({cfg.num_hidden_layers} layers + {len(cfg.mtp_layers)} MTP), "
          f"quantization={quantization}")
    for r in table:
        by = " + ".join(f"{k} {v / 1e6:.1f}" for k, v in r["bytes"].items())
        print(f"  {r['group']:10s} {r['kind']:13s} {sum(r['bytes'].values()) / 1e9:7.3f} GB  ({by} MB)")
    for r in table[:1] + [t for t in table if t["kind"]][:4]:  # one of each kind: the shapes
        print(f"  arrays of {r['group']}: " + ", ".join(f"{n} {list(s)} {d}" for n, s, d in r["arrays"]))
    progs = init_programs(cfg, dtype, quantization, compile_temp)
    print(f"random init: {len(progs)} distinct programs for {len(array_spec(cfg))} arrays")
    for p in sorted(progs, key=lambda p: -p["bytes"])[:8]:
        temp = "" if "temp_bytes" not in p else f"  temp {p['temp_bytes'] / 1e6:8.1f} MB (CPU compile)"
        print(f"  {p['array']:28s} {str(list(p['shape'])):18s} x{p['count']:3d}  {p['bytes'] / 1e6:9.1f} MB "
              f"{'+'.join(p['dtypes'])}{temp}")
    print("\n".join(plan.lines()))
    return {"layers": [{**r, "bytes": dict(r["bytes"])} for r in table], "init_programs": progs,
            "budget": {"device": plan.device, "weights": plan.weights, "states": plan.states,
                       "headroom": plan.headroom()}}
