"""Mosaic GPU MoE bench at Ling-3.0-flash dims, cold weights, vs Triton (moe.moe) and XLA (the model's
jnp moe_experts, through tests/kernel_oracles.py).

  python3 bench/kernels_moe_mosaic.py --out $OUT     (GPU; writes kernels-moe-mosaic-<device>-<date>.json)
  python3 bench/kernels_moe_mosaic.py --small        (CPU smoke: tiny dims, interpret mode)

bench(rows, bw, key) appends one row per (T, config) and per baseline. Timing is
bench_kernels.timeit: 8 input sets chained (x_{j+1} = out_j), so latency, not overlap. Each set
routes to different experts of 6 GB of expert weights (cold: > 60 MB L2). `loop_time_us` times the
same chain inside one compiled while loop (no host or argument cost to subtract). Bytes = distinct
experts + the shared expert, 3 x I x D bf16 each. A row also says whether token 0's output is
bit-identical alone and in the batch (`batch_invariant`).
"""
from __future__ import annotations

import argparse, os, sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import bench_kernels as bk  # noqa: E402
from pallas_kernels import moe as moe_tr  # noqa: E402
from pallas_kernels import moe_mosaic as mm  # noqa: E402
from tests import kernel_oracles as oracles  # noqa: E402

BF, F32 = jnp.bfloat16, jnp.float32
LIMITS = dict(limit=4.0, shared_limit=5.0)
CONFIGS = [  # name, MosaicMoeConfig: the two best of the first H200 run (2026-11-30)
    ("i64k128s4_d64kd128ks3s4", mm.MosaicMoeConfig()),
    ("i64k64s4_d128kd128ks6s4", mm.MosaicMoeConfig(block_k=64, block_d=128, split_k=6)),
]
EXTRA_CONFIGS = [  # slower or no better in that run; `--all-configs`
    ("i128k64s4_d64kd64ks4s6", mm.MosaicMoeConfig(block_i=128, block_k=64, block_kd=64,
                                                  split_k=4, down_stages=6)),
    ("i64k64s6_d128kd64ks6s6", mm.MosaicMoeConfig(block_k=64, up_stages=6, block_d=128,
                                                  block_kd=64, split_k=6, down_stages=6)),
]
TRITON = moe_tr.MoeConfig(block_i=64, block_k=128, block_d=128, block_kd=128)


def loop_time(fn, sets, consts):
  """Per-call latency (us) from ONE compiled program: a while loop of n dependent calls (x <- out)
  cycling through the sets; (time(2n) - time(n)) / n cancels dispatch and argument costs exactly."""
  xs, ids, ws = (jnp.stack([s[j] for s in sets]) for j in range(3))
  n = len(sets)

  @jax.jit
  def prog(x, ids, ws, cs, iters):
    body = lambda j, x: fn(x, ids[j % n], ws[j % n], *cs)
    return jax.lax.fori_loop(0, iters, body, x)
  t = lambda k: bk._median_time(prog, xs[0], ids, ws, consts, jnp.int32(k))
  return 1e6 * (t(2 * n) - t(n)) / n


def bench(rows, bw, key, small=False, configs=None, nsets=16):
  nsets = 2 if small else nsets
  d, e, i, a = (256, 32, 128, 8) if small else (2560, 512, 768, 8)
  configs = configs or ([("small", mm.MosaicMoeConfig(block_i=128, block_k=128, block_d=128,
                                                       block_kd=64, split_k=2, up_stages=2,
                                                       down_stages=2, interpret=True))]
                        if small else CONFIGS)
  k = jax.random.split(key, 8)
  nrm = lambda kk, s: jax.random.normal(kk, s, BF) * 0.02
  wg, wu, wd = nrm(k[0], (e, i, d)), nrm(k[1], (e, i, d)), nrm(k[2], (e, d, i))
  sh = tuple(nrm(k[3 + j], s) for j, s in enumerate(((i, d), (i, d), (d, i))))
  cs, ebytes = (wg, wu, wd, sh), 3 * i * d * 2
  chain = lambda prev, s: (prev,) + s[1:]
  for t in ((6,) if small else (6, 1, 17)):
    sets = []
    for j in range(nsets):
      kk = jax.random.split(jax.random.fold_in(key, 100 * t + j), 3)
      ids = jnp.argsort(jax.random.uniform(kk[0], (t, e)), axis=1)[:, :a].astype(jnp.int32)
      sets.append((jax.random.normal(kk[2], (t, d), BF), ids, jax.random.uniform(kk[1], (t, a), F32)))
    distinct = float(np.mean([len(np.unique(np.asarray(s[1]))) for s in sets]))
    nbytes = (distinct + 1) * ebytes + 2 * t * d * 2
    floor = 1e6 * nbytes / bw
    x, ids, w = sets[0]
    ref = oracles.moe(x, ids, w, *cs[:3], shared=sh, **LIMITS)
    def row(name, f, tk, base, tb, err, cfg, **kw):
      tl = None if small else loop_time(f, sets, cs)
      rows.append(dict(name=f"moe T={t} {name}", time_us=tk, bytes=nbytes, floor_us=floor,
                       fraction_of_floor=floor / tk if tk else None, baseline=base,
                       baseline_time_us=tb, rel_err=err, distinct_experts=distinct, config=str(cfg),
                       loop_time_us=tl, loop_fraction_of_floor=floor / tl if tl else None, nsets=nsets, **kw))
      print(rows[-1], flush=True)
      return tl
    ref_f = lambda x, i_, w, wg, wu, wd, sh: oracles.moe(x, i_, w, wg, wu, wd, shared=sh, **LIMITS)
    t_xla = bk.timeit(ref_f, sets, cs, chain=chain)
    row("XLA model moe_experts (gather)", ref_f, t_xla, "-", None, 0.0, None)
    t_tr = None
    if not small:
      try:
        tr_f = lambda x, i_, w, wg, wu, wd, sh: moe_tr.moe(x, i_, w, wg, wu, wd, shared=sh,
                                                           config=TRITON, **LIMITS)
        t_tr = bk.timeit(tr_f, sets, cs, chain=chain)
        row("Triton moe.moe i64k128d128", tr_f, t_tr, "model moe_experts (XLA gather)", t_xla,
            bk.rel(tr_f(x, ids, w, *cs), ref), TRITON)
      except Exception as ex:  # report and go on
        print(f"FAILED triton T={t}: {type(ex).__name__}: {str(ex)[:800]}", flush=True)
    for name, cfg in configs:
      try:
        f = lambda x, i_, w, wg, wu, wd, sh, cfg=cfg: mm.moe(x, i_, w, wg, wu, wd, shared=sh,
                                                             config=cfg, **LIMITS)
        out = f(x, ids, w, *cs)
        alone = f(x[:1], ids[:1], w[:1], *cs)
        inv = bool(np.array_equal(np.asarray(out[:1], np.float32), np.asarray(alone, np.float32)))
        tk = bk.timeit(f, sets, cs, chain=chain)
        row(f"mosaic {name}", f, tk, "Triton moe.moe (same run)" if t_tr else "model moe_experts (XLA)",
            t_tr or t_xla, bk.rel(out, ref), cfg, xla_time_us=t_xla, batch_invariant=inv)
      except Exception as ex:  # one bad config must not cost the run
        print(f"FAILED mosaic T={t} {name}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  ap.add_argument("--small", action="store_true", help="CPU smoke test: tiny dims, interpret")
  ap.add_argument("--all-configs", action="store_true", help="also the EXTRA_CONFIGS")
  args = ap.parse_args()
  ceiling = bk.hbm_ceiling()
  bw = ceiling.bytes_per_s
  print(f"HBM ceiling {bw / 1e12:.3f} TB/s ({ceiling.source})", flush=True)
  rows = [dict(name="hbm ceiling (start of run)", time_us=None, bytes=None, bw_bytes_per_s=bw)]
  try:  # SIGINT still writes what was measured
    bench(rows, bw, jax.random.key(0), small=args.small,
          configs=CONFIGS + EXTRA_CONFIGS if args.all_configs else None)
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  path = bk.write_result(args.out, "kernels-moe-mosaic", rows, ceiling)
  print(f"\nwrote {path}\n{'name':46s} {'us':>8s} {'loop_us':>8s} {'floor':>7s} {'frac4.3':>7s} "
        f"{'base_us':>8s} {'err':>8s} inv")
  for r in rows[1:]:
    print(f"{r['name']:46s} {r['time_us']:8.1f} {r['loop_time_us'] or 0:8.1f} {r['floor_us']:7.1f} "
          f"{r['floor_us'] * bw / 4.3e12 / (r['loop_time_us'] or r['time_us']):7.2f} {r['baseline_time_us'] or 0:8.1f} "
          f"{r.get('rel_err') or 0:8.1e} {r.get('batch_invariant', '')}")


if __name__ == "__main__":
  main()
