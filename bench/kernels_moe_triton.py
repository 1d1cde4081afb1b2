"""Triton MoE (fused combine, Pallas align) and Pallas router at Ling-3.0-flash dims, cold weights.

  python3 bench/kernels_moe_triton.py --out $OUT   (GPU; writes kernels-moe-triton-<device>-<date>.json)
  python3 bench/kernels_moe_triton.py --only router --out $OUT   (or --only moe; file name says which)
  python3 bench/kernels_moe_triton.py --small      (CPU smoke: tiny dims, interpret mode)

bench(rows, bw, key, small) appends one row per (op, T, config) with its baseline from the same
run: moe configs vs the v1 path (fuse_combine=False, XLA align; the x-row gather is now in the
up kernel on every path) and vs the model's jnp moe_experts (XLA); route vs the model's jnp router (XLA;
both through tests/kernel_oracles.py). Timing is
bench_kernels.timeit over chained calls (latency, not overlap). MoE: 8 sets routed over 6 GB of
experts. Router: 32 gate matrices (84 MB > 60 MB L2), chained through the bias (+ 0 * w[0, 0],
one tiny XLA op per call in both the kernel and the baseline). `batch_invariant`: token 0's
output is bit-identical alone and in the batch.
"""
from __future__ import annotations

import argparse, dataclasses, os, sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import bench_kernels as bk  # noqa: E402
from pallas_kernels import moe as mo  # noqa: E402
from pallas_kernels import router as ro  # noqa: E402
from tests import kernel_oracles as oracles  # noqa: E402

BF, F32 = jnp.bfloat16, jnp.float32
LIMITS = dict(limit=4.0, shared_limit=5.0)
ROUTE = dict(n_group=8, topk_group=4, top_k=8, routed_scaling_factor=2.5)
_T = mo.MoeConfig(block_i=64, block_k=128, block_d=128, block_kd=128,      # v1's best tiles
                  fuse_combine=True)
V1 = ("v1 i64k128d128 (unfused, XLA align)", dataclasses.replace(_T, fuse_combine=False))
MOE_CFGS = [
    ("v1+align", dataclasses.replace(_T, fuse_combine=False, device_align=True)),
    ("fused dc16 (XLA align)", _T),
    ("fused+align dc16", dataclasses.replace(_T, device_align=True)),
    ("fused+align dc32", dataclasses.replace(_T, device_align=True, block_dc=32)),
    ("fused+align dc16 split2", dataclasses.replace(_T, device_align=True, combine_split=2)),
    ("fused+align dc16 split4", dataclasses.replace(_T, device_align=True, combine_split=4)),
    ("fused+align dc16 prefetch kd256", dataclasses.replace(_T, device_align=True, prefetch=True,
                                                            block_kd=256)),
    ("fused+align dc16 split2 prefetch kd256", dataclasses.replace(
        _T, device_align=True, combine_split=2, prefetch=True, block_kd=256)),
    ("fused+align dc16 kd256 s3", dataclasses.replace(_T, device_align=True, block_kd=256,
                                                      num_stages=3)),
]
ROUTER_CFGS = [("e16k256", ro.RouterConfig()), ("e32k256", ro.RouterConfig(block_e=32)),
               ("e16k128s3", ro.RouterConfig(block_k=128, num_stages=3))]


def _row(rows, name, tk, nbytes, floor, base, tb, err, cfg, **kw):
  rows.append(dict(name=name, time_us=tk, bytes=nbytes, floor_us=floor,
                   fraction_of_floor=floor / tk if tk and tk > 0 else None, baseline=base,
                   baseline_time_us=tb, rel_err=err, config=str(cfg), **kw))
  print(rows[-1], flush=True)


def _try(label, fn):
  try:
    return fn()
  except Exception as ex:  # one failing config must not cost the run
    print(f"FAILED {label}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)


def bench_moe(rows, bw, key, small=False, names=None):
  """names: the MOE_CFGS names to run after v1 (default all)."""
  d, e, i, a = (256, 32, 128, 8) if small else (2560, 512, 768, 8)
  interp = lambda c: dataclasses.replace(c, interpret=True, block_k=128, block_kd=64) if small else c
  chosen = MOE_CFGS[2:3] + MOE_CFGS[4:5] if small else MOE_CFGS
  if names is not None:
    chosen = [c for c in MOE_CFGS if c[0] in names]
  cfgs = [(n, interp(c)) for n, c in [V1] + chosen]
  k = jax.random.split(key, 8)
  nrm = lambda kk, s: jax.random.normal(kk, s, BF) * 0.02
  wg, wu, wd = nrm(k[0], (e, i, d)), nrm(k[1], (e, i, d)), nrm(k[2], (e, d, i))
  sh = tuple(nrm(k[3 + j], s) for j, s in enumerate(((i, d), (i, d), (d, i))))
  cs, chain = (wg, wu, wd, sh), (lambda prev, s: (prev,) + s[1:])
  for t in ((1, 6) if small else (1, 6, 17)):
    sets = []
    for j in range(4 if small else 8):
      kk = jax.random.split(jax.random.fold_in(key, 100 * t + j), 3)
      ids = jnp.argsort(jax.random.uniform(kk[0], (t, e)), axis=1)[:, :a].astype(jnp.int32)
      sets.append((jax.random.normal(kk[2], (t, d), BF), ids, jax.random.uniform(kk[1], (t, a), F32)))
    distinct = float(np.mean([len(np.unique(np.asarray(s[1]))) for s in sets]))
    nbytes = (distinct + 1) * 3 * i * d * 2 + 2 * t * d * 2
    floor = 1e6 * nbytes / bw
    x, ids, w = sets[0]
    ref = oracles.moe(x, ids, w, wg, wu, wd, shared=sh, **LIMITS)
    f_ref = lambda x, i_, w, wg, wu, wd, sh: oracles.moe(x, i_, w, wg, wu, wd, shared=sh, **LIMITS)
    t_xla = _try(f"model moe_experts T={t}", lambda: bk.timeit(f_ref, sets, cs, chain=chain))
    if t_xla:
      _row(rows, f"moe T={t} XLA model moe_experts", t_xla, nbytes, floor, "-", None, 0.0, None,
           distinct_experts=distinct)
    t_v1 = None
    for name, cfg in cfgs:
      def one(cfg=cfg, name=name):
        f = lambda x, i_, w, wg, wu, wd, sh: mo.moe(x, i_, w, wg, wu, wd, shared=sh, config=cfg, **LIMITS)
        out, alone = f(x, ids, w, *cs), f(x[:1], ids[:1], w[:1], *cs)
        inv = bool(np.array_equal(np.asarray(out[:1], np.float32), np.asarray(alone, np.float32)))
        tk = bk.timeit(f, sets, cs, chain=chain)
        base = ("v1 (same run)", t_v1) if t_v1 else ("model moe_experts (XLA)", t_xla)
        _row(rows, f"moe T={t} {name}", tk, nbytes, floor, *base, bk.rel(out, ref), cfg,
             xla_time_us=t_xla, distinct_experts=distinct, batch_invariant=inv)
        return tk
      tk = _try(f"moe T={t} {name}", one)
      t_v1 = t_v1 or (tk if name == V1[0] else None)


def bench_router(rows, bw, key, small=False):
  d, e = (256, 64) if small else (2560, 512)
  cfgs = [("small", ro.RouterConfig(block_k=128, interpret=True))] if small else ROUTER_CFGS
  nsets = 4 if small else 32
  for t in ((1, 6) if small else (1, 6, 17)):
    sets = []
    for j in range(nsets):
      kk = jax.random.split(jax.random.fold_in(key, 7000 + 100 * t + j), 3)
      sets.append((jax.random.normal(kk[0], (t, d), BF),
                   (jax.random.normal(kk[1], (e, d), F32) * d ** -0.5).astype(BF),
                   jax.random.normal(kk[2], (e,), F32) * 0.05))
    nbytes = e * d * 2 + t * d * 2 + e * 4 + t * 8 * 8
    floor = 1e6 * nbytes / bw
    chain = lambda prev, s: s[:2] + (s[2] + 0 * prev[1][0, 0],)
    f_ref = lambda x, g, b: oracles.route(x, g, b, **ROUTE)
    rids, rw = f_ref(*sets[0])
    t_xla = _try(f"model route T={t}", lambda: bk.timeit(f_ref, sets, chain=chain))
    if t_xla:
      _row(rows, f"route T={t} XLA model route", t_xla, nbytes, floor, "-", None, 0.0, None)
    for name, cfg in cfgs:
      def one(cfg=cfg, name=name):
        f = lambda x, g, b: ro.route(x, g, b, config=cfg, **ROUTE)
        ids, w = f(*sets[0])
        same = float(np.mean(np.asarray(ids) == np.asarray(rids)))
        tk = bk.timeit(f, sets, chain=chain)
        _row(rows, f"route T={t} pallas {name}", tk, nbytes, floor, "model route (XLA)",
             t_xla, bk.rel(w, rw), cfg, ids_equal_fraction=same)
      _try(f"route T={t} {name}", one)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  ap.add_argument("--small", action="store_true", help="CPU smoke test: tiny dims, interpret")
  ap.add_argument("--only", default="moe,router")
  args = ap.parse_args()
  ceiling = bk.hbm_ceiling()
  bw = ceiling.bytes_per_s
  print(f"HBM ceiling {bw / 1e12:.3f} TB/s ({ceiling.source})", flush=True)
  rows = [dict(name="hbm ceiling (start of run)", time_us=None, bytes=None, bw_bytes_per_s=bw)]
  try:  # SIGINT (timeout -s INT) still writes what was measured
    if "router" in args.only:
      bench_router(rows, bw, jax.random.key(1), small=args.small)
    if "moe" in args.only:
      bench_moe(rows, bw, jax.random.key(0), small=args.small)
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  part = "" if args.only == "moe,router" else "-" + args.only.replace(",", "+")
  path = bk.write_result(args.out, f"kernels-moe-triton{part}", rows, ceiling)
  print(f"\nwrote {path}\n{'name':48s} {'us':>8s} {'floor':>7s} {'frac':>6s} {'base_us':>8s} "
        f"{'err':>8s} inv")
  for r in rows[1:]:
    frac = r["fraction_of_floor"]
    print(f"{r['name']:48s} {r['time_us']:8.1f} {r['floor_us']:7.2f} {frac or 0:6.2f} "
          f"{r['baseline_time_us'] or 0:8.1f} {r.get('rel_err') or 0:8.1e} "
          f"{r.get('batch_invariant', '')}")


if __name__ == "__main__":
  main()
