"""The one-kernel KDA chain vs today's path, per KDA layer at Ling-3.0-flash dims (B=1, H=32, K=V=128), cold states.

  python3 -m bench.kernels_kda_chain --out $OUT      (GPU, < 3 min; writes kernels-kda-chain-<dev>-<date>.json)
  python3 -m bench.kernels_kda_chain --small         (CPU smoke test: tiny dims, interpret mode, no timing)

Rows per T in (1, 6, 17), each a NEXTN step of one layer up to o_proj's output (o_proj included everywhere):
  today          kda_verify (Triton) + kda_output (XLA) + kda_commit (Triton, window slide in it)  3|S|
  chain+commit   kda_chain (epilogue fused) + o_proj + kda_commit (window slide in it)             3|S|
  chain folded   kda_chain(pending of Tp = T rows, n_prev = max(1, T-2)) + o_proj                  2|S|
  chain advance  (T = 1) kda_chain(advance=True) + o_proj: the plain decode step                    2|S|
Every row is first checked against the model's jnp layer (ling_jax.layers.kda, bf16); a mismatch exits 1.
Timing (bench/kernels_kda.py's profiler method): 24 calls over distinct input sets (24 x 2.1 MB states > L2), states
and windows donated (no copy before the in-place kernels); us = device span per call, kern_us = the kda_chain
kernel's own median duration, kernels = kernels per call (per layer step).
"""
from __future__ import annotations

import argparse, sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_kernels import hbm_ceiling, rel, write_result
from bench.kernels_kda import nbytes, profile, stats
from ling_jax.config import ModelConfig
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers import kda as M
from pallas_kernels.kda_chain import KdaChainConfig, kda_chain

BF, F32, W, TOL = jnp.bfloat16, jnp.float32, 4, 2e-2


def make(key, cfg, t, n_sets):
  """Layer weights p and n_sets of (x, proj, b_raw, window, state, pending of a previous T-row verify, n_prev)."""
  h, k, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
  c = h * k
  ks = iter(jax.random.split(key, 8 + 4 * n_sets))
  nrm = lambda s, sc=1.0, dt=BF: (jax.random.normal(next(ks), s, F32) * sc).astype(dt)
  p = dict(w_qkvfg=nrm((5, c, d), d ** -0.5), conv_w=nrm((3, c, 1, W), 0.5), b_proj=nrm((h, d), d ** -0.5),
           A_log=nrm((h,), 0.5, F32), dt_bias=nrm((c,), 0.5, F32), o_norm=nrm((k,), 0.1) + 1,
           o_proj=nrm((d, c), c ** -0.5))
  sets = []
  for _ in range(n_sets):
    x, x_prev = nrm((1, t, d)), nrm((1, t, d))
    window, state = nrm((1, W - 1, 3, c)), nrm((1, h, k, k), 0.1, F32)
    args, proj = M._kernel_inputs(p, x, window, state)
    _, _, _, pending = M.kda_layer(p, x_prev, window, state, cfg, mode="verify", n_valid=None, chunked=False)
    sets.append(dict(x=x, proj=proj, b_raw=args[4], window=window, state=state, pending=pending,
                     n=jnp.array([max(1, t - 2)], jnp.int32)))
  return p, sets


def step_fns(p, cfg, chain_cfg):
  """name -> fn(set, window, state) -> (out [1, T, D], window, state): one layer's step, o_proj included."""
  lb, eps, calls = cfg.kda_lower_bound, cfg.rms_norm_eps, KernelCalls(interpret=chain_cfg.interpret)
  o_proj = lambda o: jnp.einsum("btc,dc->btd", o, p["o_proj"])
  chain = lambda s, win, st, **kw: kda_chain(s["proj"], s["b_raw"], p["A_log"], p["dt_bias"], p["conv_w"],
                                             p["o_norm"], win, st, lower_bound=lb, eps=eps, config=chain_cfg, **kw)

  def commit(win, st, pending, n):  # the model's commit (one kernel, window included) on stacks of one layer
    win, st = M.kda_commit_layers(win[None], st[None], pending, n, calls)
    return win[0], st[0]

  def today(s, win, st):
    pr = s["proj"]
    o, rows = calls.kda_verify(pr, s["b_raw"], p["A_log"], p["dt_bias"], p["conv_w"], win[None], st[None], 0,
                               lower_bound=lb)
    out = M.kda_output(p, o, pr[:, :, 4], cfg, BF)
    return (out,) + commit(win, st, M.KdaPending(*rows), s["n"])

  def chain_commit(s, win, st):
    r = chain(s, win, st)
    pending = jax.tree.map(lambda a: a[None], M.KdaPending(s["proj"][:, :, :3], *r.commit))
    return (o_proj(r.o),) + commit(win, st, pending, s["n"])

  def folded(s, win, st):
    r = chain(s, win, st, pending=s["pending"], n_prev=s["n"])
    return o_proj(r.o), r.conv_window, r.rec_state

  def advance(s, win, st):
    r = chain(s, win, st, advance=True)
    return o_proj(r.o), r.conv_window, r.rec_state
  return dict(today=today, chain_commit=chain_commit, folded=folded, advance=advance)


def model_ref(p, cfg, s, name):
  """The model's jnp layer (bf16) for set s: (out, window, state) of the same step."""
  layer = lambda x, win, st, mode: M.kda_layer(p, x, win, st, cfg, mode=mode, chunked=False,
                                               n_valid=jnp.ones((1,), jnp.int32))
  if name == "advance":
    return layer(s["x"], s["window"], s["state"], "decode")[:3]
  if name == "folded":
    win, st = M.kda_commit(s["window"], s["state"], s["pending"], s["n"])
    return layer(s["x"], win, st, "verify")[0], win, st
  out, _, _, pending = layer(s["x"], s["window"], s["state"], "verify")
  return (out,) + M.kda_commit(s["window"], s["state"], pending, s["n"])


def program(fn):
  def prog(carry, sets):
    return [fn(s, win, st) for (win, st), s in zip(carry, sets)]
  return jax.jit(prog, donate_argnums=0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--small", action="store_true", help="CPU smoke test: H=2, K=32, interpret mode")
  ap.add_argument("--ts", default="1,6,17")
  ap.add_argument("--warps", default="8", help="kda_chain num_warps to compare, e.g. 8,16")
  a = ap.parse_args()
  cfg = (ModelConfig(hidden_size=96, num_attention_heads=2, head_dim=32, qk_rope_head_dim=16) if a.small
         else ModelConfig())
  ceiling = hbm_ceiling()
  n_sets, bw = (2, 4.3e12) if a.small else (24, ceiling.bytes_per_s)
  print(f"HBM copy bandwidth {bw / 1e12:.2f} TB/s (floors below)", flush=True)
  rows, failed = [], []
  for t in (int(x) for x in a.ts.split(",")):
    p, sets = make(jax.random.key(t), cfg, t, n_sets)
    s_bytes, rows_bytes = nbytes(sets[0]["state"]), nbytes((sets[0]["proj"], sets[0]["b_raw"]))
    jobs = [("today", None)] + [(nm, w) for w in map(int, a.warps.split(",")) for nm in
                                ("chain_commit", "folded") + (("advance",) if t == 1 else ())]
    progs, meta = [], []
    for name, warps in jobs:
      chain_cfg = KdaChainConfig(num_warps=warps or 8, interpret=a.small)
      fn = step_fns(p, cfg, chain_cfg)[name]
      got, want = fn(sets[0], sets[0]["window"], sets[0]["state"]), model_ref(p, cfg, sets[0], name)
      errs = [rel(g, w) for g, w in zip(got, want)]
      label = f"T={t} {name}" + (f" w{warps}" if warps else "")
      if max(errs) > TOL or not np.all(np.isfinite(np.asarray(got[0], F32))):
        failed.append(f"{label}: rel err (out, window, state) {errs} > {TOL}")
      two_pass = name in ("folded", "advance")                       # state read + written once
      n_state, pend = (2, sets[0]["pending"] if name == "folded" else ()) if two_pass else (3, ())
      row = dict(name=label, T=t, bytes=n_state * s_bytes + rows_bytes + nbytes((pend, p["o_proj"])), rel_err=errs,
                 state_passes=n_state, config=str(chain_cfg) if warps else "kda_verify/kda_commit defaults")
      fresh = lambda: ([(jnp.copy(s["window"]), jnp.copy(s["state"])) for s in sets], sets)
      progs.append((program(fn), fresh))
      meta.append(row)
    runs = profile(progs, a.small)
    for row, r in zip(meta, runs):
      row.update(stats(r, None if row["name"].endswith("today") else "kda_chain", n_sets))
      row["floor_us"] = 1e6 * row["bytes"] / bw
      f = lambda x: "-" if x is None else f"{x:.2f}"
      print(f"{row['name']:24s} us {f(row.get('chained_us')):>7s}  kern_us {f(row.get('time_us')):>7s}  "
            f"kernels {f(row.get('kernels_per_call')):>5s}  floor {row['floor_us']:.2f} us "
            f"({row['state_passes']}|S| + rows + o_proj)  err {max(row['rel_err']):.1e}", flush=True)
      rows.append(row)
  print("wrote", write_result(a.out, "kernels-kda-chain", rows, ceiling), flush=True)
  if failed:
    sys.exit("CHECK FAILED:\n" + "\n".join(failed))


if __name__ == "__main__":
  main()
