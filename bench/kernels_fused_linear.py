"""Fused norm + projection / projection + residual (pallas_kernels/fused_linear.py) at Ling-3.0-flash dims.

  python3 -m bench.kernels_fused_linear --out $OUT      (GPU, < 4 min; writes kernels-fused-linear-<device>-<date>.json)

Per case and T in (1, 6, 17): every candidate config (CONFIGS: CTAs per SM and so ring depth per CTA, block_k;
NO_NORM for linear_residual: block_k 512, streamed x; the ring is auto-sized to the CTA's SMEM share) is first
checked against the model's jnp path on the GPU (rel err <= 1e-2 per output; for T > 1 row 2 bitwise equal
to the T = 1 call on that row with the same config: batch invariance), then timed, as is the XLA baseline
(rms_norm + einsum as the layers write them), with bench_kernels.timeit (profiler span per call, input sets with
their own weights rotated over > 200 MB: cold L2). T = 1 and 17 sweep every config; T = 6 runs the T = 1 winner
(and the default). Bytes = weights + x + outputs; `fraction_of_4.3TB/s` = bytes / ceiling / time. A config that
does not fit (SMEM) is reported as unsupported, not a failure. Once --budget-s seconds have passed only the
default config runs (the run stays bounded). Prints the best config per case vs XLA; exits non-zero if any
check failed (after writing the JSON).
"""
from __future__ import annotations

import argparse, os, sys, time

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from ling_jax.layers.moe import router_logits, swiglu
from ling_jax.layers.norms import rms_norm
from pallas_kernels.fused_linear import LinearConfig, Proj, linear_residual, norm_linear

BF, F32, D, EPS, HBM = jnp.bfloat16, jnp.float32, 2560, 1e-6, 4.3e12
COLD_BYTES = 200_000_000   # weights rotated per timing (> L2)
# name -> config; the first is the default. Ring "auto" = as deep as the CTA's SMEM share allows.
CONFIGS = {
    "1cta-k128-auto": LinearConfig(),
    "1cta-k256-auto": LinearConfig(block_k=256),
    "2cta-k128-auto": LinearConfig(ctas_per_sm=2),
}
NO_NORM = {"1cta-k512-auto": LinearConfig(block_k=512),          # linear_residual only (no norm weight box)
           "1cta-k256-xstream": LinearConfig(block_k=256, stream_x=True)}
proj = lambda xn, w: jnp.einsum("td,nd->tn", xn, w)
# name -> (weight shapes, Proj tuple or None for linear_residual, the model's composition)
CASES = {
    "kda q|k|v|f|g + b": ([(20480, D), (32, D)], (Proj(), Proj()),
                          lambda x, nw, w, b: (proj(rms_norm(x, nw, EPS), w), proj(rms_norm(x, nw, EPS), b))),
    "mla q|kv_a|g": ([(6144, D), (576, D), (32, D)], (Proj(), Proj(), Proj("sigmoid")),
                     lambda x, nw, q, kv, g: (lambda xn: (proj(xn, q), proj(xn, kv),
                                                          jax.nn.sigmoid(proj(xn, g).astype(F32))))(
                         rms_norm(x, nw, EPS))),
    "dense gate|up swiglu": ([(6144, D), (6144, D)], (Proj("swiglu", limit=7.0),),
                             lambda x, nw, g, u: (lambda xn: (swiglu(proj(xn, g), proj(xn, u), 7.0),))(
                                 rms_norm(x, nw, EPS))),
    "shared gate|up + router": ([(768, D), (768, D), (512, D)],
                                (Proj("swiglu", limit=7.0), Proj("sigmoid", logit="float32")),
                                lambda x, nw, g, u, r: (lambda xn: (
                                    swiglu(proj(xn, g), proj(xn, u), 7.0),
                                    jax.nn.sigmoid(router_logits(xn, r, fp32_weight=False))))(
                                    rms_norm(x, nw, EPS))),
    "o_proj + residual 4096->2560": ([(D, 4096)], None,
                                     lambda o, res, w: res + jnp.einsum("tc,dc->td", o, w)),
}


def kernel_fn(projs, cfg):
  """fn(*set) with set = (x, nw, *weights) (or (o, residual, w) for linear_residual)."""
  if projs is None:
    return lambda o, res, w: linear_residual(o, w, res, config=cfg)

  def f(x, nw, *ws):
    it, weights = iter(ws), []
    for p in projs:
      weights.append((next(it), next(it)) if p.kind == "swiglu" else next(it))
    return norm_linear(x, nw, tuple(weights), projs=projs, eps=EPS, config=cfg)
  return f


def make_sets(shapes, projs, t, nsets, key):
  k = jax.random.split(key, 3 + nsets * len(shapes))
  kin = shapes[0][1]
  x = (3 * jax.random.normal(k[0], (t, kin), F32)).astype(BF)
  head = (x, (1 + 0.1 * jax.random.normal(k[1], (kin,), F32)).astype(BF)) if projs else \
         (x, jax.random.normal(k[1], (t, shapes[0][0]), F32).astype(BF))
  return [head + tuple((jax.random.normal(k[3 + j * len(shapes) + i], s, F32) * s[1] ** -0.5).astype(BF)
                       for i, s in enumerate(shapes)) for j in range(nsets)]


def check(name, t, f, ref, sets, failures):
  """Max rel err of f vs the model's ref on sets[0]; for T > 1 whether row 2 equals the T = 1 call bitwise."""
  outs, refs = jax.tree.leaves(f(*sets[0])), jax.tree.leaves(ref(*sets[0]))
  errs = [bk.rel(o.astype(F32), r.astype(F32)) for o, r in zip(outs, refs)]
  if max(errs) > 1e-2 or any(o.shape != r.shape for o, r in zip(outs, refs)):
    failures.append(f"{name} T={t}: rel err {errs}")
  inv = None
  if t > 1:
    x, second = sets[0][0], sets[0][1]
    one = jax.tree.leaves(f(*((x[2:3], second[2:3] if second.ndim == 2 else second) + sets[0][2:])))
    inv = all(np.array_equal(np.asarray(o[2:3], np.float32), np.asarray(a, np.float32)) for o, a in zip(outs, one))
    if not inv:
      failures.append(f"{name} T={t}: row 2 differs from the T=1 call")
  return max(errs), inv


def run_config(name, t, cname, cfg, projs, ref, sets, nbytes, t_xla, failures):
  """Check + time one config; the result row (or an `unsupported` row when it does not fit)."""
  f = kernel_fn(projs, cfg)
  try:
    jax.block_until_ready(f(*sets[0]))
  except ValueError as ex:
    if str(ex).startswith(("SMEM", "block_k=", "K=")):  # the kernel's own "does not fit" errors: not a failure
      return dict(name=f"{name} T={t} {cname}", unsupported=str(ex)[:300])
    failures.append(f"{name} T={t} {cname}: ValueError: {str(ex)[:300]}")
    return dict(name=f"{name} T={t} {cname}", error=f"ValueError: {str(ex)[:2000]}")
  except Exception as ex:  # noqa: BLE001 -- a GPU compile / launch error of one config: a failure, the sweep goes on
    failures.append(f"{name} T={t} {cname}: {type(ex).__name__}: {str(ex)[:300]}")
    return dict(name=f"{name} T={t} {cname}", error=f"{type(ex).__name__}: {str(ex)[:2000]}")
  err, inv = check(f"{name} {cname}", t, jax.jit(f), jax.jit(ref), sets, failures)
  tk = bk.timeit(f, sets)
  return dict(name=f"{name} T={t} {cname}", case=name, t=t, config_name=cname, time_us=tk, bytes=nbytes,
              floor_us=1e6 * nbytes / HBM, **{"fraction_of_4.3TB/s": nbytes / HBM / (tk * 1e-6)},
              baseline="XLA rms_norm + einsum", baseline_time_us=t_xla, rel_err=err, batch_invariant=inv,
              config=str(cfg), nsets=len(sets))


def candidates(projs, t, best_t1, start, budget_s):
  """Config names to run for (case, T): all (plus BK = 512 and streamed x for linear_residual) at T = 1 and 17, the
  default and the T = 1 winner at T = 6; only the default once the time budget is spent."""
  names = list(CONFIGS) + (list(NO_NORM) if projs is None else [])
  if time.perf_counter() - start > budget_s:
    return names[:1]
  if t == 6:
    return list(dict.fromkeys([names[0]] + ([best_t1] if best_t1 else [])))
  return names


def summary(rows):
  """Best config per (case, T) against XLA."""
  print(f"\n{'case':32s} {'T':>3s} {'best config':20s} {'us':>7s} {'xla_us':>7s} {'x XLA':>6s} {'MB':>6s} {'frac':>5s}")
  best = {}
  for r in (r for r in rows if "config_name" in r):
    key = (r["case"], r["t"])
    if key not in best or r["time_us"] < best[key]["time_us"]:
      best[key] = r
  for (case, t), r in best.items():
    print(f"{case:32s} {t:3d} {r['config_name']:20s} {r['time_us']:7.1f} {r['baseline_time_us']:7.1f} "
          f"{r['baseline_time_us'] / r['time_us']:6.2f} {r['bytes'] / 1e6:6.1f} {r['fraction_of_4.3TB/s']:5.2f}")
  return best


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  ap.add_argument("--budget-s", type=float, default=130.0, help="after this, only the default config runs")
  args = ap.parse_args()
  rows, failures, start = [], [], time.perf_counter()
  for ci, (name, (shapes, projs, ref)) in enumerate(CASES.items()):
    wbytes = sum(a * b * 2 for a, b in shapes)
    nsets = max(2, -(-COLD_BYTES // wbytes))
    best_t1 = None
    for t in (1, 17, 6):
      sets = make_sets(shapes, projs, t, nsets, jax.random.key(100 * ci + t))
      outs = jax.tree.leaves(jax.eval_shape(ref, *sets[0]))
      nbytes = wbytes + sum(a.nbytes for a in sets[0][:2]) + sum(o.size * o.dtype.itemsize for o in outs)
      t_xla = bk.timeit(ref, sets)
      rows.append(dict(name=f"{name} T={t} XLA (rms_norm + einsum)", time_us=t_xla, bytes=nbytes,
                       floor_us=1e6 * nbytes / HBM, baseline="-", baseline_time_us=None,
                       **{"fraction_of_4.3TB/s": nbytes / HBM / (t_xla * 1e-6)}))
      print(rows[-1], flush=True)
      timed = []
      for cname in candidates(projs, t, best_t1, start, args.budget_s):
        rows.append(run_config(name, t, cname, {**CONFIGS, **NO_NORM}[cname], projs, ref, sets, nbytes, t_xla,
                               failures))
        print(rows[-1], flush=True)
        if "time_us" in rows[-1]:
          timed.append(rows[-1])
      if t == 1 and timed:
        best_t1 = min(timed, key=lambda r: r["time_us"])["config_name"]
  path = bk.write_result(args.out, "kernels-fused-linear", rows, bk.hbm_ceiling())
  print(f"\nwrote {path} ({time.perf_counter() - start:.0f} s)")
  print(f"{'name':60s} {'us':>8s} {'xla_us':>8s} {'MB':>7s} {'frac':>5s}")
  for r in rows:
    if "time_us" in r and r.get("baseline_time_us"):
      print(f"{r['name']:60s} {r['time_us']:8.1f} {r['baseline_time_us']:8.1f} {r['bytes'] / 1e6:7.1f} "
            f"{r['fraction_of_4.3TB/s']:5.2f}")
  summary(rows)
  if failures:
    print("CHECKS FAILED:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)


if __name__ == "__main__":
  main()
