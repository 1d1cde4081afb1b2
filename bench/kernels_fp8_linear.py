"""XLA on block-fp8 projection weights (the KDA / MLA / dense-MLP linears of Ling-3.0-flash), no Pallas: which jnp
form XLA compiles to the fewest bytes and the least time, against the bf16 weight, from the same run.

  python3 -m bench.kernels_fp8_linear --out $OUT        (GPU, ~1 min; writes kernels-fp8-linear-<device>-<date>.json)

Forms of y [T, N] = x [T, K] W^T, W = W8 * s (quant.py; 128 x 128 blocks):
  bf16      x @ W with W stored in bf16 (the baseline: 2 B per weight)
  dequant   x @ quant.dense(W): the model's form today (dequantise to bf16, then the dot; XLA may or may not fuse
            the dequantisation into the dot's operand: the kernel count and XLA's "bytes accessed" say which)
  block     y[t, n] = sum_j s[n / 128, j] (x[t, jB:(j+1)B] . bf16(W8[n, jB:(j+1)B])): the fp8 -> bf16 convert is
            exact and elementwise on the dot's operand; the scale multiplies the [T, N, nK] partial sums in f32
Check first: each form against the f32 product on the dequantised weights (rel err <= 1e-2), else exit 1. Then
per (shape, T): 8 weight sets (cold: their bytes exceed the 60 MB L2), bench_kernels.timeit chained calls.
bytes = weight bytes of the form's storage (fp8 + scales, or bf16) + x + y; fraction = bytes / ceiling / time.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from ling_jax import quant

BF, F32 = jnp.bfloat16, jnp.float32
SHAPES = {  # name: (N, K) of the Ling-3.0-flash weight
    "kda w_qkvfg": (5 * 4096, 2560), "kda o_proj": (2560, 4096), "mla q_proj": (6144, 2560),
    "mla kv_a_proj": (576, 2560), "mla kv_b_proj": (8192, 512), "dense gate_proj": (6144, 2560),
    "dense down_proj": (2560, 6144),
}


def form_bf16(x, w, s):
    return jnp.einsum("tk,nk->tn", x, w, preferred_element_type=F32).astype(BF)


def form_dequant(x, w8, s):
    return jnp.einsum("tk,nk->tn", x, quant.dense(quant.Fp8Weight(w8, s), BF), preferred_element_type=F32).astype(BF)


def form_block(x, w8, s):
    (T, K), N = x.shape, w8.shape[0]
    xb, wb = x.reshape(T, K // quant.BLOCK, quant.BLOCK), w8.reshape(N, K // quant.BLOCK, quant.BLOCK).astype(BF)
    partial = jnp.einsum("tjk,njk->tnj", xb, wb, preferred_element_type=F32)  # [T, N, nK]
    rows = jnp.repeat(s, quant.BLOCK, axis=0)[:N]  # [N, nK]: each row's block scales
    return jnp.einsum("tnj,nj->tn", partial, rows).astype(BF)


FORMS = {"bf16": form_bf16, "dequant": form_dequant, "block": form_block}


def weight_sets(key, n, k, count):
    q = jax.jit(lambda kk: quant.quantize(jax.random.normal(kk, (n, k), F32) * k**-0.5))
    out = []
    for j in range(count):
        w = q(jax.random.fold_in(key, j))
        out.append((w.w8, w.scale_inv, quant.dequantize(w, BF)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", default="1,6")
    ap.add_argument("--sets", type=int, default=8)
    a = ap.parse_args()
    ceiling = bk.hbm_ceiling()
    rows, failed = [], []
    for name, (n, k) in SHAPES.items():
        ws = weight_sets(jax.random.key(0), n, k, a.sets)
        for t in map(int, a.tokens.split(",")):
            xs = [jax.random.normal(jax.random.key(100 + j), (t, k), BF) for j in range(a.sets)]
            ref = np.asarray(jnp.einsum("tk,nk->tn", xs[0].astype(F32), ws[0][2].astype(F32)))
            for form, fn in FORMS.items():
                w_of = (lambda w: (w[2], w[1])) if form == "bf16" else (lambda w: (w[0], w[1]))
                err = bk.rel(jax.jit(fn)(xs[0], *w_of(ws[0])), ref)
                if err > 1e-2:
                    failed.append(f"{name} T={t} {form}: rel err {err:.2e}")
                sets = [(x, *w_of(w)) for x, w in zip(xs, ws)]
                detail: dict = {}
                us = bk.timeit(fn, sets, chain=lambda prev, s: (s[0] + 0 * prev[:, :1].astype(BF),) + s[1:],
                               detail=detail)
                cost = jax.jit(fn).lower(*sets[0]).compile().cost_analysis()
                cost = cost[0] if isinstance(cost, list) else cost
                wbytes = n * k * 2 if form == "bf16" else n * k + quant.nbytes(ws[0][1])
                nbytes = wbytes + 2 * t * (n + k)
                rows.append({"name": f"{name} [{n}x{k}] T={t} {form}", "shape": [n, k], "T": t, "form": form,
                             "time_us": us, "bytes": nbytes, "rel_err": err,
                             "xla_bytes_accessed": float((cost or {}).get("bytes accessed", -1)), **detail})
                print(f"{name:16s} [{n:5d}x{k:4d}] T={t:2d} {form:8s} {us:8.2f} us  {nbytes / us / 1e6:7.0f} GB/s  "
                      f"XLA bytes {rows[-1]['xla_bytes_accessed'] / nbytes:5.2f}x  kernels/call "
                      f"{detail.get('kernels_per_call', '?')}  err {err:.1e}", flush=True)
    print("wrote", bk.write_result(a.out, "kernels-fp8-linear", rows, ceiling))
    if failed:
        print("CHECK FAILED:\n  " + "\n  ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
