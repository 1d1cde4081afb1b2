"""KDA prefill bench at Ling-3.0-flash dims (H=32, Dk=Dv=128, B=1): Pallas chunked kernel vs the model's
own jnp chunked form (ling_jax.layers.kda.kda_chunked, XLA), same run, same inputs.

  python3 -m bench.kernels_kda_prefill --out $OUT            (GPU; writes kernels-kda-prefill-<dev>-<date>.json)
  python3 -m bench.kernels_kda_prefill --small               (CPU smoke test: tiny dims, interpret mode)

Timing: jit, warm up, then the device-synchronised median of `reps` calls alternating two input sets
(each set at T=8192 is ~675 MB, far beyond the 60 MB L2). Prefill calls run 0.1-10 ms, so the
host dispatch cost (~10-20 us) is a small bias; it is not subtracted.
Floors, per row (`floor_us` is the larger, `floor_kind` says which):
  bytes: q, k, v, g (fp32) + beta + o (fp32) + state in and out, over the copy bandwidth `bw`;
  flops: the chunked form's useful MACs (no recomputation across value tiles, triangles halved) per
    chunk and head: 2 (L^2/2) Dk [A, Aqk] + 2 L Dk Dv [k S0, q S0] + 2 (L^2/2) Dv [solve, Aqk U]
    + L Dk Dv [S update], over the rate of the dot precision used: fp32 CUDA cores 67 TFLOP/s
    ("ieee"), tf32 tensor cores 395 TFLOP/s ("tf32"), a third of it for 3-pass "tf32x3";
    bf16 790 TFLOP/s is listed for reference.
"""
from __future__ import annotations

import argparse, datetime, json, os, subprocess, sys, time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.kda_prefill import CHUNK, KdaPrefillConfig, kda_prefill  # noqa: E402
from tests.kernel_oracles import kda_prefill as model_chunked  # noqa: E402

RATES = {"ieee": 67e12, "tf32": 395e12, "tf32x3": 395e12 / 3, "bf16": 790e12}   # H200 SXM dense FLOP/s


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def median_us(f, sets, reps):
  jax.block_until_ready(f(*sets[0]))
  jax.block_until_ready(f(*sets[-1]))
  ts = []
  for r in range(reps):
    s = sets[r % len(sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(f(*s))
    ts.append(time.perf_counter() - t0)
  return 1e6 * float(np.median(ts))


def make_inputs(key, t, h, d):
  """Model-like fp32 inputs: l2-normed q (scaled) / k, gates in (-5, 0), beta in (0, 1), state."""
  ks = jax.random.split(key, 6)
  l2 = lambda x: x * lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
  q = l2(jax.random.normal(ks[0], (1, t, h, d))) * d ** -0.5
  k = l2(jax.random.normal(ks[1], (1, t, h, d)))
  v = jax.random.normal(ks[2], (1, t, h, d))
  g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (1, t, h, d)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, t, h)))
  s0 = 0.1 * jax.random.normal(ks[5], (1, h, d, d))
  return q, k, v, g, beta, s0


def floors(t, h, d, bw, precision):
  nbytes = 4 * (5 * t * h * d + t * h + 2 * h * d * d)
  n = -(-t // CHUNK)
  macs = n * h * (CHUNK * CHUNK * d + 2 * CHUNK * d * d + CHUNK * CHUNK * d + CHUNK * d * d)
  fb, ff = 1e6 * nbytes / bw, 1e6 * 2 * macs / RATES[precision]
  return nbytes, 2 * macs, fb, ff


CONFIGS = [("bv32w8-tf32x3", KdaPrefillConfig(block_v=32, num_warps=8, precision="tf32x3")),
           ("bv64w8-tf32x3", KdaPrefillConfig(block_v=64, num_warps=8, precision="tf32x3")),
           ("bv32w4-tf32x3", KdaPrefillConfig(block_v=32, num_warps=4, precision="tf32x3")),
           ("bv32w8-tf32", KdaPrefillConfig(block_v=32, num_warps=8, precision="tf32")),
           ("bv64w8-tf32", KdaPrefillConfig(block_v=64, num_warps=8, precision="tf32")),
           ("bv32w8-ieee", KdaPrefillConfig(block_v=32, num_warps=8, precision="ieee"))]
DEFAULT = ("bv32w8-tf32x3", "bv64w8-tf32x3", "bv32w8-tf32")   # each (T, config) is one Triton compile


def bench(rows, bw, key, small=False, configs=None, lengths=None):
  """Append one row per (T, config) to rows; failures print and continue."""
  h, d = (2, 32) if small else (32, 128)
  lengths = lengths or ((64, 130) if small else (512, 2048, 8192))
  configs = configs or ([("small-interpret", KdaPrefillConfig(block_v=16, interpret=True))]
                        if small else [c for c in CONFIGS if c[0] in DEFAULT])
  reps = 3 if small else 20
  ref_fn = model_chunked   # the model's kda_chunked (chunk 64), jitted
  for t in lengths:
    try:
      sets = [make_inputs(jax.random.fold_in(key, 10 * t + j), t, h, d) for j in range(2)]
      o_ref, s_ref = ref_fn(*sets[0])
      t_base = median_us(ref_fn, sets, reps)
      print(f"T={t} model kda_chunked (XLA): {t_base:.1f} us", flush=True)
    except Exception as ex:  # noqa: BLE001 (report and go on)
      print(f"FAILED model kda_chunked T={t}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
      o_ref = s_ref = t_base = None
    for name, cfg in configs:
      try:
        f = jax.jit(lambda *a, cfg=cfg: kda_prefill(*a, config=cfg))
        o, s = f(*sets[0])
        err = None if o_ref is None else max(rel(o, o_ref), rel(s, s_ref))
        tk = median_us(f, sets, reps)
        nbytes, flops, fb, ff = floors(t, h, d, bw, cfg.precision)
        floor = max(fb, ff)
        rows.append(dict(
            name=f"kda_prefill T={t} {name}", time_us=tk, bytes=nbytes, floor_us=floor,
            fraction_of_floor=floor / tk, floor_kind="bytes" if fb >= ff else f"flops@{cfg.precision}",
            floor_bytes_us=fb, floor_flops_us=ff, flops=flops,
            floor_flops_bf16_us=1e6 * flops / RATES["bf16"],
            baseline="model kda_chunked (jnp, XLA)", baseline_time_us=t_base,
            rel_err=err, config=str(cfg)))
        print(rows[-1], flush=True)
      except Exception as ex:  # noqa: BLE001
        print(f"FAILED kda_prefill T={t} {name}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--small", action="store_true", help="CPU smoke test: tiny dims, interpret mode")
  ap.add_argument("--configs", default="", help="comma list of config names, or 'all' (default: DEFAULT)")
  ap.add_argument("--lengths", default="", help="comma list of T (default: 512,2048,8192)")
  args = ap.parse_args()
  configs = ([c for c in CONFIGS if args.configs == "all" or c[0] in args.configs.split(",")]
             if args.configs else None)
  lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else None
  from bench.ceiling import Ceiling, apply

  ceiling = Ceiling.measure(jax.devices()[0])
  bw = ceiling.bytes_per_s
  print(f"HBM ceiling {bw / 1e12:.3f} TB/s ({ceiling.source})", flush=True)
  rows = [dict(name="hbm ceiling (start of run)", time_us=None, bytes=None, bw_bytes_per_s=bw)]
  try:  # SIGINT (timeout -s INT) still writes what was measured
    bench(rows, bw, jax.random.key(0), small=args.small, configs=configs, lengths=lengths)
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  kind = str(jax.devices()[0].device_kind)
  dev = "h200" if "H200" in kind else kind.lower().replace(" ", "-")
  date = datetime.date.today().isoformat()
  commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  apply(rows, ceiling)
  res = dict(command=" ".join(sys.argv), device=kind, jax_version=jax.__version__, date=date,
             git_commit=commit or "unknown", **ceiling.summary(), rows=rows)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"kernels-kda-prefill-{dev}-{date}{'-small' if args.small else ''}.json")
  with open(path, "w") as fh:
    json.dump(res, fh, indent=1)
  print(f"\n{'name':40s} {'us':>10s} {'floor':>9s} {'kind':>11s} {'frac':>6s} {'base_us':>10s} {'err':>8s}")
  for r in rows[1:]:
    print(f"{r['name']:40s} {r['time_us']:10.1f} {r['floor_us']:9.1f} {r['floor_kind']:>11s} "
          f"{r['fraction_of_floor']:6.3f} {r['baseline_time_us'] or 0:10.1f} "
          f"{r['rel_err'] if r['rel_err'] is not None else float('nan'):8.1e}")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
