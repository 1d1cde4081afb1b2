"""The Triton norm + projections / projection + residual kernels (pallas_kernels/norm_linear_triton.py) against
XLA's form of the same math (the model's jnp), at the v2 demo's dims (models/ling-demo) and Ling-3.0-flash's.

  python3 -m bench.kernels_norm_linear_triton --out $OUT            (GPU, ~100 s: the rule's tiles vs XLA)
  python3 -m bench.kernels_norm_linear_triton --out $OUT --sweep    (+ SWEEP's variants of the rule, ~4 min)
  (kernels-norm-linear-triton-<dev>-<date>.json; --only demo / --only ling for a subset)

Per case and T in (1, 6, 17): the kernel under tiles_for's config ("rule", what KernelCalls runs) and, with
--sweep, under each SWEEP variant of it (one design choice changed each: the split accumulators, every K
step in flight, BN, BK, 4 warps), checked on the GPU against the model's jnp (rel err <= 1e-2 per output; T > 1: row 2
bitwise equal to the T = 1 call on that row, batch invariance), then timed with bench_kernels.timeit (profiler
span per call over input sets rotated past --cold-bytes of weights), as is the XLA baseline; `kernels_per_call`
says how many launches each side is (XLA: the norm's reduce + a matvec fusion per projection, or matvec + add).
Prints the rule (and the best variant) per case vs XLA and exits non-zero if any check failed (after the JSON).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from ling_jax.layers.linear import Normed, Projection, linear, norm_projections
from pallas_kernels.fused_linear import Proj
from pallas_kernels.norm_linear_triton import linear_residual_small, norm_linear_small, tiles_for

BF, F32, EPS = jnp.bfloat16, jnp.float32, 1e-6
SWEEP = {  # variant name -> the rule's config -> the variant, or None (not run): each changes one choice of the
    # module docstring (1 split: one MMA chain; 2 stages: one K step in flight; BN x2: half the programs; BK x2:
    # half the K steps, wider; 8 warps)
    "1 split": lambda c: dataclasses.replace(c, splits=1),
    "2 stages": lambda c: dataclasses.replace(c, num_stages=2),
    "BN x2": lambda c: dataclasses.replace(c, block_n=2 * c.block_n, splits=max(1, c.splits // 2)),
    "BK x2": lambda c: (dataclasses.replace(c, block_k=2 * c.block_k, splits=None, num_stages=None)
                        if c.block_k <= 128 else None),
    "8 warps": lambda c: dataclasses.replace(c, num_warps=8),
}
# name -> (D, ((kind, [N, D] shape, limit), ...)), or (K, N) with None for projection + residual
CASES = {
    "demo kda w_qkvfg|b_proj": (320, (("linear", (1600, 320), 0.0), ("linear", (5, 320), 0.0))),
    "demo mla q|kv_a|g": (320, (("linear", (480, 320), 0.0), ("linear", (160, 320), 0.0),
                                ("sigmoid", (5, 320), 0.0))),
    "demo dense gate|up": (320, (("swiglu", (960, 320), 7.0),)),
    "demo o_proj+res 320->320": ((320, 320), None),
    "demo down+res 960->320": ((960, 320), None),
    "ling kda w_qkvfg|b_proj": (2560, (("linear", (20480, 2560), 0.0), ("linear", (32, 2560), 0.0))),
    "ling mla q|kv_a|g": (2560, (("linear", (6144, 2560), 0.0), ("linear", (576, 2560), 0.0),
                                 ("sigmoid", (32, 2560), 0.0))),
    "ling dense gate|up": (2560, (("swiglu", (6144, 2560), 7.0),)),
    "ling o_proj+res 4096->2560": ((4096, 2560), None),
    "ling down+res 6144->2560": ((6144, 2560), None),
}


def rule_config(case, config=None):
    """tiles_for's config for the case's weights: what the kernel runs with config=None (or config's set fields
    and the rule's others)."""
    dims, specs = CASES[case]
    if specs is None:
        return tiles_for((dims[1],), dims[0], 1, config)
    return tiles_for(tuple(shape[0] for _, shape, _ in specs), dims, max(1 + (k == "swiglu") for k, _, _ in specs),
                     config)


def make_sets(case, t, nsets, key):
    """[(x, nw, *weights)] (or [(o, w, residual)]) of nsets independent weight sets, bf16."""
    dims, specs = CASES[case]
    out = []
    for j in range(nsets):
        k = jax.random.split(jax.random.fold_in(key, j), 8)
        if specs is None:
            kk, n = dims
            out.append(((3 * jax.random.normal(k[0], (t, kk))).astype(BF),
                        (jax.random.normal(k[1], (n, kk)) * kk ** -0.5).astype(BF),
                        jax.random.normal(k[2], (t, n)).astype(BF)))
            continue
        ws = []
        for i, (kind, shape, _) in enumerate(specs):
            w = lambda kx: (jax.random.normal(kx, shape) * shape[1] ** -0.5).astype(BF)
            ws += [w(k[2 + 2 * i]), w(k[3 + 2 * i])] if kind == "swiglu" else [w(k[2 + 2 * i])]
        out.append(((3 * jax.random.normal(k[0], (t, dims))).astype(BF),
                    (1 + 0.1 * jax.random.normal(k[1], (dims,))).astype(BF), *ws))
    return out


def fns(case, cfg):
    """(kernel fn, the model's jnp fn) over one set."""
    _, specs = CASES[case]
    if specs is None:
        return (lambda o, w, r: linear_residual_small(o, w, r, config=cfg)), (lambda o, w, r: linear(o, w, residual=r))
    projs = tuple(Proj(kind, limit=limit) for kind, _, limit in specs)

    def weights(ws):
        it = iter(ws)
        return [(next(it), next(it)) if kind == "swiglu" else next(it) for kind, _, _ in specs]

    kern = lambda x, nw, *ws: norm_linear_small(x, nw, tuple(weights(ws)), projs=projs, eps=EPS, config=cfg)
    model = lambda x, nw, *ws: norm_projections(Normed(x, nw, EPS), tuple(
        Projection(w, kind, limit) for w, (kind, _, limit) in zip(weights(ws), specs)))
    return kern, model


def check(f, ref, s, t, residual: bool):
    """(max rel err of f vs ref, whether row 2 of the T-row call equals the 1-row call, or None at T = 1).
    residual: s is (o, w, residual), else (x, nw, *weights)."""
    outs, refs = jax.tree.leaves(f(*s)), jax.tree.leaves(ref(*s))
    err = max(bk.rel(o.astype(F32), r.astype(F32)) for o, r in zip(outs, refs))
    if t == 1:
        return err, None
    one = (s[0][2:3], s[1], s[2][2:3]) if residual else (s[0][2:3],) + tuple(s[1:])
    return err, all(np.array_equal(np.asarray(o[2:3], np.float32), np.asarray(a, np.float32))
                    for o, a in zip(outs, jax.tree.leaves(f(*one))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--only", default=None, help="cases whose name contains this")
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP's variants of the rule's config")
    ap.add_argument("--cold-bytes", type=int, default=100_000_000, help="weight bytes rotated per timing")
    ap.add_argument("--interpret", action="store_true", help="the kernels in the interpreter (a CPU smoke run "
                    "of the checks; its times mean nothing; use --only demo)")
    a = ap.parse_args(argv)
    rows, failures, ceiling = [], [], bk.hbm_ceiling()
    for case in [c for c in CASES if a.only is None or a.only in c]:
        rule = dataclasses.replace(rule_config(case), interpret=a.interpret)
        variants = {k: v(rule) for k, v in SWEEP.items()} if a.sweep else {}
        variants = {k: rule_config(case, v) for k, v in variants.items() if v is not None}
        configs = {"rule": rule} | {k: v for k, v in variants.items() if v != rule}
        for t in (1, 6, 17):
            probe = make_sets(case, t, 1, jax.random.key(0))[0]
            nbytes = sum(x.size * x.dtype.itemsize for x in probe)
            sets = make_sets(case, t, int(np.clip(a.cold_bytes // nbytes, 2, 64)), jax.random.key(1))
            _, ref = fns(case, None)
            xla = {}
            t_xla = bk.timeit(ref, sets, detail=xla)
            times = {}
            for cname, cfg in configs.items():
                f, _ = fns(case, cfg)
                try:
                    err, inv = check(jax.jit(f), jax.jit(ref), sets[0], t, CASES[case][1] is None)
                except Exception as ex:  # noqa: BLE001 -- one config's compile error: recorded, the sweep goes on
                    failures.append(f"{case} T={t} {cname}: {type(ex).__name__}: {str(ex)[:300]}")
                    continue
                if err > 1e-2 or inv is False:
                    failures.append(f"{case} T={t} {cname}: rel err {err:.2e}, batch invariant {inv}")
                det = {}
                times[cname] = tk = bk.timeit(f, sets, detail=det)
                rows.append(dict(name=f"{case} T={t} {cname}", case=case, t=t, config_name=cname, time_us=tk,
                                 bytes=nbytes, baseline="XLA (the model's jnp)", baseline_time_us=t_xla,
                                 baseline_kernels_per_call=xla.get("kernels_per_call"),
                                 kernels_per_call=det.get("kernels_per_call"), rel_err=err, batch_invariant=inv,
                                 config=str(cfg), nsets=len(sets)))
            if "rule" in times:
                best = min(times, key=times.get)
                print(f"{case:28s} T={t:2d}: rule {times['rule']:7.2f} us vs XLA {t_xla:7.2f} us "
                      f"({xla.get('kernels_per_call')} kernels), {times['rule'] / t_xla:5.2f}x"
                      + (f"; best {best} {times[best]:7.2f} us" if len(times) > 1 else ""), flush=True)
            bk.write_result(a.out, "kernels-norm-linear-triton", rows, ceiling, a.tree)
    print("\n".join(failures) or "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
