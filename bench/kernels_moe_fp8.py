"""fp8-weight Mosaic GPU MoE (pallas_kernels/moe_mosaic_fp8) at Ling-3.0-flash dims, cold weights, against the
bf16 Mosaic kernel (moe_mosaic.moe) on the same weights dequantised, from the same run.

  python3 -m bench.kernels_moe_fp8 --out $OUT        (GPU; writes kernels-moe-fp8-<device>-<date>.json)

VARIANTS: what each pipeline step does with its e4m3 tile (MosaicMoeConfig's fp8 fields): dequantise in SMEM or
registers (the model's dequantised weight), the scale on the fp32 partial, the integer convert ("bits"), and
w8a8 (fp8_activations: x quantised per token and 128 columns by ling_jax.quant.quantize_activations inside the
timed call, e4m3 x e4m3 wgmma); a name ending in " tables": the call's alignment, scale tables and x pad from
pallas_kernels/moe_fp8_tables.py's one launch (KernelCalls.moe_fp8_tables) instead of moe_fp8's XLA chain.
First a check on the GPU at each T: each variant against its reference, rel err <= 1e-2, and token 0
bit-identical alone and in the batch; a variant that fails the check exits non-zero before anything is timed,
one that does not compile is reported and dropped. References: the model's own MoE math on the
dequantised weights (ling_jax.layers.moe.routed_experts + dense_mlp); for w8a8 the model's MoE with its activations
through quant.fake_quantize_activations (moe_experts(fp8_activations=True), f32 activations and matmuls, so that
it is the same quantised math), whose distance to the bf16 model is printed too (what w8a8 costs).
Timing: T = 6 for every variant, then T = 1 and 17 for the TOP fastest at T = 6 (--ts: other T, the first for
every variant); per T 16 input sets, each routed
to other experts of 3 GB of fp8 expert weights (cold: > 60 MB L2), timed by bench_kernels.timeit (chained calls,
profiler span) and kernels_moe_mosaic.loop_time (one compiled loop). fp8 bytes = (distinct experts + shared) x 3 x
I x D (+ their scales); fraction = bytes / the run's HBM ceiling (bench_kernels.hbm_ceiling) / the chained
time. The bf16 row reads twice the bytes.
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
from ling_jax.layers.moe import dense_mlp, moe_experts, routed_experts
from pallas_kernels import moe_mosaic as mm
from pallas_kernels.moe_fp8_tables import align_tables
from pallas_kernels.moe_mosaic_fp8 import moe_fp8

BF, F32 = jnp.bfloat16, jnp.float32
D, E, I, A = 2560, 512, 768, 8
LIMIT, SHARED_LIMIT = 4.0, 5.0
C = mm.MosaicMoeConfig
REG = dict(fp8_operand="registers")
W8A8 = dict(fp8_activations=True, block_i=128)
PBITS = dict(REG, fp8_scale_on="partial", fp8_convert="bits")   # KernelCalls' default fp8 form
small_n = lambda t: 16 if t <= 16 else 32   # w8a8's four [128, N] fp32 accumulators want few token columns
# (name, config for T tokens)
VARIANTS = [("fp8 smem", lambda t: C(fp8_operand="smem")),
            ("fp8 registers", lambda t: C(**REG)),
            ("fp8 registers bits", lambda t: C(**REG, fp8_convert="bits")),
            ("fp8 partial registers", lambda t: C(**REG, fp8_scale_on="partial")),
            ("fp8 partial-bits registers", lambda t: C(**REG, fp8_scale_on="partial", fp8_convert="bits")),
            ("fp8 partial-bits registers n16", lambda t: C(**REG, fp8_scale_on="partial", fp8_convert="bits",
                                                           n_tokens=small_n(t))),
            # more CTAs a wave: the down grid is (D / 64, split_k) = 120 CTAs at split_k 3, one per SM, each
            # converting, multiplying and waiting step after step; 6 gives two a SM to hide that latency
            ("fp8 partial-bits registers n16 ks6", lambda t: C(**PBITS, n_tokens=small_n(t), split_k=6)),
            ("fp8 partial-bits registers n16 ks6 s6", lambda t: C(**PBITS, n_tokens=small_n(t), split_k=6,
                                                                  up_stages=6, down_stages=6)),
            ("fp8 partial-bits registers n16 s2", lambda t: C(**PBITS, n_tokens=small_n(t), up_stages=2,
                                                              down_stages=2)),
            # KernelCalls' default form with its per-call operands from moe_fp8_tables' one launch (TABLES)
            ("fp8 partial-bits registers n16 ks6 tables", lambda t: C(**PBITS, n_tokens=small_n(t), split_k=6)),
            ("w8a8", lambda t: C(**W8A8, n_tokens=small_n(t))),
            ("w8a8 deep ks6", lambda t: C(**W8A8, n_tokens=small_n(t), up_stages=5, split_k=6, down_stages=8))]
TOP = 3   # variants timed at T = 1 and 17 too
TABLES = " tables"   # a variant name's suffix: the alignment, scale tables and x pad in moe_fp8_tables' one launch


def kernel_fn(cfg, name=""):
  """The timed call: x bf16 [T, D] -> [T, D] bf16 (w8a8: the activation quantisation included; a name ending in
  TABLES: moe_fp8_tables.align_tables' launch included, instead of moe_fp8's XLA alignment)."""
  def f(x, i_, w, wg, wu, wd, sh):
    xin = tuple(quant.quantize_activations(x)) if cfg.fp8_activations else x
    aligned = None
    if name.endswith(TABLES):
      scales = lambda ws: tuple(q.scale_inv for q in ws)
      aligned = align_tables(xin[0] if cfg.fp8_activations else xin, i_, w, *scales((wg, wu, wd)), scales(sh),
                             cfg=cfg, i=I)
    return moe_fp8(xin, i_, w, wg, wu, wd, shared=sh, limit=LIMIT, shared_limit=SHARED_LIMIT, config=cfg,
                   aligned=aligned)
  return f


def reference(x, ids, w, wg, wu, wd, sh):
  """The model's MoE on the dequantised weights (what the kernel must equal up to summation order)."""
  y = routed_experts(x, ids, w, wg, wu, wd, LIMIT)
  mlp = {"gate_proj": sh[0], "up_proj": sh[1], "down_proj": sh[2]}
  return (y + dense_mlp(mlp, x, SHARED_LIMIT).astype(F32)).astype(x.dtype)


def reference_w8a8(x, ids, w, wg, wu, wd, sh):
  """The model's MoE with fp8 activations (the same quantised x and h as the kernel), f32 activations and matmuls."""
  with jax.default_matmul_precision("highest"):
    y = moe_experts(x.astype(F32), ids, w, wg, wu, wd, limit=LIMIT, shared=sh, shared_limit=SHARED_LIMIT,
                    fp8_activations=True)
  return y.astype(x.dtype)


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


def check(fp8, sh, sets, variants, t):
  """Each variant vs its reference on the GPU: exits on a mismatch; a variant that does not compile is reported
  and dropped (the others still run). Returns the variants that passed."""
  x, ids, w = sets[0]
  refs = {}
  passed = []
  for name, make_cfg in variants:
    cfg = make_cfg(t)
    kind = "w8a8" if cfg.fp8_activations else "dequantised"
    if kind not in refs:
      refs[kind] = (reference_w8a8 if cfg.fp8_activations else reference)(x, ids, w, *fp8, sh)
    f = jax.jit(kernel_fn(cfg, name))
    try:
      out, alone = f(x, ids, w, *fp8, sh), f(x[:1], ids[:1], w[:1], *fp8, sh)
    except Exception as ex:  # noqa: BLE001  (report the compiler's message, keep the run)
      print(f"FAILED to run {name} T={t}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
      continue
    err = bk.rel(out, refs[kind])
    inv = np.array_equal(np.asarray(out[:1], np.float32), np.asarray(alone, np.float32))
    extra = ""
    if kind == "w8a8":
      refs.setdefault("dequantised", reference(x, ids, w, *fp8, sh))
      extra = f", vs the bf16 model {bk.rel(out, refs['dequantised']):.2e}"
    print(f"check T={t} {name}: rel err {err:.2e} vs its reference{extra}, batch invariant {inv}", flush=True)
    if not err <= 1e-2 or not inv:
      raise SystemExit(f"CHECK FAILED: {name} T={t} rel err {err:.3e} (<= 1e-2), batch invariant {inv}")
    passed.append((name, make_cfg))
  return passed


def bench(rows, key, variants, ceiling, nsets=16, ts=(6, 1, 17)):
  fp8, sh = weights(key)
  deq = lambda ws: tuple(quant.dequantize(q, BF) for q in ws)
  bf16, sh_bf16 = deq(fp8), deq(sh)
  chain = lambda prev, s: (prev,) + s[1:]
  for t in ts:
    sets = input_sets(key, t, nsets)
    variants = check(fp8, sh, sets, variants, t)
    distinct = float(np.mean([len(np.unique(np.asarray(s[1]))) for s in sets]))
    scale_bytes = 4 * sum(int(np.prod(q.scale_inv.shape[1:])) for q in fp8)
    fp8_bytes = (distinct + 1) * (3 * I * D + scale_bytes) + 2 * t * D * 2
    bf16_bytes = (distinct + 1) * 3 * I * D * 2 + 2 * t * D * 2
    bf16_f = lambda x, i_, w, wg, wu, wd, sh: mm.moe(x, i_, w, wg, wu, wd, shared=sh, limit=LIMIT,
                                                     shared_limit=SHARED_LIMIT)
    t_bf16 = loop_time(bf16_f, sets, (*bf16, sh_bf16))
    runs = [("bf16 mosaic (dequantised weights)", bf16_f, (*bf16, sh_bf16), bf16_bytes)]
    runs += [(name, kernel_fn(make_cfg(t), name), (*fp8, sh), fp8_bytes) for name, make_cfg in variants]
    loop_us = {}
    for name, f, consts, nbytes in runs:
      tl = t_bf16 if name.startswith("bf16") else loop_time(f, sets, consts)
      tc = bk.timeit(f, sets, consts, chain=chain)
      loop_us[name] = tl
      rows.append(dict(name=f"moe T={t} {name}", time_us=tc, loop_time_us=tl, bytes=nbytes,
                       fraction_of_ceiling=nbytes / ceiling.bytes_per_s / (tc * 1e-6), bf16_loop_time_us=t_bf16,
                       speedup_vs_bf16=t_bf16 / tl, distinct_experts=distinct, nsets=nsets))
      print(rows[-1], flush=True)
    if t == ts[0]:  # the later T for the fastest few only (the bench's time)
      variants = sorted(variants, key=lambda v: loop_us[v[0]])[:TOP]
      print(f"T = {ts[1:]}: {[v[0] for v in variants]}", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  ap.add_argument("--variants", default="", help="comma-separated VARIANTS names to run (default: all)")
  ap.add_argument("--ts", default="6,1,17", help="comma-separated T values; the first for every variant, the "
                  f"later ones for the {TOP} fastest there")
  args = ap.parse_args()
  wanted = [n for n in args.variants.split(",") if n]
  unknown = [n for n in wanted if n not in [v[0] for v in VARIANTS]]
  if unknown:
    ap.error(f"--variants {unknown} not in {[v[0] for v in VARIANTS]}")
  variants = [v for v in VARIANTS if not wanted or v[0] in wanted]
  if jax.default_backend() != "gpu":
    raise SystemExit("bench.kernels_moe_fp8 times the Mosaic GPU kernel: run it on a GPU")
  ceiling = bk.hbm_ceiling()
  rows = [dict(name="hbm ceiling (start of run)", bw_bytes_per_s=ceiling.bytes_per_s)]
  try:
    bench(rows, jax.random.key(0), variants, ceiling, ts=tuple(int(t) for t in args.ts.split(",")))
  finally:  # what was measured before a failed check (at T = 1 or 17) is kept
    path = bk.write_result(args.out, "kernels-moe-fp8", rows, ceiling)
    print(f"\nwrote {path}\n{'name':52s} {'us':>8s} {'loop_us':>8s} {'MB':>7s} {'frac':>7s} {'vs bf16':>7s}")
    for r in rows[1:]:
      print(f"{r['name']:52s} {r['time_us']:8.1f} {r['loop_time_us']:8.1f} {r['bytes'] / 1e6:7.1f} "
            f"{r['fraction_of_ceiling']:7.2f} {r['speedup_vs_bf16']:7.2f}")


if __name__ == "__main__":
  sys.exit(main())
