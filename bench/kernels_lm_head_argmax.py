"""The fused greedy head (pallas_kernels/lm_head_argmax_triton.py) and the MTP input kernel
(pallas_kernels/mtp_input_triton.py) against XLA's form of the same math (the model's jnp), at the v2 demo's dims
(models/ling-demo) and Ling-3.0-flash's.

  python3 -m bench.kernels_lm_head_argmax --out $OUT   (GPU, ~2 min; kernels-lm-head-argmax-<dev>-<date>.json)

Per case and T in (1, 6, 17), each config of its CONFIGS (the first is the kernel's default) is checked on the GPU
against the model's jnp (the head: the same tokens as jnp.argmax of lm_logits(rms_norm(x)); the MTP input: rel err
<= 1e-2; T > 1: row 2 equal to the T = 1 call on that row, batch invariance), then timed with bench_kernels.timeit
(profiler span per call over input sets rotated past --cold-bytes of weights), as is the XLA baseline;
`kernels_per_call` says how many launches each side is (XLA's head: the norm's reduce and multiply, the lm_head
matvec, the argmax reduce). Prints the best config per case vs XLA and exits non-zero if any check failed (after
writing the JSON). --interpret: a CPU smoke run of the checks (its times mean nothing).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from ling_jax.layers.linear import Normed, Projection, norm_projections
from ling_jax.layers.norms import rms_norm
from ling_jax.model import lm_logits
from ling_jax.sampling import greedy
from pallas_kernels.lm_head_argmax_triton import HeadArgmaxConfig, head_argmax
from pallas_kernels.mtp_input_triton import NormLinearConfig, mtp_input_small

BF, F32, EPS = jnp.bfloat16, jnp.float32, 1e-6
HEAD_CONFIGS = {
    "bv128-bk64-w4": HeadArgmaxConfig(),
    "bv64-bk64-w4": HeadArgmaxConfig(block_v=64),
    "bv256-bk64-w8": HeadArgmaxConfig(block_v=256, num_warps=8),
    "bv128-bk128-w4-s2": HeadArgmaxConfig(block_k=128, num_stages=2),
}
MTP_CONFIGS = {
    "rule": NormLinearConfig(),  # norm_linear_triton.tiles_for over eh_proj's shape (what KernelCalls runs)
    "bn64-bk64-w4-s3": NormLinearConfig(block_n=64, block_k=64, num_warps=4, num_stages=3),  # the pre-rule default
    "bn32-bk64-w4": NormLinearConfig(block_n=32, block_k=64, num_warps=4),
    "bn32-bk128-w2": NormLinearConfig(block_n=32, block_k=128, num_warps=2),
}
CASES = {"demo head": ("head", 320, 4096), "ling head": ("head", 2560, 157184),
         "demo mtp input": ("mtp", 320, 4096), "ling mtp input": ("mtp", 2560, 157184)}  # (kind, D, V)


def make_sets(case, t, nsets, key):
    """Independent bf16 input sets: head (x, norm weight, lm_head); mtp (tokens, embed, hidden, enorm, hnorm,
    eh_proj). The embedding is shared by the MTP sets (it is a gather: only T rows of it are read)."""
    kind, d, v = CASES[case]
    embed = (0.5 * jax.random.normal(jax.random.fold_in(key, 99), (v, d))).astype(BF) if kind == "mtp" else None
    out = []
    for j in range(nsets):
        k = jax.random.split(jax.random.fold_in(key, j), 6)
        x = (3 * jax.random.normal(k[0], (t, d))).astype(BF)
        nw = (1 + 0.1 * jax.random.normal(k[1], (d,))).astype(BF)
        if kind == "head":
            out.append((x, nw, (jax.random.normal(k[2], (v, d)) * d ** -0.5).astype(BF)))
        else:
            out.append((jax.random.randint(k[3], (t,), 0, v), embed, x, nw,
                        (1 + 0.1 * jax.random.normal(k[4], (d,))).astype(BF),
                        (jax.random.normal(k[5], (d, 2 * d)) * (2 * d) ** -0.5).astype(BF)))
    return out


def fns(case, cfg):
    """(kernel fn, the model's jnp fn) over one set; the head's outputs are (tokens, normed rows)."""
    if CASES[case][0] == "head":
        model = lambda x, nw, w: (greedy(lm_logits({"lm_head": w}, rms_norm(x, nw, EPS))), rms_norm(x, nw, EPS))
        return (lambda x, nw, w: head_argmax(x, nw, w, eps=EPS, config=cfg)), model

    def model(tok, embed, h, en, hn, w):
        e = jnp.take(embed, tok, axis=0)
        return norm_projections(Normed((e, h), (en, hn), EPS), (Projection(w),))[0]

    return (lambda *s: mtp_input_small(*s, eps=EPS, config=cfg)), model


def check(case, f, ref, s, t):
    """(error, whether row 2 of the T-row call equals the 1-row call, or None at T = 1). The head's error: the
    fraction of rows whose token differs from the model's (0 required); the MTP input's: its rel err."""
    got, want = f(*s), ref(*s)
    if CASES[case][0] == "head":
        err = float(np.mean(np.asarray(got[0]) != np.asarray(want[0])))
        row = lambda a: (a[0][2:3], a[1][2:3])
        one = (s[0][2:3],) + tuple(s[1:])
    else:
        err = bk.rel(got.astype(F32), want.astype(F32))
        row = lambda a: (a[2:3],)
        one = (s[0][2:3], s[1], s[2][2:3]) + tuple(s[3:])
    if t == 1:
        return err, None
    return err, all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                    for a, b in zip(row(got), jax.tree.leaves(f(*one))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--only", default=None, help="cases whose name contains this")
    ap.add_argument("--cold-bytes", type=int, default=100_000_000, help="weight bytes rotated per timing")
    ap.add_argument("--interpret", action="store_true", help="the kernels in the interpreter (CPU smoke run)")
    a = ap.parse_args(argv)
    rows, failures, ceiling = [], [], bk.hbm_ceiling()
    for case in [c for c in CASES if a.only is None or a.only in c]:
        configs = HEAD_CONFIGS if CASES[case][0] == "head" else MTP_CONFIGS
        if a.interpret:
            configs = {k: dataclasses.replace(c, interpret=True) for k, c in list(configs.items())[:1]}
        for t in (1, 6, 17):
            probe = make_sets(case, t, 1, jax.random.key(0))[0]
            shared = {1} if CASES[case][0] == "mtp" else set()  # (the embedding: T rows of it are read)
            nbytes = sum(x.size * x.dtype.itemsize for i, x in enumerate(probe) if i not in shared)
            sets = make_sets(case, t, int(np.clip(a.cold_bytes // nbytes, 2, 64)), jax.random.key(1))
            _, ref = fns(case, None)
            xla = {}
            t_xla = bk.timeit(ref, sets, detail=xla)
            best = None
            for cname, cfg in configs.items():
                f, _ = fns(case, cfg)
                try:
                    err, inv = check(case, jax.jit(f), jax.jit(ref), sets[0], t)
                except Exception as ex:  # noqa: BLE001 -- one config's compile error: recorded, the sweep goes on
                    failures.append(f"{case} T={t} {cname}: {type(ex).__name__}: {str(ex)[:300]}")
                    continue
                if err > (0.0 if CASES[case][0] == "head" else 1e-2) or inv is False:
                    failures.append(f"{case} T={t} {cname}: error {err:.2e}, batch invariant {inv}")
                det = {}
                tk = bk.timeit(f, sets, detail=det)
                rows.append(dict(name=f"{case} T={t} {cname}", case=case, t=t, config_name=cname, time_us=tk,
                                 bytes=nbytes, baseline="XLA (the model's jnp)", baseline_time_us=t_xla,
                                 baseline_kernels_per_call=xla.get("kernels_per_call"),
                                 kernels_per_call=det.get("kernels_per_call"), error=err, batch_invariant=inv,
                                 config=str(cfg), nsets=len(sets)))
                best = min(best or (tk, cname), (tk, cname))
            if best:
                print(f"{case:16s} T={t:2d}: best {best[1]:18s} {best[0]:8.2f} us vs XLA {t_xla:8.2f} us "
                      f"({xla.get('kernels_per_call')} kernels)", flush=True)
            bk.write_result(a.out, "kernels-lm-head-argmax", rows, ceiling, a.tree)
    print("\n".join(failures) or "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
