"""fp8-weight Mosaic GPU MoE (pallas_kernels/moe_mosaic_fp8) at Ling-3.0-flash dims, cold weights, against the
bf16 Mosaic kernel (moe_mosaic.moe) on the same weights dequantised, from the same run.

  python3 -m bench.kernels_moe_fp8 --out $OUT        (GPU; writes kernels-moe-fp8-<device>-<date>.json)

First a check on the GPU: each fp8 variant against the model's own MoE math on the dequantised weights
(ling_jax.layers.moe.routed_experts + dense_mlp), rel err <= 1e-2, and token 0 bit-identical alone and in the
batch; a failed check exits non-zero before anything is timed. Then per T in (1, 6, 17): 16 input sets, each
routed to other experts of 3 GB of fp8 expert weights (cold: > 60 MB L2), timed by bench_kernels.timeit (chained
calls) and kernels_moe_mosaic.loop_time (one compiled loop). fp8 bytes = (distinct experts + shared) x 3 x I x D
(+ their scales); fraction = bytes / 4.3 TB/s / time. The bf16 row reads twice the bytes.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from bench.kernels_moe_mosaic import loop_time
from ling_jax import quant
from ling_jax.layers.moe import dense_mlp, routed_experts
from pallas_kernels import moe_mosaic as mm
from pallas_kernels.moe_mosaic_fp8 import moe_fp8

BF, F32 = jnp.bfloat16, jnp.float32
D, E, I, A = 2560, 512, 768, 8
LIMIT, SHARED_LIMIT = 4.0, 5.0
PEAK = 4.3e12
VARIANTS = [("fp8 smem", mm.MosaicMoeConfig(fp8_operand="smem")),
            ("fp8 registers", mm.MosaicMoeConfig(fp8_operand="registers"))]


def reference(x, ids, w, wg, wu, wd, sh):
  """The model's MoE on the dequantised weights (what the kernel must equal up to summation order)."""
  y = routed_experts(x, ids, w, wg, wu, wd, LIMIT)
  mlp = {"gate_proj": sh[0], "up_proj": sh[1], "down_proj": sh[2]}
  return (y + dense_mlp(mlp, x, SHARED_LIMIT).astype(F32)).astype(x.dtype)


def weights(key):
  k = jax.random.split(key, 6)
  q = jax.jit(lambda kk, s: quant.quantize(jax.random.normal(kk, s, BF) * 0.02), static_argnums=1)
  fp8 = (q(k[0], (E, I, D)), q(k[1], (E, I, D)), q(k[2], (E, D, I)))
  sh = (q(k[3], (I, D)), q(k[4], (I, D)), q(k[5], (D, I)))
  return fp8, sh


def input_sets(key, t, n):
  out = []
  for j in range(n):
    kk = jax.random.split(jax.random.fold_in(key, 100 * t + j), 3)
    ids = jnp.argsort(jax.random.uniform(kk[0], (t, E)), axis=1)[:, :A].astype(jnp.int32)
    out.append((jax.random.normal(kk[2], (t, D), BF), ids, jax.random.uniform(kk[1], (t, A), F32)))
  return out


def check(fp8, sh, sets, variants):
  """Each variant vs the dequantised reference on the GPU: exits on a mismatch; a variant that does not
  compile is reported and dropped (the others still run). Returns the variants that passed."""
  x, ids, w = sets[0]
  ref = reference(x, ids, w, *fp8, sh)
  passed = []
  for name, cfg in variants:
    f = lambda x, i_, w: moe_fp8(x, i_, w, *fp8, shared=sh, limit=LIMIT, shared_limit=SHARED_LIMIT, config=cfg)
    try:
      out, alone = f(x, ids, w), f(x[:1], ids[:1], w[:1])
    except Exception as ex:  # noqa: BLE001  (report the compiler's message, keep the run)
      print(f"FAILED to run {name} T={x.shape[0]}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
      continue
    err = bk.rel(out, ref)
    inv = np.array_equal(np.asarray(out[:1], np.float32), np.asarray(alone, np.float32))
    print(f"check T={x.shape[0]} {name}: rel err {err:.2e}, batch invariant {inv}", flush=True)
    if not err <= 1e-2 or not inv:
      raise SystemExit(f"CHECK FAILED: {name} T={x.shape[0]} rel err {err:.3e} (<= 1e-2), batch invariant {inv}")
    passed.append((name, cfg))
  return passed


def bench(rows, key, nsets=16):
  fp8, sh = weights(key)
  deq = lambda ws: tuple(quant.dequantize(q, BF) for q in ws)
  bf16, sh_bf16 = deq(fp8), deq(sh)
  chain = lambda prev, s: (prev,) + s[1:]
  variants = VARIANTS
  for t in (6, 1, 17):
    sets = input_sets(key, t, nsets)
    variants = check(fp8, sh, sets, variants)
    distinct = float(np.mean([len(np.unique(np.asarray(s[1]))) for s in sets]))
    scale_bytes = 4 * sum(int(np.prod(q.scale_inv.shape[1:])) for q in fp8)
    fp8_bytes = (distinct + 1) * (3 * I * D + scale_bytes) + 2 * t * D * 2
    bf16_bytes = (distinct + 1) * 3 * I * D * 2 + 2 * t * D * 2
    bf16_f = lambda x, i_, w, wg, wu, wd, sh: mm.moe(x, i_, w, wg, wu, wd, shared=sh, limit=LIMIT,
                                                     shared_limit=SHARED_LIMIT)
    t_bf16 = loop_time(bf16_f, sets, (*bf16, sh_bf16))
    runs = [("bf16 mosaic (dequantised weights)", bf16_f, (*bf16, sh_bf16), bf16_bytes)]
    runs += [(name, lambda x, i_, w, wg, wu, wd, sh, cfg=cfg: moe_fp8(
        x, i_, w, wg, wu, wd, shared=sh, limit=LIMIT, shared_limit=SHARED_LIMIT, config=cfg), (*fp8, sh), fp8_bytes)
             for name, cfg in variants]
    for name, f, consts, nbytes in runs:
      tl = t_bf16 if name.startswith("bf16") else loop_time(f, sets, consts)
      tc = bk.timeit(f, sets, consts, chain=chain)
      rows.append(dict(name=f"moe T={t} {name}", time_us=tc, loop_time_us=tl, bytes=nbytes,
                       fraction_of_4p3=nbytes / PEAK / (tl * 1e-6), bf16_loop_time_us=t_bf16,
                       speedup_vs_bf16=t_bf16 / tl, distinct_experts=distinct, nsets=nsets))
      print(rows[-1], flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  args = ap.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("bench.kernels_moe_fp8 times the Mosaic GPU kernel: run it on a GPU")
  ceiling = bk.hbm_ceiling()
  rows = [dict(name="hbm ceiling (start of run)", bw_bytes_per_s=ceiling.bytes_per_s)]
  bench(rows, jax.random.key(0))
  path = bk.write_result(args.out, "kernels-moe-fp8", rows, ceiling)
  print(f"\nwrote {path}\n{'name':46s} {'us':>8s} {'loop_us':>8s} {'MB':>7s} {'frac4.3':>7s} {'vs bf16':>7s}")
  for r in rows[1:]:
    print(f"{r['name']:46s} {r['time_us']:8.1f} {r['loop_time_us']:8.1f} {r['bytes'] / 1e6:7.1f} "
          f"{r['fraction_of_4p3']:7.2f} {r['speedup_vs_bf16']:7.2f}")


if __name__ == "__main__":
  sys.exit(main())
