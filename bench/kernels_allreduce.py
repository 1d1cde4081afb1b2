"""The peer-to-peer all-reduce + residual + RMSNorm (pallas_kernels/allreduce.py) vs XLA's psum, on 2+ GPUs.

  python3 -m bench.kernels_allreduce --out $OUT     (nvidia-h200-x2, < 3 min; writes kernels-allreduce-<dev>-<date>.json)

Per case (T rows in 1, 6, 17 at D = 2560; partials f32 as the MoE's down projections give them, bf16 as an
output projection's), over all local GPUs on one mesh axis "tp":
  p2p        KernelCalls(p2p_allreduce=True).allreduce_residual_norm: ONE kernel (exchange + sum + add + norm)
  psum+norm  KernelCalls().allreduce_residual_norm: XLA psum (NCCL), then the add and rms_norm as XLA ops
  psum       the psum alone (the 18-19 us figure of issue 18)
Checked first, on the GPUs (one boundary): every device's p2p outputs bit-identical to device 0's, the new
residual equal to psum+norm's (bitwise on 2 devices; <= 1 bf16 ulp on more, where NCCL may add in another
order) and the normed rows within 1 bf16 ulp; a failed check is reported and the case is not timed. Then
timed as CHAIN dependent boundaries inside one shard_map (the next partial is the boundary's normed output, as
the next layer's projection reads it; the next residual its new residual; psum alone reduces its previous
result): bench_kernels.timeit (profiler span of all devices' kernels / CHAIN, launch gaps and Mosaic's
pre-launch device barrier included) and wall time ((time(CHAIN) - time(CHAIN / 2)) / (CHAIN / 2)). The f32
cases carry one bf16 -> f32 convert per boundary on both paths. Demo sizes (D = 320, 96) are not multiples of
128: the kernel does not take them (KernelCalls falls back to psum), listed as unsupported.
Exits non-zero if any check failed (after writing the JSON).
"""
from __future__ import annotations

import argparse, os, sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench import bench_kernels as bk
from ling_jax.kernel_calls import KernelCalls
from pallas_kernels.allreduce import takes

BF, F32, EPS = jnp.bfloat16, jnp.float32, 1e-6
CHAIN = 32                           # dependent calls per timed program


def per_device(mesh, body, n_out):
    """body(partials [K, T, D] of this device, residual, weight) under shard_map; outputs stacked per device."""
    f = lambda p, r, w: tuple(o[None] for o in body(p[0], r, w))[:n_out]
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"),) * n_out,
                                 check_vma=False))


def boundary(calls: KernelCalls):
    return lambda p, r, w: calls.allreduce_residual_norm(p, r, w, eps=EPS, axis="tp")


def chained(op, k: int):
    """k dependent layer boundaries on each device: the next partial is this boundary's normed output (as the
    next layer's projection reads it), the next residual its new residual. No data leave a device except
    through the all-reduce being measured."""
    def body(partials, residual, weight):
        p, x = partials[0], residual
        for _ in range(k):
            x, normed = op(p, x, weight)
            p = normed.astype(partials.dtype)
        return x, normed
    return body


def chained_psum(k: int):
    """k dependent psums alone (each reduces the previous result): the 18-19 us NCCL figure."""
    def body(partials, residual, weight):
        y = partials[0]
        for _ in range(k):
            y = jax.lax.psum(y, "tp")
        return (y,)
    return body


def inputs(mesh, n, t, d, pdt, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    partials = (4 * jax.random.normal(k[0], (n, 1, t, d), F32)).astype(pdt)   # [device, K slot, T, D]
    residual = (8 * jax.random.normal(k[1], (t, d), F32)).astype(BF)
    weight = (1 + 0.2 * jax.random.normal(k[2], (d,), F32)).astype(BF)
    return (jax.device_put(partials, NamedSharding(mesh, P("tp"))), jax.device_put(residual, NamedSharding(mesh, P())),
            jax.device_put(weight, NamedSharding(mesh, P())))


def ulps(a, b):
    return np.abs(np.asarray(a).view(np.int16).astype(np.int32) - np.asarray(b).view(np.int16).astype(np.int32))


def check(mesh, args, n) -> str | None:
    """None if one p2p boundary passes (see the module docstring), else what failed."""
    x_k, nk = per_device(mesh, chained(boundary(KernelCalls(p2p_allreduce=True)), 1), 2)(*args)
    x_m, nm = per_device(mesh, chained(boundary(KernelCalls()), 1), 2)(*args)
    x_k, nk, x_m, nm = map(np.asarray, (x_k, nk, x_m, nm))
    for dev in range(1, n):
        if ulps(x_k[dev], x_k[0]).max() or ulps(nk[dev], nk[0]).max():
            return f"device {dev}'s outputs differ from device 0's"
    dx, dn = int(ulps(x_k[0], x_m[0]).max()), int(ulps(nk[0], nm[0]).max())
    if dx > (0 if n == 2 else 1) or dn > 1:
        return f"vs psum+norm: residual {dx} ulp, normed {dn} ulp"
    return None


def measure(mesh, make, args, n_out):
    """us per dependent call: profiler span of CHAIN calls / CHAIN (bench_kernels.timeit), and wall time
    (time(CHAIN) - time(CHAIN / 2)) / (CHAIN / 2)."""
    detail = {}
    long, short = per_device(mesh, make(CHAIN), n_out), per_device(mesh, make(CHAIN // 2), n_out)
    us = bk.timeit(long, [args], detail=detail) / CHAIN
    wall = 1e6 * (bk._median_time(long, *args) - bk._median_time(short, *args)) / (CHAIN - CHAIN // 2)
    if "kernels_per_call" in detail:
        detail["kernels_per_call"] /= CHAIN
        detail["busy_us"] /= CHAIN
    return us, wall, detail


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    ap.add_argument("--rows", default="1,6,17")
    ap.add_argument("--hidden", type=int, default=2560)
    a = ap.parse_args()
    n = jax.local_device_count()
    if n < 2:
        sys.exit(f"needs >= 2 local GPUs (nvidia-h200-x2), found {n}")
    mesh = Mesh(np.array(jax.local_devices()), ("tp",))
    makers = {"p2p": (lambda k: chained(boundary(KernelCalls(p2p_allreduce=True)), k), 2),
              "psum+norm": (lambda k: chained(boundary(KernelCalls()), k), 2),
              "psum": (chained_psum, 1)}
    rows, failed = [], []
    for d in (320, 96):  # the demo models' hidden sizes
        s = jax.ShapeDtypeStruct
        rows.append(dict(case=f"D={d}", impl="p2p", supported=takes(s((1, d), F32), s((1, d), BF), s((d,), BF))))
    for pdt in (F32, BF):
        for t in map(int, a.rows.split(",")):
            case = f"T={t} D={a.hidden} partial={jnp.dtype(pdt).name} N={n}"
            args = inputs(mesh, n, t, a.hidden, pdt)
            err = check(mesh, args, n)
            if err:
                failed.append(case)
                rows.append(dict(case=case, impl="p2p", check=err))
                print(f"{case}: CHECK FAILED: {err}", flush=True)
                continue
            for name, (make, n_out) in makers.items():
                us, wall, detail = measure(mesh, make, args, n_out)
                rows.append(dict(case=case, impl=name, us_per_call=us, wall_us_per_call=wall, check="ok", **detail))
                print(f"{case:40s} {name:10s} {us:8.2f} us/call (profiler) {wall:8.2f} us/call (wall) "
                      f"{detail.get('kernels_per_call', float('nan')):.1f} kernels/call", flush=True)
    print("\ncase                                      p2p     psum+norm  psum   (us per dependent call, profiler)")
    by = {(r["case"], r["impl"]): r for r in rows if "us_per_call" in r}
    for case in dict.fromkeys(r["case"] for r in rows if "us_per_call" in r):
        print(f"{case:40s} " + "  ".join(f"{by[(case, i)]['us_per_call']:8.2f}" for i in makers))
    path = bk.write_result(a.out, "kernels-allreduce", rows, bk.hbm_ceiling())
    print("wrote", path)
    if failed:
        sys.exit(f"checks failed: {failed}")


if __name__ == "__main__":
    main()
