"""The v2 demo's MoE layer pass on the Triton MoE (models/ling-demo dims: D 320, E 16 in 4 groups keep 2, top 4,
I 64, shared expert 192): the chain of before vs the tables built in the router's launch (issue 11).

  python3 -m bench.kernels_moe_router_tables --out $OUT    (GPU, ~1-2 min; kernels-moe-router-tables-<dev>-<date>.json)
  python3 -m bench.kernels_moe_router_tables --small       (CPU smoke: interpret mode, T = 6, 2 sets)

One call = residual + moe_layer(x) as the decode / verify step runs it (bf16, the Pallas router, the Triton MoE):
"before" = KernelCalls(moe_router_tables=False): router scores, router top-k, the XLA alignment (sort, gathers,
scatter-add, stack, copies), up, down, the shared expert's fusions; "tables" = KernelCalls(): router_segments
(scores, top-k and the tables in one launch), up, down, the shared expert's fusions. (On this tree both write the
down kernel's rows in pair order: the combine's scatter of main is gone from both; main vs this tree is
bench_step's step A/B.)

Checks before timing, over every input set: `route_equal` (route_segments' ids and weights bitwise vs
router.route's: the one-program top-k against the per-token kernel, on the GPU's Triton), `tables_equal` (vs the
XLA alignment moe._rows of those ids), `routed_equal` / `routed_invariant` (the routed experts alone, tables chain
vs before bitwise, row 0 alone = row 0 in the batch), `equal_to_before` (the layer's output bitwise),
`layer_invariant` (the same for the layer: its shared expert is XLA's dots, whose row results may change with T,
before and after alike), `rel_err` vs the model's jnp layer. Timing: bench_kernels.timeit (profiler span per
call of one program of `nsets` dependent calls), kernels_per_call from the same trace. The pass reads ~0.3 MB
(the floor is < 0.1 us): it is launch-bound, the kernel count is the figure.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_kernels as bk
from ling_jax.config import PRESETS
from ling_jax.kernel_calls import KernelCalls
from ling_jax.layers.moe import moe_layer
from pallas_kernels import moe as M
from pallas_kernels import router as R
from pallas_kernels import router_segments as RS

BF = jnp.bfloat16
CFG = PRESETS["ling-demo-v2"]
LIMITS = dict(routed_limit=4.0, shared_limit=5.0)
ROUTED = dict(limit=4.0, shared_limit=0.0)


def params(key, cfg):
  d, e, i, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
  k = jax.random.split(key, 8)
  nrm = lambda kk, s, fan: (jax.random.normal(kk, s, jnp.float32) * fan ** -0.5).astype(BF)
  return dict(gate_w=nrm(k[0], (e, d), d), expert_bias=jax.random.normal(k[1], (e,), jnp.float32) * 0.05,
              w_gate=nrm(k[2], (e, i, d), d), w_up=nrm(k[3], (e, i, d), d), w_down=nrm(k[4], (e, d, i), i),
              shared=dict(gate_proj=nrm(k[5], (si, d), d), up_proj=nrm(k[6], (si, d), d),
                          down_proj=nrm(k[7], (d, si), si)))


def route_checks(p, xs, rc):
  """(route_equal, tables_equal) over the sets: route_segments vs router.route + moe._rows, bitwise."""
  kw = dict(n_group=CFG.n_group, topk_group=CFG.topk_group, top_k=CFG.num_experts_per_tok,
            routed_scaling_factor=CFG.routed_scaling_factor, norm_topk_prob=CFG.norm_topk_prob, config=rc)
  route_eq = tables_eq = True
  for x in xs:
    r = RS.route_segments(x, p["gate_w"], p["expert_bias"], has_shared=False, **kw)
    ids, w = R.route(x, p["gate_w"], p["expert_bias"], **kw)
    route_eq &= bool(np.array_equal(r.ids, ids) and np.array_equal(r.weights, w))
    tables_eq &= all(np.array_equal(a, b) for a, b in zip(r[2:], M._rows(r.ids, r.weights, M.MoeConfig(), False)))
  return route_eq, tables_eq


def routed_checks(p, xs, tables, before):
  """(routed_equal, routed_invariant): the routed experts alone (no shared expert: its XLA dots are not
  row-invariant across T) through the tables chain vs the chain of before, bitwise, and row 0 alone = in the
  batch."""
  experts = (p["w_gate"], p["w_up"], p["w_down"])
  new = jax.jit(lambda x: tables.routed_moe(x, p["gate_w"], p["expert_bias"], CFG, experts, None, **ROUTED)[0])

  def old(x):
    ids, w = before.route(x, p["gate_w"], p["expert_bias"], CFG)
    return before.moe(x, ids, w, *experts, shared=None, **ROUTED)

  old = jax.jit(old)
  equal = all(np.array_equal(new(x), old(x)) for x in xs)
  return equal, bool(np.array_equal(new(xs[0][:1]), new(xs[0])[:1]))


def bench(rows, key, small=False, nsets=16):
  p = params(key, CFG)
  d = CFG.hidden_size
  variants = [("before", KernelCalls(interpret=small, moe_router_tables=False)),
              ("tables", KernelCalls(interpret=small))]
  for t in ((6,) if small else (1, 6, 17)):
    sets = []
    for j in range(2 if small else nsets):
      kx, kr = jax.random.split(jax.random.fold_in(key, 100 * t + j))
      sets.append((jax.random.normal(kx, (1, t, d), jnp.float32).astype(BF),
                   jax.random.normal(kr, (1, t, d), jnp.float32).astype(BF)))
    rc = variants[1][1]._router_config(sets[0][0][0], CFG.num_experts, CFG)
    route_eq, tables_eq = route_checks(p, [s[0][0] for s in sets], rc)
    routed_eq, routed_inv = routed_checks(p, [s[0][0] for s in sets], variants[1][1], variants[0][1])
    ref = moe_layer(p, sets[0][0], CFG, router_fp32=False, kernels=None, **LIMITS) + sets[0][1]
    outs = {}
    for name, kc in variants:
      fn = lambda x, res, p, kc=kc: res + moe_layer(p, x, CFG, router_fp32=False, kernels=kc, **LIMITS)
      try:
        outs[name] = [np.asarray(jax.jit(fn)(*s, p), np.float32) for s in sets]
        alone = np.asarray(jax.jit(fn)(sets[0][0][:, :1], sets[0][1][:, :1], p), np.float32)
        detail = {}
        tk = bk.timeit(fn, sets, (p,), chain=lambda prev, s: (s[0], prev), detail=detail)
        before = outs.get("before")
        rows.append(dict(
            name=f"demo moe pass T={t} {name}", time_us=tk, rel_err=bk.rel(outs[name][0], ref), nsets=len(sets),
            route_equal=route_eq, tables_equal=tables_eq, routed_equal=routed_eq, routed_invariant=routed_inv,
            equal_to_before=None if name == "before" else all(map(np.array_equal, before, outs[name])),
            layer_invariant=bool(np.array_equal(alone, outs[name][0][:, :1])), **detail))
        print(rows[-1], flush=True)
      except Exception as ex:  # one failing variant must not cost the run
        print(f"FAILED T={t} {name}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
  ap.add_argument("--small", action="store_true", help="CPU smoke test: interpret mode")
  ap.add_argument("--tree", default=None, help="the commit benched (recorded as the JSON's tree)")
  args = ap.parse_args()
  ceiling = bk.hbm_ceiling()
  rows = [dict(name="hbm ceiling (start of run)", time_us=None, bytes=None, bw_bytes_per_s=ceiling.bytes_per_s)]
  try:  # SIGINT still writes what was measured
    bench(rows, jax.random.key(0), small=args.small)
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  path = bk.write_result(args.out, "kernels-moe-router-tables", rows, ceiling, tree=args.tree)
  cols = ("route_equal", "tables_equal", "routed_equal", "routed_invariant", "equal_to_before", "layer_invariant")
  print(f"\nwrote {path}\n{'name':30s} {'us':>8s} {'kern':>5s} {'err':>8s} " + " ".join(cols))
  for r in rows[1:]:
    print(f"{r['name']:30s} {r['time_us']:8.1f} {r.get('kernels_per_call') or 0:5.1f} {r['rel_err']:8.1e} "
          + " ".join(f"{str(r[c]):>{len(c)}s}" for c in cols))


if __name__ == "__main__":
  main()
