"""python -m compile --model PRESET --tp-size N --spec nextn --report [--layers N] [--json FILE]

On a CPU-only machine the N devices are simulated (XLA_FLAGS is set before jax is imported).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m compile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="ling3-flash", help="preset name or HF checkpoint dir (config only)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--spec", choices=("nextn", "none"), default="nextn")
    p.add_argument("--steps", type=int, default=5, help="NEXTN drafted tokens per step")
    p.add_argument("--layers", type=int, default=None, help="first N target layers (+ MTP): a one-GPU slice")
    p.add_argument("--max-len", type=int, default=8192 + 512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--expert-parallel", action="store_true", help="experts over tp instead of expert width")
    p.add_argument("--shard-embedding", action="store_true", help="vocab-parallel embedding (default replicated)")
    p.add_argument("--report", action="store_true", help="print the report (default: only build)")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument("--exec-dir", default=None, help="store / load serialized executables here")
    p.add_argument("--cache-dir", default=None, help="persistent XLA compilation cache")
    p.add_argument("--platform", default=None, help="cpu to force simulated devices on a GPU host")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    if a.platform == "cpu" or not _has_gpu():
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={a.tp_size}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from compile.mesh import make_mesh
    from compile.report import format_report, report_dict
    from compile.sharding import ShardingRules
    from compile.stages import Program, build, enable_persistent_cache, slice_config
    from ling_jax.config import load_config

    if a.cache_dir:
        enable_persistent_cache(a.cache_dir)
    cfg = load_config(a.model)
    if a.layers:
        cfg = slice_config(cfg, a.layers)
    mesh = make_mesh(a.tp_size)
    rules = ShardingRules.tensor_parallel(a.expert_parallel, not a.shard_embedding)
    prog = Program(cfg, mode="nextn" if a.spec == "nextn" else "plain", steps=a.steps, max_len=a.max_len,
                   dtype=a.dtype)
    built = build(prog, mesh, rules, exec_dir=a.exec_dir)
    d = report_dict(built, mesh, rules)
    d["jax_version"] = jax.__version__
    if a.report:
        print(format_report(d))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(d, f, indent=1)
    return 0


def _has_gpu() -> bool:
    """Without importing jax: a CUDA device node or JAX_PLATFORMS asking for it."""
    plats = os.environ.get("JAX_PLATFORMS", "")
    if plats:
        return "cuda" in plats or "gpu" in plats
    return os.path.exists("/dev/nvidia0")


if __name__ == "__main__":
    sys.exit(main())
