"""Fused norm + projection / projection + residual on block-fp8 weights (pallas_kernels/fused_linear_fp8.py) at
Ling-3.0-flash dims, against XLA's fp8-dequant path (the model's jnp: quant.dense then the einsum) and the bf16
kernel (pallas_kernels/fused_linear.py on the dequantised bf16 weights, twice the bytes).

  python3 -m bench.kernels_fused_linear_fp8 --out $OUT     (GPU, ~3-5 min; writes kernels-fused-linear-fp8-<device>-<date>.json)

Cases: bench.kernels_fused_linear.CASES (KDA q|k|v|f|g + b, MLA q|kv_a|g, dense gate|up, shared gate|up + router,
o_proj + residual), every weight quantised (quant.quantize; the model keeps the router gate bf16 and KernelCalls
then runs it as a second, bf16 kernel: here it is fp8 so each case is one launch). Per case and T in (1, 6, 17):
  1. XLA: the model's path (layers.linear.norm_projections / linear with kernels=None on the Fp8Weights), timed;
  2. the bf16 kernel at its default config on the dequantised weights, timed (the bf16 bytes are its own);
  3. each fp8 config (CONFIGS x scale_on "partial" / "weight"): checked against 1. (rel err <= 1e-2 per output;
     T > 1: row 2 bitwise equal to the T = 1 call: batch invariance), then timed (bench_kernels.timeit: profiler
     span per call, input sets rotated over > 200 MB: cold L2). A config that does not fit (SMEM) is reported
     as unsupported, not a failure.
Bytes of the fp8 rows = fp8 weights + their f32 scales + x + outputs; `fraction_of_floor` is bytes / the one HBM
ceiling (bench/ceiling.py) / time, for every row (the bf16 kernel's row counts its bf16 bytes). The summary prints
the best fp8 config per (case, T) with its fraction, x XLA and x bf16 kernel; the issue's target is >= 0.80 at T = 6.
Exits non-zero if any check failed (after writing the JSON).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from bench.kernels_fused_linear import CASES, COLD_BYTES, EPS, kernel_fn
from ling_jax import quant
from ling_jax.layers.linear import Normed, Projection, linear, norm_projections
from pallas_kernels.fused_linear import LinearConfig
from pallas_kernels.fused_linear_fp8 import SCALE_ON, linear_residual_fp8, norm_linear_fp8

BF, F32 = jnp.bfloat16, jnp.float32
CONFIGS = {"1cta-k128": LinearConfig(), "2cta-k128": LinearConfig(ctas_per_sm=2),
           "1cta-k128-n128": LinearConfig(block_n=128)}


def model_fn(projs):
  """The model's jnp path on Fp8Weights: fn(x, nw, *weights) or fn(o, residual, w)."""
  if projs is None:
    return lambda o, res, w: linear(o, w, None, res)

  def f(x, nw, *ws):
    it, projections = iter(ws), []
    for p in projs:
      projections.append(Projection((next(it), next(it)) if p.kind == "swiglu" else next(it), p.kind, p.limit))
    return norm_projections(Normed(x, nw, EPS), tuple(projections), None)
  return f


def fp8_kernel_fn(projs, cfg, scale_on):
  if projs is None:
    return lambda o, res, w: linear_residual_fp8(o, w, res, config=cfg, scale_on=scale_on)

  def f(x, nw, *ws):
    it, weights = iter(ws), []
    for p in projs:
      weights.append((next(it), next(it)) if p.kind == "swiglu" else next(it))
    return norm_linear_fp8(x, nw, tuple(weights), projs=projs, eps=EPS, config=cfg, scale_on=scale_on)
  return f


def make_sets(shapes, projs, t, nsets, key):
  """nsets of (x, nw or residual, *Fp8Weights) and the same with the weights dequantised to bf16."""
  k = jax.random.split(key, 2 + nsets * len(shapes))
  kin = shapes[0][1]
  x = (3 * jax.random.normal(k[0], (t, kin), F32)).astype(BF)
  second = ((1 + 0.1 * jax.random.normal(k[1], (kin,), F32)).astype(BF) if projs else
            jax.random.normal(k[1], (t, shapes[0][0]), F32).astype(BF))
  q = jax.jit(lambda kk, s: quant.quantize(jax.random.normal(kk, s, F32) * s[1] ** -0.5), static_argnums=1)
  fp8 = [(x, second) + tuple(q(k[2 + j * len(shapes) + i], s) for i, s in enumerate(shapes)) for j in range(nsets)]
  bf16 = [st[:2] + tuple(quant.dequantize(w, BF) for w in st[2:]) for st in fp8]
  return fp8, bf16


def check(name, f, ref, st, t, failures):
  """(max rel err vs the model's path, row 2 of T equal to the T = 1 call, or None at T = 1)."""
  outs, refs = jax.tree.leaves(f(*st)), jax.tree.leaves(ref(*st))
  errs = [bk.rel(o.astype(F32), r.astype(F32)) for o, r in zip(outs, refs)]
  if max(errs) > 1e-2 or any(o.shape != r.shape for o, r in zip(outs, refs)):
    failures.append(f"{name}: rel err {errs}")
  inv = None
  if t > 1:
    x, second = st[0], st[1]
    one = jax.tree.leaves(f(*((x[2:3], second[2:3] if second.ndim == 2 else second) + st[2:])))
    inv = all(np.array_equal(np.asarray(o[2:3], F32), np.asarray(a, F32)) for o, a in zip(outs, one))
    if not inv:
      failures.append(f"{name}: row 2 differs from the T=1 call")
  return max(errs), inv


def run_fp8(name, t, cname, cfg, scale_on, projs, ref, sets, nbytes, base, failures):
  f = jax.jit(fp8_kernel_fn(projs, cfg, scale_on))
  label = f"{name} T={t} fp8 {cname} {scale_on}"
  try:
    jax.block_until_ready(f(*sets[0]))
  except ValueError as ex:
    if str(ex).startswith(("SMEM", "block_k=", "block_n=", "K=")):
      return dict(name=label, unsupported=str(ex)[:300])
    failures.append(f"{label}: ValueError: {str(ex)[:300]}")
    return dict(name=label, error=str(ex)[:2000])
  except Exception as ex:  # noqa: BLE001 -- one config's compile / launch error: a failure, the sweep goes on
    failures.append(f"{label}: {type(ex).__name__}: {str(ex)[:300]}")
    return dict(name=label, error=f"{type(ex).__name__}: {str(ex)[:2000]}")
  err, inv = check(label, f, jax.jit(ref), sets[0], t, failures)
  tk = bk.timeit(f, sets)
  return dict(name=label, case=name, t=t, kind="fp8 kernel", config_name=f"{cname} {scale_on}", time_us=tk,
              bytes=nbytes, rel_err=err, batch_invariant=inv, config=str(cfg), **base)


def bench_case(ci, name, shapes, projs, rows, failures, ts=(1, 6, 17), configs=CONFIGS, flush=lambda: None):
  """Rows of one case at each T in ts over the fp8 configs; flush() after each row (the JSON so far)."""
  fp8_w = sum(a * b + 4 * -(-a // 128) * -(-b // 128) for a, b in shapes)
  nsets = max(2, -(-COLD_BYTES // fp8_w))
  ref = model_fn(projs)
  for t in ts:
    sets, sets_bf16 = make_sets(shapes, projs, t, nsets, jax.random.key(100 * ci + t))
    io = sum(a.nbytes for a in sets[0][:2]) + sum(o.size * o.dtype.itemsize
                                                  for o in jax.tree.leaves(jax.eval_shape(ref, *sets[0])))
    nbytes = fp8_w + io
    t_xla = bk.timeit(ref, sets)
    rows.append(dict(name=f"{name} T={t} XLA fp8-dequant (model jnp)", case=name, t=t, kind="xla", time_us=t_xla,
                     bytes=nbytes))
    bf16_bytes = sum(a * b * 2 for a, b in shapes) + io
    t_bf16 = bk.timeit(kernel_fn(projs, LinearConfig()), sets_bf16)
    rows.append(dict(name=f"{name} T={t} bf16 kernel (default config)", case=name, t=t, kind="bf16 kernel",
                     time_us=t_bf16, bytes=bf16_bytes))
    print(rows[-2], rows[-1], sep="\n", flush=True)
    flush()
    base = dict(xla_time_us=t_xla, bf16_kernel_time_us=t_bf16)
    for cname, cfg in configs.items():
      for scale_on in SCALE_ON:
        rows.append(run_fp8(name, t, cname, cfg, scale_on, projs, ref, sets, nbytes, base, failures))
        print(rows[-1], flush=True)
        flush()


def summary(rows, ceiling):
  print(f"\nHBM ceiling {ceiling.bytes_per_s / 1e12:.3f} TB/s ({ceiling.source})")
  print(f"{'case':30s} {'T':>3s} {'best fp8 config':24s} {'us':>7s} {'xla_us':>7s} {'bf16_us':>7s} {'x XLA':>6s} "
        f"{'x bf16':>6s} {'MB':>6s} {'frac':>5s}")
  best = {}
  for r in (r for r in rows if r.get("kind") == "fp8 kernel"):
    key = (r["case"], r["t"])
    if key not in best or r["time_us"] < best[key]["time_us"]:
      best[key] = r
  for (case, t), r in best.items():
    print(f"{case:30s} {t:3d} {r['config_name']:24s} {r['time_us']:7.1f} {r['xla_time_us']:7.1f} "
          f"{r['bf16_kernel_time_us']:7.1f} {r['xla_time_us'] / r['time_us']:6.2f} "
          f"{r['bf16_kernel_time_us'] / r['time_us']:6.2f} {r['bytes'] / 1e6:6.1f} {r['fraction_of_floor']:5.2f}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  ap.add_argument("--cases", default="", help="comma-separated case-name prefixes (default: all)")
  ap.add_argument("--ts", default="1,6,17", help="comma-separated T values (rows), in order")
  ap.add_argument("--configs", default="", help=f"comma-separated fp8 config names of {list(CONFIGS)} (default: all)")
  ap.add_argument("--tree", default=None, help="the commit / tree benched (the JSON's `tree`; default: git HEAD)")
  args = ap.parse_args()
  ts = tuple(int(t) for t in args.ts.split(","))
  unknown = [c for c in args.configs.split(",") if c and c not in CONFIGS]
  if unknown:
    ap.error(f"--configs {unknown} not in {list(CONFIGS)}")
  configs = {c: CONFIGS[c] for c in args.configs.split(",")} if args.configs else CONFIGS
  ceiling = bk.hbm_ceiling()
  rows, failures, start = [], [], time.perf_counter()
  write = lambda: bk.write_result(args.out, "kernels-fused-linear-fp8", rows, ceiling, args.tree)
  for ci, (name, (shapes, projs, _)) in enumerate(CASES.items()):
    if args.cases and not any(name.startswith(c) for c in args.cases.split(",")):
      continue
    bench_case(ci, name, shapes, projs, rows, failures, ts, configs, write)  # partial rows survive a timeout
  path = write()
  print(f"\nwrote {path} ({time.perf_counter() - start:.0f} s)")
  summary(rows, ceiling)
  if failures:
    print("CHECKS FAILED:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)


if __name__ == "__main__":
  main()
