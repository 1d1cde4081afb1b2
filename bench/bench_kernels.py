"""Kernel bench at Ling-3.0-flash dims, cold weights: MoE and KDA verify/commit vs XLA.

  python3 bench/bench_kernels.py --out $OUT    (on the GPU; writes kernels-h200-<date>.json)

Timing: one jitted program runs the op over N distinct input sets back to back; time(2N) -
time(N) over N removes the fixed host/sync overhead (median of repeats). Input sets rotate
through > 60 MB (L2) of weights/states. Floor = bytes that must move / measured HBM copy
bandwidth (read + write of a large device-to-device copy, same run).
"""
from __future__ import annotations

import argparse, datetime, json, os, subprocess, sys, time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ceiling import Ceiling, device_kernel_runs  # noqa: E402
from bench.ceiling import apply as apply_ceiling  # noqa: E402
from pallas_kernels import kda_verify as kda  # noqa: E402
from pallas_kernels import moe as moe_mod  # noqa: E402
from tests import kernel_oracles as oracles  # noqa: E402

D, E, I, A = 2560, 512, 768, 8          # hidden, experts, expert width, top-k
H, DK, W = 32, 128, 4                    # KDA heads, head dim, conv width
BF, F32 = jnp.bfloat16, jnp.float32


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _median_time(f, *a, reps=10):
  jax.block_until_ready(f(*a))
  t = []
  for _ in range(reps):
    t0 = time.perf_counter(); jax.block_until_ready(f(*a)); t.append(time.perf_counter() - t0)
  return float(np.median(t))


def timeit(fn, sets, consts=(), chain=None, detail=None):
  """Per-call device latency (us) of fn(*set, *consts).

  One jitted program runs the calls back to back over the input sets (cold data); `chain(prev_out, set)`
  makes call j+1 depend on call j (latency, not overlapped throughput). On a GPU the time is the device span
  of the program's kernels in a profiler trace (first kernel start to last kernel end, launch gaps inside the
  program included, host dispatch excluded) over the number of calls, median of 3 traced runs. Without a trace
  (CPU) it falls back to wall time: time(n sets) - time(n/2 sets) over n/2, minus the per-set argument cost.
  detail: a dict that receives busy_us (summed kernel time per call) and kernels_per_call. A chained program
  returns its last output only: it depends on every call, and keeping each call's output alive would force a copy
  of the buffers the next call updates in place (KDA's rows, states).
  """
  def prog(ss, cs):
    outs, prev = [], None
    for s in ss:
      s = s if (chain is None or prev is None) else chain(prev, s)
      prev = fn(*s, *cs)
      outs.append(prev)
    return outs if chain is None else prev
  many = jax.jit(prog)
  jax.block_until_ready(many(sets, consts))                     # compile + warm
  runs = device_kernel_runs(lambda: many(sets, consts)) if jax.default_backend() == "gpu" else None
  n = len(sets)
  if runs:
    span = float(np.median([(max(t + d for t, d in r) - min(t for t, _ in r)) / n for r in runs]))
    if detail is not None:
      detail.update(busy_us=float(np.median([sum(d for _, d in r) / n for r in runs])),
                    kernels_per_call=len(runs[0]) / n, timing="profiler span / call")
    return span
  null = jax.jit(lambda ss, cs: [s[-1] for s in ss])
  half = sets[: n // 2]
  per = lambda f: (_median_time(f, sets, consts) - _median_time(f, half, consts)) / (n - len(half))
  if detail is not None:
    detail.update(timing="wall difference")
  return 1e6 * (per(many) - per(null))


def git_head() -> str:
  """`git rev-parse HEAD` of the working directory, or "unknown" (no git). On the device copy it may be stale
  (its git metadata is not the tree's): benches take --tree for the tree they run and record both."""
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
  except OSError:  # no git binary
    return "unknown"


def tree_of(given: str | None) -> str:
  """The tree a result was measured on: --tree when given, else git HEAD (marked as such: it may be stale)."""
  return given or f"git HEAD {git_head()} (no --tree given)"


def write_result(out_dir: str, prefix: str, rows, ceiling, tree: str | None = None) -> str:
  """bench/results-style JSON (command, device, jax version, date, git commit, the tree (tree_of), the ceiling,
  rows) as <out_dir>/<prefix>-<device>-<date>.json; every row's floor and fraction are recomputed at the one
  ceiling (bench/ceiling.py: the run's best of streaming read, XLA copy and its fastest kernel). Returns the
  path; written again after each row by benches that keep partial results."""
  apply_ceiling(rows, ceiling)
  date = datetime.date.today().isoformat()
  dev = str(jax.devices()[0].device_kind)
  res = dict(command=" ".join(sys.argv), device=dev, jax_version=jax.__version__, date=date,
             git_commit=git_head(), tree=tree_of(tree), **ceiling.summary(), rows=rows)
  os.makedirs(out_dir, exist_ok=True)
  tag = "h200" if "H200" in dev else dev.lower().replace(" ", "-")
  path = os.path.join(out_dir, f"{prefix}-{tag}-{date}.json")
  with open(path, "w") as f:
    json.dump(res, f, indent=1, default=str)
  return path


def hbm_ceiling() -> Ceiling:
  """The run's starting ceiling (streaming read and XLA copy over 4 GiB; its kernels may raise it)."""
  return Ceiling.measure(jax.devices()[0])


def moe_ragged(x, ids, w, wg_t, wu_t, wd_t):
  """XLA baseline: sort pairs, lax.ragged_dot over all experts (weights pre-transposed)."""
  t = x.shape[0]
  order = jnp.argsort(ids.reshape(-1))
  xs = x[order // A]
  sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
  g = lax.ragged_dot(xs, wg_t, sizes, preferred_element_type=F32)
  u = lax.ragged_dot(xs, wu_t, sizes, preferred_element_type=F32)
  h = (jax.nn.silu(g) * u).astype(x.dtype)
  y = lax.ragged_dot(h, wd_t, sizes, preferred_element_type=F32) * w.reshape(-1)[order][:, None]
  return jnp.zeros((t, D), F32).at[order // A].add(y).astype(x.dtype)


def bench_moe(rows, bw, key, configs):
  k = jax.random.split(key, 8)
  wg = jax.random.normal(k[0], (E, I, D), BF) * 0.02
  wu = jax.random.normal(k[1], (E, I, D), BF) * 0.02
  wd = jax.random.normal(k[2], (E, D, I), BF) * 0.02
  sh = tuple(jax.random.normal(k[3 + j], s, BF) * 0.02 for j, s in enumerate(((I, D), (I, D), (D, I))))
  ebytes = 3 * I * D * 2
  for t in (1, 6, 17):
    sets = []
    for j in range(8):
      kk = jax.random.split(jax.random.fold_in(key, 100 * t + j), 3)
      ids = jnp.argsort(jax.random.uniform(kk[0], (t, E)), axis=1)[:, :A].astype(jnp.int32)
      w = jax.random.uniform(kk[1], (t, A), F32)
      sets.append((jax.random.normal(kk[2], (t, D), BF), ids, w))
    distinct = np.mean([len(np.unique(np.asarray(s[1]))) for s in sets])
    nbytes = (distinct + 1) * ebytes + 2 * t * D * 2
    floor = 1e6 * nbytes / bw
    x, ids, w = sets[0]
    ref = oracles.moe(x, ids, w, wg, wu, wd, limit=4.0, shared=sh, shared_limit=5.0)
    cs = (wg, wu, wd, sh)
    base = lambda x, i, w, wg, wu, wd, sh: oracles.moe(
        x, i, w, wg, wu, wd, limit=4.0, shared=sh, shared_limit=5.0)
    t_base = timeit(base, sets, cs, chain=lambda prev, s: (prev,) + s[1:])
    for name, cfg in configs:
     try:
      f = lambda x, i, w, wg, wu, wd, sh, cfg=cfg: moe_mod.moe(
          x, i, w, wg, wu, wd, limit=4.0, shared=sh, shared_limit=5.0, config=cfg)
      err = rel(f(x, ids, w, *cs), ref)
      tk = timeit(f, sets, cs, chain=lambda prev, s: (prev,) + s[1:])
      rows.append(dict(name=f"moe T={t} {name}", time_us=tk, bytes=nbytes, floor_us=floor,
                       fraction_of_floor=floor / tk, baseline="model moe_experts (XLA gather)",
                       baseline_time_us=t_base, rel_err=err, distinct_experts=distinct,
                       config=str(cfg)))
      print(rows[-1], flush=True)
     except Exception as ex:  # report and go on: one bad config must not cost the run
      print(f"FAILED moe T={t} {name}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
    if t == 6:
      wg_t, wu_t, wd_t = (jnp.swapaxes(a, 1, 2) for a in (wg, wu, wd))
      tr = timeit(moe_ragged, sets[:4], (wg_t, wu_t, wd_t), chain=lambda prev, s: (prev,) + s[1:])
      rows.append(dict(name=f"moe T={t} XLA lax.ragged_dot (all experts; no shared/clamp)", time_us=tr,
                       bytes=nbytes, floor_us=floor, fraction_of_floor=floor / tr,
                       baseline="-", baseline_time_us=None))
      print(rows[-1], flush=True)
      del wg_t, wu_t, wd_t


def bench_kda(rows, bw, key, configs):
  """KDA verify / commit in the model's layouts: the fused projection [1, T, 5, C], conv_w whole, the states as
  stacks of one layer. Verify calls chain through the rows they write in place (the model's pattern), commit calls
  through the state and window they advance in place."""
  hd = H * DK
  nsets = 32                                  # 32 x 2 MB states > L2
  for t in (1, 6, 17):
    sets = []
    for j in range(nsets):
      kk = iter(jax.random.split(jax.random.fold_in(key, 1000 * t + j), 16))
      n = lambda s, sc=1.0, dt=BF: (jax.random.normal(next(kk), s, F32) * sc).astype(dt)
      sets.append((n((1, t, 5, hd)), n((1, t, H)), n((H,), 0.5, F32), n((hd,), 0.5, F32), n((3, hd, 1, W), 0.5),
                   n((1, 1, W - 1, 3, hd)), n((1, 1, H, DK, DK), 0.1, F32), jnp.int32(0)))
    state = H * DK * DK * 4
    window, raw = (W - 1) * 3 * hd * 2, t * 3 * hd * 2
    io = 4 * t * hd * 2 + 3 * hd * W * 2 + window + t * (4 * hd + H) * 4 + raw
    vbytes, cbytes = state + io, 2 * state + t * (3 * hd + H) * 4 + 2 * window + raw
    o_ref, rows_ref = oracles.kda_verify(*sets[0])
    vchain = lambda prev, s: s + (prev[1],)                 # write into the previous call's rows
    schain = lambda prev, s: prev + s[2:]                   # advance the previous call's state and window
    tb = timeit(oracles.kda_verify, sets, chain=vchain)
    na = jnp.array([max(1, t - 2)], jnp.int32)
    s_ref = oracles.kda_commit(sets[0][6], sets[0][5], rows_ref, na)
    csets = [(s[6], s[5], oracles.kda_verify(*s)[1], na) for s in sets]
    tcb = timeit(oracles.kda_commit, csets, chain=schain)
    for name, cfg in configs:
     try:
      o, rows_k = kda.kda_verify(*sets[0], config=cfg)
      err = max(rel(o, o_ref), *(rel(a, b) for a, b in zip(rows_k, rows_ref)))
      tk = timeit(lambda *s, cfg=cfg: kda.kda_verify(*s, config=cfg), sets, chain=vchain)
      rows.append(dict(name=f"kda_verify T={t} {name}", time_us=tk, bytes=vbytes,
                       floor_us=1e6 * vbytes / bw, fraction_of_floor=1e6 * vbytes / bw / tk,
                       baseline="model kda_inputs + kda_recurrent (XLA)", baseline_time_us=tb, rel_err=err))
      print(rows[-1], flush=True)
      got = kda.kda_commit(sets[0][6], sets[0][5], rows_ref, na, config=cfg)
      cerr = max(rel(a, b) for a, b in zip(got, s_ref))
      tc = timeit(lambda *c, cfg=cfg: kda.kda_commit(*c, config=cfg), csets, chain=schain)
      rows.append(dict(name=f"kda_commit T={t} n={int(na[0])} {name} (state chained)", time_us=tc, bytes=cbytes,
                       floor_us=1e6 * cbytes / bw, fraction_of_floor=1e6 * cbytes / bw / tc,
                       baseline="model kda_replay + slide_window (XLA)", baseline_time_us=tcb, rel_err=cerr))
      print(rows[-1], flush=True)
     except Exception as ex:
      print(f"FAILED kda T={t} {name}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--only", default="moe,kda", help="comma list of: moe, kda (this file's Triton v1 MoE and "
                  "KDA verify/commit), mosaic (Mosaic GPU MoE), moe_triton (fused-combine/align MoE), router, "
                  "kda2 (KDA verify/commit/decode, profiler timing)")
  ap.add_argument("--tag", default="", help="suffix of the JSON file name (keeps earlier runs' files)")
  ap.add_argument("--moe-triton-configs", default="v1+align,fused+align dc16 split2,fused+align dc16 prefetch kd256")
  ap.add_argument("--small", action="store_true", help="CPU smoke test: tiny dims, interpret")
  args = ap.parse_args()
  global D, E, I, H, DK
  moe_cfgs = [
      ("i64k128d128", moe_mod.MoeConfig(block_i=64, block_k=128, block_d=128, block_kd=128)),
      ("i32k128d64s3", moe_mod.MoeConfig(block_k=128, block_kd=128, num_stages=3))]
  kda_cfgs = [("bv16w1", kda.KdaConfig(block_v=16, num_warps=1)),
              ("bv32w1", kda.KdaConfig(block_v=32, num_warps=1)),
              ("bv32w4", kda.KdaConfig(block_v=32, num_warps=4))]
  if args.small:
    D, E, I, H, DK = 256, 32, 64, 2, 32
    moe_cfgs = [("small", moe_mod.MoeConfig(block_k=128, block_kd=64, interpret=True))]
    kda_cfgs = [("small", kda.KdaConfig(block_v=16, interpret=True))]
  ceiling = hbm_ceiling()
  bw = ceiling.bytes_per_s
  print(f"HBM ceiling {bw / 1e12:.3f} TB/s ({ceiling.source})", flush=True)
  rows = [dict(name="hbm ceiling (start of run)", time_us=None, bytes=None, bw_bytes_per_s=bw)]
  key = jax.random.key(0)
  def write_partial(rows):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"kernels-partial-{datetime.date.today().isoformat()}.json"), "w") as f:
      json.dump(rows, f, indent=1, default=str)

  try:  # SIGINT (timeout -s INT) still writes what was measured
    if "kda" in args.only.split(","):
      bench_kda(rows, bw, key, kda_cfgs)
    only = args.only.split(",")
    if "moe" in only:
      bench_moe(rows, bw, key, moe_cfgs)
    from bench import kernels_kda, kernels_moe_mosaic, kernels_moe_triton
    extra = [("mosaic", lambda: kernels_moe_mosaic.bench(rows, bw, key, small=args.small)),
             ("router", lambda: kernels_moe_triton.bench_router(rows, bw, key, small=args.small)),
             ("kda2", lambda: kernels_kda.bench(rows, bw, key, small=args.small, ts=(1, 6))),
             ("moe_triton", lambda: kernels_moe_triton.bench_moe(rows, bw, key, small=args.small,
                                                                 names=args.moe_triton_configs.split(",")))]
    for name, run in extra:
      if name in only:
        try:
          run()
        except Exception as ex:  # one broken section must not cost the others
          print(f"FAILED section {name}: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
        write_partial(rows)
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  date = datetime.date.today().isoformat()
  commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
  apply_ceiling(rows, ceiling)
  res = dict(command=" ".join(sys.argv), device=str(jax.devices()[0].device_kind),
             jax_version=jax.__version__, date=date, git_commit=commit, **ceiling.summary(), rows=rows)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"kernels-h200-{date}{args.tag}.json"), "w") as f:
    json.dump(res, f, indent=1)
  print(f"\n{'name':58s} {'us':>9s} {'floor':>8s} {'frac':>6s} {'base_us':>9s} {'err':>8s}")
  num = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"
  for r in rows[1:]:
    if not isinstance(r.get("time_us"), (int, float)):
      continue
    print(f"{r['name'][:58]:58s} {num(r['time_us'], '9.1f')} {num(r.get('floor_us'), '8.1f')} "
          f"{num(r.get('fraction_of_floor'), '6.2f')} {num(r.get('baseline_time_us'), '9.1f')} "
          f"{num(r.get('rel_err'), '8.1e')}")


if __name__ == "__main__":
  main()
