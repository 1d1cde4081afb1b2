"""router_segments' programs, old vs new, and the v2 demo's MoE layer pass on the Triton MoE (models/ling-demo
dims: D 320, E 16 in 4 groups keep 2, top 4, I 64, shared expert 192) (issue 11).

  python3 -m bench.kernels_moe_router_tables --out $OUT    (GPU, ~1-2 min; kernels-moe-router-tables-<dev>-<date>.json)
  python3 -m bench.kernels_moe_router_tables --out $OUT --ling   (also Ling dims' router: D 2560, E 512, top 8)
  python3 -m bench.kernels_moe_router_tables --small       (CPU smoke: interpret mode, T = 6, 2 sets)

Router rows ("router ..."): route_segments alone (the demo's gate is one score tile: ONE launch; Ling's E = 512:
router_scores, then route_segments on its scores) at T = 1 (decode) and T = 6 (verify, with and without live rows,
i.e. the routing borrow), without and with the RMSNorm prologue (norm_weight: the demo only), for
RouterConfig.segments = "onehot" (the program of before: per pair column one-hot sums, its K loop pipelined,
num_warps 4) and "scatter" (router_segments._scatter_kernel) at segments_warps 1, 2, 4 (the demo without the
norm; the norm and Ling's scores run num_warps / slots_warps = 4). busy_us: the kernels' summed device time per
call (the figure of the 7.3 us a call issue 11 quotes), time_us: the profiler span per call of `nsets` calls back to
back (launch gaps included); median of 3 traced runs. equal_to_onehot: every output (ids, weights, order, seg,
tok, w_rows, xn) bitwise equal to the "onehot" program's, over every input set. row0_invariant: token 0's ids,
weights (and xn) equal the same program's on that token alone (T = 1, no live rows: token 0 is live), over every
set (the weights' normalising sum is one left-to-right chain in every program: router.normalised_weights).

Layer rows ("demo moe pass ..."): one call = residual + moe_layer(x) as the decode / verify step runs it (bf16,
the Pallas router, the Triton MoE): "before" = KernelCalls(moe_router_tables=False): router scores, router top-k,
the XLA alignment (sort, gathers, scatter-add, stack, copies), up, down, the shared expert's fusions; "tables" =
KernelCalls(): router_segments (scores, top-k and the tables in one launch), up, down, the shared expert's fusions;
"scatter" = KernelCalls(moe_router_scatter=True): the same with router_segments' "scatter" program. (On this tree
all write the down kernel's rows in pair order: the combine's scatter of main is gone from both; main vs this tree
is bench_step's step A/B.)

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
import dataclasses
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


LING = PRESETS["ling3-flash"]
# (name, RouterConfig fields) of the router rows; "onehot" first: the reference of equal_to_onehot
PROGRAMS = [("onehot", dict(segments="onehot"))] + [
    (f"scatter-w{w}", dict(segments="scatter", segments_warps=w)) for w in (1, 2, 4)]


def router_inputs(key, cfg, t, nsets, norm):
  """nsets (x [T, D] bf16 (the residual stream's scale with the norm), gate_w, expert_bias, norm weight)."""
  d, e = cfg.hidden_size, cfg.num_experts
  kg, kb, kw = jax.random.split(jax.random.fold_in(key, 7), 3)
  gate_w = (jax.random.normal(kg, (e, d), jnp.float32) * d ** -0.5).astype(BF)
  bias = jax.random.normal(kb, (e,), jnp.float32) * 0.05
  w = (1 + 0.2 * jax.random.normal(kw, (d,), jnp.float32)).astype(BF)
  xs = [((3.0 if norm else 1.0) * jax.random.normal(jax.random.fold_in(key, 1000 * t + j), (t, d), jnp.float32)
         ).astype(BF) for j in range(nsets)]
  return xs, (gate_w, bias, w)


def router_bench(rows, key, small=False, ling=False, nsets=32):
  """The router rows (see the module docstring)."""
  cases = [(CFG, "demo", t, live, norm) for t in ((6,) if small else (1, 6)) for live in ((False, True) if t > 1 else (False,))
           for norm in (False, True)]
  if ling and not small:
    cases += [(LING, "ling", t, live, False) for t in (1, 6) for live in ((False, True) if t > 1 else (False,))]
  for cfg, dims, t, live, norm in cases:
    xs, (gate_w, bias, w) = router_inputs(key, cfg, t, 2 if small else nsets, norm)
    live_rows = jnp.asarray([max(t - 2, 1)], jnp.int32) if live else None  # one sequence: its last rows borrow
    kw = dict(n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
              routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
              has_shared=False, rows_per_seq=t if live else 0)
    base = KernelCalls(interpret=small)._router_config(jax.ShapeDtypeStruct((t, cfg.hidden_size), BF),
                                                         cfg.num_experts, cfg)
    # segments_warps applies where the demo's program computes its scores without the norm
    programs = PROGRAMS if dims == "demo" and not norm else [PROGRAMS[0], ("scatter", PROGRAMS[1][1])]
    ref = None
    for name, fields in programs:
      rc = dataclasses.replace(base, **fields)
      label = f"router {dims} T={t}{' live' if live else ''}{' norm' if norm else ''} {name}"

      def fn(x, gate_w, bias, w, rc=rc):
        return RS.route_segments(x, gate_w, bias, live_rows, w if norm else None, eps=1e-6 if norm else None,
                                 config=rc, **kw)
      try:
        outs = [[np.asarray(v) for v in jax.jit(fn)(x, gate_w, bias, w) if v is not None] for x in xs]
        equal = None if ref is None else all(np.array_equal(a, b) for o, r in zip(outs, ref) for a, b in zip(o, r))
        ref = outs if ref is None else ref
        alone = [RS.route_segments(x[:1], gate_w, bias, None, w if norm else None, eps=1e-6 if norm else None,
                                   config=rc, **{**kw, "rows_per_seq": 0}) for x in xs]
        firsts = lambda r: [r.ids, r.weights] + ([r.xn] if norm else [])
        invariant = all(np.array_equal(np.asarray(a)[0], o[i][0]) for r, o in zip(alone, outs)
                        for i, a in zip((0, 1, 6), firsts(r)))
        detail = {}
        tk = bk.timeit(fn, [(x,) for x in xs], (gate_w, bias, w), detail=detail)
        rows.append(dict(name=label, time_us=tk, nsets=len(xs), config=str(rc), equal_to_onehot=equal,
                         row0_invariant=invariant, **detail))
        print(rows[-1], flush=True)
      except Exception as ex:  # one failing program must not cost the run
        print(f"FAILED {label}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)


def bench(rows, key, small=False, nsets=16, tokens=(1, 6)):
  p = params(key, CFG)
  d = CFG.hidden_size
  variants = [("before", KernelCalls(interpret=small, moe_router_tables=False)),
              ("tables", KernelCalls(interpret=small, moe_router_scatter=False)),
              ("scatter", KernelCalls(interpret=small, moe_router_scatter=True))]
  for t in ((6,) if small else tokens):
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
  ap.add_argument("--ling", action="store_true", help="also the router at Ling-3.0-flash dims (E 512: two launches)")
  ap.add_argument("--tokens", default="1,6", help="T of the layer rows (comma-separated)")
  ap.add_argument("--no-layer", dest="layer", action="store_false", help="the router rows only")
  args = ap.parse_args()
  ceiling = bk.hbm_ceiling()
  rows = [dict(name="hbm ceiling (start of run)", time_us=None, bytes=None, bw_bytes_per_s=ceiling.bytes_per_s)]
  try:  # SIGINT still writes what was measured
    router_bench(rows, jax.random.key(1), small=args.small, ling=args.ling)
    if args.layer:
      bench(rows, jax.random.key(0), small=args.small, tokens=tuple(int(v) for v in args.tokens.split(",")))
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  path = bk.write_result(args.out, "kernels-moe-router-tables", rows, ceiling, tree=args.tree)
  print(f"\nwrote {path}\n{'name':34s} {'busy us':>8s} {'span us':>8s} {'kern':>5s} equal_to_onehot row0_invariant")
  for r in rows[1:]:
    if r["name"].startswith("router"):
      print(f"{r['name']:34s} {r.get('busy_us') or 0:8.2f} {r['time_us']:8.2f} {r.get('kernels_per_call') or 0:5.1f} "
            f"{str(r['equal_to_onehot']):>15s} {r['row0_invariant']}")
  cols = ("route_equal", "tables_equal", "routed_equal", "routed_invariant", "equal_to_before", "layer_invariant")
  print(f"\n{'name':30s} {'us':>8s} {'kern':>5s} {'err':>8s} " + " ".join(cols))
  for r in rows[1:]:
    if not r["name"].startswith("router"):
      print(f"{r['name']:30s} {r['time_us']:8.1f} {r.get('kernels_per_call') or 0:5.1f} {r['rel_err']:8.1e} "
            + " ".join(f"{str(r[c]):>{len(c)}s}" for c in cols))


if __name__ == "__main__":
  main()
