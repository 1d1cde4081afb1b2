"""Fused norm + projection / projection + residual (pallas_kernels/fused_linear.py) at Ling-3.0-flash dims.

  python3 -m bench.kernels_fused_linear --out $OUT      (GPU; writes kernels-fused-linear-<device>-<date>.json)

Per case and T in (1, 6, 17): first checks the kernel against the model's jnp path on the GPU (rel err <= 1e-2
per output; row 2 of the T=6 call bitwise equal to the T=1 call on that row), then times the kernel (each config)
and the XLA baseline (rms_norm + einsum as the layers write them) with bench_kernels.timeit (profiler span per
call, input sets with their own weights rotated over > 200 MB: cold L2). Bytes = weights + x + outputs;
`fraction_of_4.3TB/s` = bytes / 4.3 TB/s / time. Exits non-zero if any check failed (after writing the JSON).
"""
from __future__ import annotations

import argparse, os, sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from ling_jax.layers.moe import router_logits, swiglu
from ling_jax.layers.norms import rms_norm
from pallas_kernels.fused_linear import LinearConfig, Proj, linear_residual, norm_linear

BF, F32, D, EPS, HBM = jnp.bfloat16, jnp.float32, 2560, 1e-6, 4.3e12
CONFIGS = [("n64k128r64K", LinearConfig()), ("n128k64r64K", LinearConfig(block_n=128, block_k=64))]
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
  outs, refs = jax.tree.leaves(f(*sets[0])), jax.tree.leaves(ref(*sets[0]))
  errs = [bk.rel(o.astype(F32), r.astype(F32)) for o, r in zip(outs, refs)]
  if max(errs) > 1e-2 or any(o.shape != r.shape for o, r in zip(outs, refs)):
    failures.append(f"{name} T={t}: rel err {errs}")
  inv = None
  if t == 6:
    one = jax.tree.leaves(f(*((sets[0][0][2:3], sets[0][1][2:3] if sets[0][1].ndim == 2 else sets[0][1])
                              + sets[0][2:])))
    inv = all(np.array_equal(np.asarray(o[2:3], np.float32), np.asarray(a, np.float32)) for o, a in zip(outs, one))
    if not inv:
      failures.append(f"{name}: row 2 of T=6 differs from the T=1 call")
  return max(errs), inv


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  args = ap.parse_args()
  rows, failures = [], []
  for ci, (name, (shapes, projs, ref)) in enumerate(CASES.items()):
    wbytes = sum(a * b * 2 for a, b in shapes)
    nsets = max(2, -(-200_000_000 // wbytes))
    for t in (1, 6, 17):
      sets = make_sets(shapes, projs, t, nsets, jax.random.key(100 * ci + t))
      outs = jax.tree.leaves(jax.eval_shape(ref, *sets[0]))
      nbytes = wbytes + sum(a.nbytes for a in sets[0][:2]) + sum(o.size * o.dtype.itemsize for o in outs)
      t_xla = bk.timeit(ref, sets)
      base = dict(name=f"{name} T={t} XLA (rms_norm + einsum)", time_us=t_xla, bytes=nbytes,
                  floor_us=1e6 * nbytes / HBM, baseline="-", baseline_time_us=None)
      rows.append({**base, "fraction_of_4.3TB/s": nbytes / HBM / (t_xla * 1e-6)})
      print(rows[-1], flush=True)
      for cname, cfg in CONFIGS:
        f = kernel_fn(projs, cfg)
        try:
          jax.block_until_ready(f(*sets[0]))
        except ValueError as ex:  # a config that does not fit (e.g. SMEM at T=17): reported, not a failure
          rows.append(dict(name=f"{name} T={t} {cname}", unsupported=str(ex)[:300]))
          print(rows[-1], flush=True)
          continue
        err, inv = check(name, t, jax.jit(f), jax.jit(ref), sets, failures)
        tk = bk.timeit(f, sets)
        rows.append(dict(name=f"{name} T={t} {cname}", time_us=tk, bytes=nbytes, floor_us=1e6 * nbytes / HBM,
                         **{"fraction_of_4.3TB/s": nbytes / HBM / (tk * 1e-6)}, baseline="XLA rms_norm + einsum",
                         baseline_time_us=t_xla, rel_err=err, batch_invariant=inv, config=str(cfg), nsets=nsets))
        print(rows[-1], flush=True)
  path = bk.write_result(args.out, "kernels-fused-linear", rows, bk.hbm_ceiling())
  print(f"\nwrote {path}\n{'name':52s} {'us':>8s} {'xla_us':>8s} {'MB':>7s} {'frac':>5s}")
  for r in rows:
    if "time_us" in r and r.get("baseline_time_us"):
      print(f"{r['name']:52s} {r['time_us']:8.1f} {r['baseline_time_us']:8.1f} {r['bytes'] / 1e6:7.1f} "
            f"{r['fraction_of_4.3TB/s']:5.2f}")
  if failures:
    print("CHECKS FAILED:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)


if __name__ == "__main__":
  main()
