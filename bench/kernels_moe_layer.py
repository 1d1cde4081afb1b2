"""The MoE layer pass at Ling-3.0-flash dims, cold weights: the Mosaic MoE chain at its token columns and grids.

  python3 bench/kernels_moe_layer.py --out $OUT     (GPU, ~1-2 min, 8 variants; writes kernels-moe-layer-<device>-<date>.json)
  python3 bench/kernels_moe_layer.py --small        (CPU smoke: tiny dims, interpret mode)

One call = residual + moe_layer(x) as the verify / decode path runs it (live_rows given, the Pallas router, the
Mosaic MoE): router scores, router top-k, the routing borrow, ~10 XLA kernels of alignment and padding, up, down,
the split-K sum + residual. It runs at N = 64 token columns, at the Mosaic MoE's N = 16 / 32 where T fits
(KernelCalls.moe_n_tokens) with the default tiles, and at T = 1 the TILES grids (KernelCalls.moe_tiles): the
T = 1 bandwidth A/B. (Its "slots" variants went with KernelCalls.moe_slots: kernels-moe-layer-h200-2026-12-01-
partial.json has their rows.)

Checks before timing, on set 0: rel err vs the model's jnp moe_layer (kernels=None), `batch_invariant` (row 0
alone = row 0 in the batch), `equal_to_n64` (bitwise vs the same chain at N = 64). Timing: bench_kernels.timeit (profiler span per call of a program of
`nsets` dependent calls, residual <- previous output; each set's x routes to other experts of 6 GB of expert
weights: cold), `kernels_per_call` from the same trace. Bytes: the distinct experts of the sets' routing + the
shared expert (3 x I x D bf16 each) + the router's gate weight; fraction = floor / time at the run's ceiling and
at the day's 4.29 TB/s.
"""
from __future__ import annotations

import argparse, dataclasses, os, sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import bench_kernels as bk  # noqa: E402
from ling_jax.config import PRESETS  # noqa: E402
from ling_jax.kernel_calls import KernelCalls  # noqa: E402
from ling_jax.layers.moe import moe_layer, route, router_logits  # noqa: E402
from pallas_kernels import moe_mosaic as mm  # noqa: E402

BF = jnp.bfloat16
DAY_CEILING = 4.29e12
LIMITS = dict(routed_limit=4.0, shared_limit=5.0)


# Grid candidates for T <= 32 (MosaicMoeConfig fields; all lower for CUDA at Ling size with N = 16 / 32):
# ks6: the down GEMM's I split in 6 (40 x 6 = 240 CTAs, 2 per SM fit in SMEM at N <= 32, so twice the weight
# bytes in flight per SM; the default 40 x 3 = 120 CTAs leave 12 SMs idle); up6: 6-deep up pipeline (6 x 36 KB).
TILES = [("ks6", mm.MosaicMoeConfig(split_k=6)), ("up6 ks6", mm.MosaicMoeConfig(up_stages=6, split_k=6, down_stages=6))]


def variants(t, small):
  """(name, KernelCalls) for T tokens: N = 64; the smallest N in (16, 32) that fits, with the default tiles and
  the TILES candidates."""
  base = KernelCalls(interpret=True, moe_impl="mosaic") if small else KernelCalls()
  out = [("n64", base)]
  n = next((n for n in (16, 32) if t <= n), None)
  if n is not None:
    out += [(f"n{n}", dataclasses.replace(base, moe_n_tokens=n))]
    out += [] if small or t > 1 else [(f"n{n} {name}", dataclasses.replace(base, moe_n_tokens=n, moe_tiles=tiles))
                                      for name, tiles in TILES]  # the grid A/B where the bandwidth is lost: T = 1
  return out


def params(key, cfg):
  d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  k = jax.random.split(key, 8)
  nrm = lambda kk, s, sc: (jax.random.normal(kk, s, jnp.float32) * sc).astype(BF)
  return dict(gate_w=nrm(k[0], (e, d), d ** -0.5), expert_bias=jnp.zeros((e,), jnp.float32),
              w_gate=nrm(k[1], (e, i, d), 0.02), w_up=nrm(k[2], (e, i, d), 0.02), w_down=nrm(k[3], (e, d, i), 0.02),
              shared=dict(gate_proj=nrm(k[4], (i, d), 0.02), up_proj=nrm(k[5], (i, d), 0.02),
                          down_proj=nrm(k[6], (d, i), 0.02)))


def bench(rows, bw, key, small=False, nsets=8):
  cfg = (dataclasses.replace(PRESETS["ling-demo"], hidden_size=256, moe_intermediate_size=128,
                             moe_shared_expert_intermediate_size=128) if small else PRESETS["ling3-flash"])
  nsets = 2 if small else nsets
  p = params(key, cfg)
  d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  expert_bytes = 3 * i * d * 2
  for t in ((6,) if small else (1, 6, 17)):
    sets = []
    for j in range(nsets):
      kx, kr = jax.random.split(jax.random.fold_in(key, 100 * t + j))
      sets.append((jax.random.normal(kx, (1, t, d), jnp.float32).astype(BF),
                   jax.random.normal(kr, (1, t, d), jnp.float32).astype(BF), jnp.array([t], jnp.int32)))
    ids = [route(router_logits(s[0][0], p["gate_w"], fp32_weight=False), p["expert_bias"], cfg)[0] for s in sets]
    distinct = float(np.mean([len(np.unique(np.asarray(a))) for a in ids]))
    nbytes = (distinct + 1) * expert_bytes + e * d * 2 + 4 * t * d * 2
    floor = 1e6 * nbytes / bw
    x0, r0, live0 = sets[0]
    ref = moe_layer(p, x0, cfg, router_fp32=False, kernels=None, live_rows=live0, **LIMITS) + r0
    outs = {}
    for name, kc in variants(t, small):
      fn = lambda x, res, live, p, kc=kc: res + moe_layer(p, x, cfg, router_fp32=False, kernels=kc,
                                                          live_rows=live, **LIMITS)
      try:
        out = jax.jit(fn)(x0, r0, live0, p)
        alone = jax.jit(fn)(x0[:, :1], r0[:, :1], jnp.array([1], jnp.int32), p)
        outs[name] = np.asarray(out, np.float32)
        detail = {}
        tk = bk.timeit(fn, sets, (p,), chain=lambda prev, s: (s[0], prev, s[2]), detail=detail)
        rows.append(dict(
            name=f"moe layer T={t} {name}", time_us=tk, bytes=nbytes, floor_us=floor,
            fraction_of_floor=floor / tk if tk else None, fraction_of_4_29=1e6 * nbytes / DAY_CEILING / tk if tk else None,
            rel_err=bk.rel(out, ref), distinct_experts=distinct, nsets=nsets,
            batch_invariant=bool(np.array_equal(np.asarray(alone, np.float32), outs[name][:, :1])),
            equal_to_n64=None if name == "n64" else bool(np.array_equal(outs[name], outs["n64"])),
            **detail))
        print(rows[-1], flush=True)
      except Exception as ex:  # one failing variant must not cost the run
        print(f"FAILED T={t} {name}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  ap.add_argument("--small", action="store_true", help="CPU smoke test: tiny dims, interpret")
  args = ap.parse_args()
  ceiling = bk.hbm_ceiling()
  bw = ceiling.bytes_per_s
  print(f"HBM ceiling {bw / 1e12:.3f} TB/s ({ceiling.source})", flush=True)
  rows = [dict(name="hbm ceiling (start of run)", time_us=None, bytes=None, bw_bytes_per_s=bw)]
  try:  # SIGINT still writes what was measured
    bench(rows, bw, jax.random.key(0), small=args.small)
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  path = bk.write_result(args.out, "kernels-moe-layer", rows, ceiling)
  print(f"\nwrote {path}\n{'name':36s} {'us':>8s} {'floor':>7s} {'frac':>6s} {'f4.29':>6s} {'kern':>5s} "
        f"{'err':>8s} {'inv':>5s} {'=n64':>5s}")
  for r in rows[1:]:
    print(f"{r['name']:36s} {r['time_us']:8.1f} {r['floor_us']:7.1f} {r['fraction_of_floor'] or 0:6.2f} "
          f"{r['fraction_of_4_29'] or 0:6.2f} {r.get('kernels_per_call') or 0:5.1f} {r['rel_err']:8.1e} "
          f"{str(r['batch_invariant']):>5s} {str(r['equal_to_n64']):>5s}")


if __name__ == "__main__":
  main()
