"""GPU bench: live-prefix MLA attention at Ling-3.0-flash dims vs XLA's path.

  python3 -m bench.kernels_head_mla --out $OUT       (GPU; writes kernels-head-mla-<device>-<date>.json)

Checks first (a mismatch raises): the attention path q_lat = q_nope W_uk -> mla_attention -> W_uv equals the
model's attend_absorbed (<= 1e-2 rel); a row alone vs in the batch (bit-identical, reported). Then times, cold
inputs (bench_kernels.timeit: profiler span of one program over the input sets): attention at T = 1, 6, 17 for
live = 1024 and 8192 with S = 8192 + 64, 12 caches (114 MB) rotated, against attend_absorbed over all S slots.
Fractions are of CEILING = 4.3 TB/s on the bytes each path must move. (The file name keeps the lm_head + argmax
kernel it also timed until that kernel was deleted: kernels-head-mla-h200-2026-12-01.json has its rows.)
"""
from __future__ import annotations

import argparse, os

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from ling_jax.config import get_preset
from ling_jax.layers.mla import attend_absorbed
from pallas_kernels.mla_attention import MlaAttentionConfig, mla_attention

BF, F32 = jnp.bfloat16, jnp.float32
CEILING = 4.3e12
CFG = get_preset("ling3-flash")
H, LR, R, P, VH = (CFG.num_attention_heads, CFG.kv_lora_rank, CFG.qk_rope_head_dim, CFG.qk_nope_head_dim,
                   CFG.v_head_dim)
S = 8192 + 64
T_ATT, LIVES, SWEEP_LIVE = (1, 6, 17), (1024, 8192), 8192   # all ATT_CONFIGS at SWEEP_LIVE
SCALE = CFG.qk_head_dim ** -0.5
ATT_CONFIGS = [("s64sb8l128", MlaAttentionConfig()),        # the others only at SWEEP_LIVE, ctx only
               ("s32sb16l128st3", MlaAttentionConfig(block_s=32, split_blocks=16, stages=3)),
               ("s64sb4l128", MlaAttentionConfig(split_blocks=4))]


def row(rows, name, t_us, nbytes, **kw):
  floor = 1e6 * nbytes / CEILING
  rows.append(dict(name=name, time_us=t_us, bytes=nbytes, floor_us=floor, fraction_of_floor=floor / t_us,
                   **kw))
  print(f"{name:58s} {t_us:9.1f} us {nbytes / 1e6:8.2f} MB {floor / t_us:6.2f} of 4.3 TB/s", flush=True)


def attention_sets(key, t, live, n=12):
  pos = jnp.arange(live - t, live, dtype=jnp.int32)[None]
  out = []
  for j in range(n):
    k = jax.random.split(jax.random.fold_in(key, 1000 * t + j), 3)
    out.append((jax.random.normal(k[0], (1, t, H, P), F32).astype(BF),
                jax.random.normal(k[1], (1, t, H, R), F32).astype(BF),
                jax.random.normal(k[2], (1, S, LR + R), F32).astype(BF), pos))
  return out


def bench_attention(rows, key):
  p = {"kv_b_proj": (jax.random.normal(key, (H * (P + VH), LR), F32) * LR ** -0.5).astype(BF)}
  w_uk, w_uv = (a for a in jnp.split(p["kv_b_proj"].reshape(H, P + VH, LR), [P], axis=1))
  xla = jax.jit(lambda qn, qr, c, pos, p: attend_absorbed(p, qn, qr, c, pos, CFG))
  for t in T_ATT:
    for live in LIVES:
      sets = attention_sets(jax.random.fold_in(key, live), t, live)
      ref = xla(*sets[0], p)
      proj_bytes = 2 * H * P * LR * 2 + t * H * (P + R + VH) * 2
      t_xla = bk.timeit(xla, sets, (p,))
      row(rows, f"mla T={t} live={live} XLA attend_absorbed (all {S} slots)", t_xla, S * 576 * 2 + proj_bytes,
          baseline="-", baseline_time_us=None)
      for name, cfg in ATT_CONFIGS if live == SWEEP_LIVE else ATT_CONFIGS[:1]:
        ctx_fn = lambda ql, qr, c, pos, cfg=cfg: mla_attention(ql, qr, c, pos, scale=SCALE, config=cfg)
        path = jax.jit(lambda qn, qr, c, pos, wk, wv, ctx_fn=ctx_fn: jnp.einsum(
            "bthl,hvl->bthv", ctx_fn(jnp.einsum("bthp,hpl->bthl", qn, wk), qr, c, pos), wv,
            preferred_element_type=F32))
        err = bk.rel(path(*sets[0], w_uk, w_uv), ref)
        if not err <= 1e-2:
          raise AssertionError(f"mla {name} T={t} live={live}: rel err {err:.2e} vs attend_absorbed")
        lat_sets = [(jnp.einsum("bthp,hpl->bthl", s[0], w_uk),) + s[1:] for s in sets]
        kernel = jax.jit(ctx_fn)
        ctx = kernel(*lat_sets[0])
        alone = kernel(*(a if a.ndim == 3 else a[:, -1:] for a in lat_sets[0]))   # last row alone
        inv = bool(np.array_equal(np.asarray(alone[0, 0], F32), np.asarray(ctx[0, -1], F32)))
        mp, n_live = -(-t * H // 64) * 64, -(-live // cfg.split)
        blocks = -(-live // cfg.block_s) * cfg.block_s
        partial_bytes = 2 * n_live * mp * (LR + 2) * 4
        must = blocks * (LR + R) * 2 + t * H * (2 * LR + R) * 2
        row(rows, f"mla T={t} live={live} mosaic {name} (ctx only)", bk.timeit(kernel, lat_sets), must,
            partial_bytes=partial_bytes, baseline="-", baseline_time_us=None, batch_invariant=inv,
            config=str(cfg))
        if cfg != ATT_CONFIGS[0][1]:
          continue
        row(rows, f"mla T={t} live={live} W_uk + mosaic {name} + W_uv", bk.timeit(path, sets, (w_uk, w_uv)),
            must + proj_bytes, baseline=f"XLA attend_absorbed over all {S} slots (same run)",
            baseline_time_us=t_xla, rel_err=err, config=str(cfg))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  args = ap.parse_args()
  rows = [dict(name="ceiling", time_us=None, bytes=None, bw_bytes_per_s=CEILING)]
  key = jax.random.key(0)
  try:  # SIGINT still writes what was measured; a check mismatch propagates (fails loudly)
    bench_attention(rows, jax.random.fold_in(key, 2))
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  print(f"wrote {bk.write_result(args.out, 'kernels-head-mla', rows, bk.hbm_ceiling())}")


if __name__ == "__main__":
  main()
