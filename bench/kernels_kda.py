"""KDA kernel bench at Ling-3.0-flash dims (B=1, H=32, Dk=Dv=128, W=4), cold states: verify
T=1/6/17, commit, fused decode; each vs the model's jnp (XLA; tests/kernel_oracles.py) and the previous (serial v2)
kernel. The "epilogue" op: verify with the output norm + gate folded in (kda_verify(o_norm=...),
KernelCalls.kda_verify_epilogue) against the tiled verify + the model's kda_output_gate in XLA, at Ling's heads
(32 x 128) and the demo's (5 x 64); compare busy_us / chained_us (every kernel of a call: the XLA epilogue's too;
both programs have one glue kernel a call, o_j -> call j+1's b_raw, so the epilogue cannot be fused across calls).

  PYTHONUNBUFFERED=1 python3 bench/kernels_kda.py --out $OUT   (GPU; writes kernels-kda-<dev>-<date>.json)
  PYTHONUNBUFFERED=1 python3 bench/kernels_kda.py --only epilogue --ts 1,6,17 --out $OUT   (the epilogue A/B only)
  python bench/kernels_kda.py --small --out /tmp                 (CPU smoke test, interpret mode)

Timing (the host-timed difference of medians is too noisy at a few us): each program runs N = 32
calls back to back on 32 distinct input sets (32 x 2.1 MB states > the 50 MB L2), each call
depending on the previous one (verify: call j+1 writes into the rows call j wrote, in place, as the
model's layers do; fused decode: q_{j+1} = o_j, a free reshape; verify + commit decode and commit:
the donated states, call j+1 depends on out_j through one tiny glue kernel). The kernels read the
model's layouts (the fused projection [1, T, 5, C], conv_w whole, the states as stacks of one). A
jax.profiler trace of 3 runs gives, per call:
  time_us     median device duration of the kernel itself (XLA references: device busy per call),
  chained_us  device span per call (first kernel start .. last kernel end, / N): the latency of a
              dependent chain inside one executable, launch gaps (CUDA graph) included,
  wall_us     host wall time of the program per call, minus the same program without kernels.
Floor = bytes that must move / HBM bandwidth measured in the same trace (max of a 2 GiB
elementwise pass and a 2 GiB GEMV).
"""
from __future__ import annotations

import argparse, datetime, glob, gzip, json, os, subprocess, sys, tempfile, time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import kda_decode as kdd  # noqa: E402
from pallas_kernels import kda_verify as kda  # noqa: E402
from ling_jax.layers.kda import kda_output_gate  # noqa: E402
from tests import kernel_oracles as oracles  # noqa: E402
from bench.bench_kernels import tree_of  # noqa: E402

H, DK, W, N = 32, 128, 4, 32
EPS = 1e-6  # the output RMSNorm's eps (rms_norm_eps)
BF, F32 = jnp.bfloat16, jnp.float32


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def nbytes(tree):
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def profile(progs, small):
  """progs: [(fn, args_fn)]; args_fn() gives fresh args (donated states). Returns per prog the
  list (3 runs) of device kernel events [(name, ts, dur)] (empty lists on CPU)."""
  pre = [[args_fn() for _ in range(4)] for _, args_fn in progs]    # made before the trace
  jax.block_until_ready(pre)
  for (fn, _), a in zip(progs, pre):             # compile + warm
    jax.block_until_ready(fn(*a[0]))
  if small:
    return [[[]] * 3 for _ in progs]
  logdir = tempfile.mkdtemp(prefix="kda-prof-")
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    time.sleep(0.02)
    for (fn, _), a in zip(progs, pre):
      for rep in range(1, 4):
        jax.block_until_ready(fn(*a[rep]))
        time.sleep(0.02)
  try:
    path = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
      tr = json.load(f)
  except Exception as ex:  # no trace: the rows fall back to wall time
    print(f"profiler trace unusable ({type(ex).__name__}: {ex}); wall time only", flush=True)
    return [[[]] * 3 for _ in progs]
  ev = tr["traceEvents"] if isinstance(tr, dict) else tr
  meta = lambda what: {(e["pid"], e.get("tid")) if what == "thread_name" else e["pid"]: e["args"]["name"]
                       for e in ev if e.get("ph") == "M" and e.get("name") == what}
  pn, tn = meta("process_name"), meta("thread_name")
  gpu = {p for p, n in pn.items() if "gpu" in n.lower() or "stream" in n.lower()}
  # kernels only: the GPU process also has "XLA Modules" / "XLA Ops" lines spanning the same time
  ks = sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in ev
              if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e
              and "xla" not in tn.get((e["pid"], e.get("tid")), "").lower())
  runs, cur = [], []
  for ts, dur, name in ks:                       # runs are separated by >= 20 ms of host sleep
    if cur and ts - max(t + d for t, d, _ in cur) > 10e3:
      runs.append(cur); cur = []
    cur.append((ts, dur, name))
  runs.append(cur)
  runs = [r for r in runs if r]
  if len(runs) != 3 * len(progs):
    print(f"trace: {len(runs)} runs for {len(progs)} programs x 3; wall time only", flush=True)
    return [[[]] * 3 for _ in progs]
  return [runs[3 * i:3 * i + 3] for i in range(len(progs))]


def stats(runs, kernel, ncalls):
  """time_us (median kernel dur or busy/call), chained_us (span/call), kernels per call."""
  if not runs[0]:
    return dict(time_us=None, chained_us=None)
  span = np.median([(max(t + d for t, d, _ in r) - min(t for t, _, _ in r)) / ncalls for r in runs])
  busy = np.median([sum(d for _, d, _ in r) / ncalls for r in runs])
  mine = [d for r in runs for _, d, n in r if kernel and n.startswith(kernel)]
  return dict(time_us=float(np.median(mine)) if mine else float(busy), chained_us=float(span),
              busy_us=float(busy), kernels_per_call=len(runs[0]) / ncalls)


def wall_us(fn, args_fn, null, ncalls, reps=15):
  ts = []
  for f in (fn, null):
    t = []
    for _ in range(reps):
      a = args_fn(); jax.block_until_ready(a)
      t0 = time.perf_counter(); jax.block_until_ready(f(*a)); t.append(time.perf_counter() - t0)
    ts.append(np.median(t))
  return 1e6 * (ts[0] - ts[1]) / ncalls


def make_sets(key, t, hd, n, h=None, dk=None):
  """n input sets in the model's layouts, bf16 like the model: [proj [1, T, 5, C], b_raw, conv_state
  [1, 1, W-1, 3, C], rec_state [1, 1, H, K, V] f32] (the states as stacks of one layer); consts [A_log, dt_bias,
  conv_w [3, C, 1, W]]. h, dk: the heads (default H, DK; hd = h * dk)."""
  H, DK = h or globals()["H"], dk or globals()["DK"]
  sets = []
  for j in range(n):
    kk = iter(jax.random.split(jax.random.fold_in(key, 1000 * t + j), 16))
    r = lambda s, sc=1.0, dt=BF: (jax.random.normal(next(kk), s, F32) * sc).astype(dt)
    sets.append([r((1, t, 5, hd)), r((1, t, H)), r((1, 1, W - 1, 3, hd)), r((1, 1, H, DK, DK), 0.1, F32)])
  kc = iter(jax.random.split(jax.random.fold_in(key, 7), 8))
  consts = [jax.random.normal(next(kc), (H,), F32) * 0.5, jax.random.normal(next(kc), (hd,), F32) * 0.5,
            (jax.random.normal(next(kc), (3, hd, 1, W), F32) * 0.5).astype(BF)]
  return sets, consts


def full_args(s, c):
  """set [proj, b, conv, state] + consts [alog, dtb, conv_w] -> kda_verify's 8 arguments (layer 0)."""
  return (s[0], s[1], *c, s[2], s[3], jnp.int32(0))


def decode_set(s):
  """A T = 1 set in kda_decode's layout: [q, k, v, f, b, conv [1, W-1, 3C], state [1, H, K, V]], q f32 so that
  o_j reshapes into q_{j+1}."""
  proj = s[0]
  return [proj[:, :, 0].astype(F32), proj[:, :, 1], proj[:, :, 2], proj[:, :, 3], s[1],
          s[2][0].reshape(1, W - 1, -1), s[3][0]]


def decode_args(s, c):
  """decode set + consts -> kda_decode's 12 arguments."""
  return (*s[:5], c[0], c[1], *c[2], s[5], s[6])


def verify_prog(fn):
  """N dependent verify calls: each writes into the rows the previous one wrote (in place, the model's pattern)."""
  def prog(sets, consts):
    outs, rows = [], None
    for s in sets:
      o, rows = fn(*full_args(s, consts), rows)
      outs.append(o)
    return outs, rows
  return jax.jit(prog)


def epilogue_prog(fn):
  """N dependent calls of fn (verify + the output epilogue -> (o [1, T, H*V], rows)): call j+1 writes into the rows
  call j wrote, and its b_raw depends on call j's o (1 glue kernel), as the next layer's input depends on o."""
  def prog(sets, consts):
    outs, rows, prev = [], None, None
    for s in sets:
      b = s[1] if prev is None else s[1] + (prev[..., :1] > 1e30).astype(s[1].dtype)
      prev, rows = fn(s[0], b, *consts, s[2], s[3], jnp.int32(0), rows)
      outs.append(prev)
    return outs, rows
  return jax.jit(prog)


def tiled_then_xla_epilogue(cfg, o_norm):
  """The path with the flag off: the tiled verify (R(o)), then the model's kda_output_gate in XLA."""
  def f(*a):
    o, rows = kda.kda_verify(*a, config=cfg)
    return kda_output_gate(dict(o_norm=o_norm), o, a[0][:, :, 4], EPS, a[0].dtype), rows
  return f


def epilogue_jobs(jobs, key, t, ncalls, heads, configs):
  """The epilogue A/B at T = t for each (h, dk) of heads: the model's jnp (XLA reference), then each config: named
  "folded ..." the folded kernel, else the tiled verify + the XLA epilogue (the flag off)."""
  for h, dk in heads:
    sets, consts = make_sets(key, t, h * dk, ncalls, h, dk)
    o_norm = (1 + 0.2 * jax.random.normal(jax.random.fold_in(key, 11), (dk,), F32)).astype(BF)
    want = oracles.kda_verify(*full_args(sets[0], consts), o_norm=o_norm, eps=EPS)
    ebytes = nbytes(sets[0]) + nbytes(consts) + nbytes(want)
    base = dict(bytes=ebytes, baseline="model kda_inputs + kda_recurrent + kda_output_gate (XLA)")
    args = lambda sets=sets, consts=consts: (sets, consts)
    null = jax.jit(lambda sets, consts: [s[-1] for s in sets])
    ref = lambda *a, o_norm=o_norm: oracles.kda_verify(*a, o_norm=o_norm, eps=EPS)
    jobs.append((dict(name=f"kda_verify+epilogue T={t} {h}x{dk} XLA reference", **base), epilogue_prog(ref), args,
                 None, null, None))
    for name, cfg in configs:
      f = (lambda *a, cfg=cfg, o_norm=o_norm: kda.kda_verify(*a, config=cfg, o_norm=o_norm, eps=EPS)) \
          if name.startswith("folded") else tiled_then_xla_epilogue(cfg, o_norm)
      chk = lambda f=f, s=sets[0], c=consts, want=want: max(
          rel(x, y) for x, y in zip(jax.tree.leaves(f(*full_args(s, c))), jax.tree.leaves(want)))
      jobs.append((dict(name=f"kda_verify+epilogue T={t} {h}x{dk} {name}", config=str(cfg), **base),
                   epilogue_prog(f), args, None, null, chk))


def commit_prog(fn):
  def prog(states, windows, rows, ns):
    outs = []
    for st, win, r, n in zip(states, windows, rows, ns):
      if outs:                                   # dependency on the previous call: 1 glue kernel
        n = n + (outs[-1][0][0, 0, 0, 0, 0] > 1e30).astype(jnp.int32)
      outs.append(fn(st, win, r, n))
    return outs
  return jax.jit(prog, donate_argnums=(0, 1))


def decode_prog(fn):
  def prog(states, sets, consts):
    outs, prev = [], None
    for st, s in zip(states, sets):
      q = s[0] if prev is None else prev.reshape(s[0].shape)
      o, st2, cs = fn(*decode_args([q] + s[1:6] + [st], consts))
      outs.append((st2, cs)); prev = o
    return [x[0] for x in outs], [x[1] for x in outs], prev
  return jax.jit(prog, donate_argnums=0)


def verify_commit_prog(config):
  """The default decode path of one layer: verify, then the commit of its one row (state and window in place)."""
  one = jnp.ones((1,), jnp.int32)

  def prog(states, windows, sets, consts):
    outs, prev = [], None
    for st, win, s in zip(states, windows, sets):
      b = s[1] if prev is None else s[1] + (prev[..., 0] > 1e30).astype(s[1].dtype)  # on call j-1: 1 glue kernel
      prev, rows = kda.kda_verify(s[0], b, *consts, win, st, 0, config=config)
      outs.append(kda.kda_commit(st, win, rows, one, config=config))
    return outs, prev
  return jax.jit(prog, donate_argnums=(0, 1))


def decode_jobs(jobs, sets, consts, configs):
  """kda_decode rows (T = 1 sets): the XLA reference, then each config."""
  dsets = [decode_set(s) for s in sets]
  ref = oracles.kda_decode(*decode_args(dsets[0], consts))
  dbytes = nbytes(dsets[0]) + nbytes(consts) + nbytes(ref)
  dargs = lambda: ([jnp.copy(s[6]) for s in dsets], dsets, consts)
  dnull = jax.jit(lambda st, s, c: st, donate_argnums=0)
  dbase = dict(bytes=dbytes, baseline="model decode step (XLA)")
  jobs.append((dict(name="kda_decode XLA reference", **dbase), decode_prog(oracles.kda_decode),
               dargs, None, dnull, None))
  # the verify path reads the bf16 projection (dsets' q is f32, so the reference above has no bf16 rounding of q)
  ref_bf16 = oracles.kda_decode(*decode_args([sets[0][0][:, :, 0]] + dsets[0][1:], consts))
  for name, cfg in configs:
    if name.startswith("verify"):
      prog = verify_commit_prog(cfg)
      args = lambda: ([jnp.copy(s[3]) for s in sets], [jnp.copy(s[2]) for s in sets], sets, consts)
      null = jax.jit(lambda st, w, s, c: (st, w), donate_argnums=(0, 1))

      def chk(prog=prog, s=sets[0], c=consts, want=ref_bf16):
        (state, window), o = (lambda r: (r[0][0], r[1]))(prog([jnp.copy(s[3])], [jnp.copy(s[2])], [s], c))
        return max(rel(x, y) for x, y in zip((o, state[0], window[0].reshape(1, W - 1, -1)), want))
      jobs.append((dict(name=f"kda_decode {name}", config=str(cfg), **dbase), prog, args, None, null, chk))
      continue
    f = lambda *a, cfg=cfg: kdd.kda_decode(*a, config=cfg)
    chk = lambda f=f, s=dsets[0], c=consts, want=ref: max(
        rel(x, y) for x, y in zip(f(*decode_args(s[:6] + [jnp.copy(s[6])], c)), want))
    jobs.append((dict(name=f"kda_decode {name}", config=str(cfg), **dbase), decode_prog(f), dargs,
                 "kda_decode", dnull, chk))


def bench(rows, bw, key, small=False, configs=None, emit=print, ts=(1, 6, 17), ops=None):
  """Appends rows (bench_kernels.bench_kda format + chained_us, wall_us). bw: HBM bytes/s (None:
  measured here). configs: {"verify": [(name, cfg)], "commit": [...], "decode": [...], "epilogue": [...]};
  ops: a subset of those keys (None: all); ts: the T values, in order (decode runs with T=1)."""
  global H, DK
  if small:
    H, DK = 2, 32
  hd = H * DK
  ncalls = 4 if small else N
  configs = configs or default_configs(small)
  configs = {op: (c if ops is None or op in ops else []) for op, c in configs.items()}
  jobs = []   # (row dict, fn, args_fn, kernel name, null fn, check)
  for t in ts:
    sets, consts = make_sets(key, t, hd, ncalls)
    o_ref, ci_ref = oracles.kda_verify(*full_args(sets[0], consts))
    vbytes = nbytes(sets[0]) - nbytes(sets[0][0]) // 5 + nbytes(consts) + nbytes((o_ref, ci_ref))  # 4 of 5 streams
    base = dict(bytes=vbytes, baseline="model kda_inputs + kda_recurrent (XLA)")
    vnull = jax.jit(lambda sets, consts: [s[-1] for s in sets])
    if t == 1 and configs["decode"]:
      decode_jobs(jobs, sets, consts, configs["decode"])
    if configs["epilogue"]:
      epilogue_jobs(jobs, key, t, ncalls, [(H, DK)] if small else [(H, DK), (5, 64)], configs["epilogue"])
    if configs["verify"]:
      jobs.append((dict(name=f"kda_verify T={t} XLA reference", **base), verify_prog(oracles.kda_verify),
                   lambda sets=sets, consts=consts: (sets, consts), None, vnull, None))
    for name, cfg in configs["verify"]:
      f = lambda *a, cfg=cfg: kda.kda_verify(*a, config=cfg)
      chk = lambda f=f, s=sets[0], c=consts, want=(o_ref, ci_ref): max(
          rel(x, y) for x, y in zip(jax.tree.leaves(f(*full_args(s, c))), jax.tree.leaves(want)))
      jobs.append((dict(name=f"kda_verify T={t} {name}", config=str(cfg), **base), verify_prog(f),
                   lambda sets=sets, consts=consts: (sets, consts), "kda_verify", vnull, chk))
    # commit n = max(1, T-2) of the model's rows
    cis = [oracles.kda_verify(*full_args(s, consts))[1] for s in sets]
    ns = [jnp.array([max(1, t - 2)], jnp.int32)] * ncalls
    cbytes = 2 * nbytes((sets[0][2], sets[0][3])) + nbytes(cis[0])
    s_ref = oracles.kda_commit(sets[0][3], sets[0][2], cis[0], ns[0])
    cargs = lambda sets=sets, cis=cis, ns=ns: ([jnp.copy(s[3]) for s in sets], [jnp.copy(s[2]) for s in sets], cis,
                                               ns)
    cnull = jax.jit(lambda st, w, c, n: (st, w), donate_argnums=(0, 1))
    cbase = dict(bytes=cbytes, baseline="model kda_replay + slide_window (XLA)")
    if configs["commit"]:
      jobs.append((dict(name=f"kda_commit T={t} n={max(1, t - 2)} XLA reference", **cbase),
                   commit_prog(oracles.kda_commit), cargs, None, cnull, None))
    for name, cfg in configs["commit"]:
      f = lambda s, w, c, n, cfg=cfg: kda.kda_commit(s, w, c, n, config=cfg)
      chk = lambda f=f, s=sets[0], c=cis[0], n=ns[0], want=s_ref: max(
          rel(x, y) for x, y in zip(f(jnp.copy(s[3]), jnp.copy(s[2]), c, n), want))
      jobs.append((dict(name=f"kda_commit T={t} n={max(1, t - 2)} {name}", config=str(cfg), **cbase),
                   commit_prog(f), cargs, "kda_commit", cnull, chk))
  bw_progs = []
  if bw is None:
    x = jnp.ones((2 if small else 1024, 1024 * 1024), BF)
    v = jnp.ones((1024 * 1024,), BF)
    bw_progs = [(jax.jit(lambda a: a + 1), lambda: (x,)), (jax.jit(lambda a, b: a @ b), lambda: (x, v))]
  # profile in groups so that a failure costs one group, and rows appear as they are measured
  groups = [bw_progs] if bw_progs else []
  i = 0
  while i < len(jobs):                          # a group = one op at one T: reference first
    j = i + 1
    while j < len(jobs) and "XLA reference" not in jobs[j][0]["name"]:
      j += 1
    groups.append(jobs[i:j]); i = j
  for gi, group in enumerate(groups):
    if group is bw_progs:
      runs = profile(bw_progs, small)
      if small:
        bw = 3e12
      else:
        busy = lambda rs: 1e-6 * min(sum(d for _, d, _ in r) for r in rs)   # all kernels of a run
        copy, gemv = 2 * x.nbytes / busy(runs[0]), x.nbytes / busy(runs[1])
        bw = max(copy, gemv)
      rows.append(dict(name="hbm bandwidth (max of 2 GiB elementwise r+w, 2 GiB GEMV)", time_us=None,
                       bytes=None, bw_bytes_per_s=bw))
      emit(f"HBM bandwidth {bw / 1e12:.2f} TB/s")
      continue
    try:
      runs = profile([(fn, af) for _, fn, af, _, _, _ in group], small)
    except Exception as ex:  # report and go on: one bad config must not cost the run
      emit(f"FAILED group {group[0][0]['name']}: {type(ex).__name__}: {str(ex)[:1500]}")
      continue
    base_t = base_c = None
    for (row, fn, af, kern, null, chk), r in zip(group, runs):
      try:
        row.update(stats(r, kern, ncalls))
        row["wall_us"] = wall_us(fn, af, null, ncalls, reps=3 if small else 15)
        if row["time_us"] is None:
          row["time_us"] = row["wall_us"]
        if chk is None:
          base_t, base_c = row["time_us"], row.get("chained_us")
        row.update(baseline_time_us=base_t, baseline_chained_us=base_c,
                   floor_us=1e6 * row["bytes"] / bw,
                   fraction_of_floor=1e6 * row["bytes"] / bw / row["time_us"],
                   rel_err=chk() if chk else 0.0)
        rows.append(row)
        emit(fmt(row))
      except Exception as ex:
        emit(f"FAILED {row['name']}: {type(ex).__name__}: {str(ex)[:1500]}")
  return rows


def default_configs(small):
  """{op: [(name, KdaConfig)]}; "epilogue": "tiled ..." the tiled verify + XLA epilogue (the flag off), "folded ..."
  the folded kernel (one program per head: block_v unused, epilogue_num_warps its warps)."""
  if small:
    s = kda.KdaConfig(block_v=16, interpret=True)
    return dict(verify=[("serial", s)], commit=[("serial", s)],
                decode=[("fused", s), ("verify + commit (the default path)", s)],
                epilogue=[("tiled + XLA epilogue", s), ("folded", s)])
  S = kda.KdaConfig
  return dict(   # the 2026-11-30 run: serial bv32w4 best of serial bv16w1 / chunk (UT form, deleted) bv32..128
      verify=[("serial bv32w4 (default)", S()), ("serial bv32w8", S(num_warps=8)),
              ("serial bv64w8", S(block_v=64, num_warps=8))],
      commit=[("serial bv32w4 (default)", S()), ("serial bv32w8", S(num_warps=8))],
      decode=[("fused bv32w4", S()), ("fused bv32w8", S(num_warps=8)), ("fused bv16w4", S(block_v=16)),
              ("fused bv64w8", S(block_v=64, num_warps=8)),
              ("verify + commit (the default path), bv32w4", S())],
      epilogue=[("tiled bv32w4 + XLA epilogue (flag off)", S()), ("tiled bv32w2 + XLA epilogue", S(num_warps=2)),
                ("folded Dv/32 warps (default)", S()), ("folded w1", S(epilogue_num_warps=1)),
                ("folded w2", S(epilogue_num_warps=2)), ("folded w4", S(epilogue_num_warps=4)),
                ("folded w8", S(epilogue_num_warps=8))])


def fmt(r):
  f = lambda x, p=".2f": "-" if x is None else format(x, p)
  return (f"{r['name']:56s} {f(r['time_us']):>8s} {f(r.get('chained_us')):>8s} {f(r.get('wall_us')):>8s} "
          f"{f(r['floor_us']):>6s} {f(r['fraction_of_floor'], '.3f'):>6s} {f(r['baseline_time_us']):>8s} "
          f"{f(r.get('rel_err'), '.1e'):>8s}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--small", action="store_true", help="CPU smoke test: tiny dims, interpret")
  ap.add_argument("--git-commit", default=None, help="the commit benched (the device copy has no .git)")
  ap.add_argument("--tree", default=None, help="the commit / tree benched (the JSON's `tree`; default: "
                  "--git-commit, else git HEAD)")
  ap.add_argument("--ts", default="1,6,17", help="T values in order (decode rides with T=1)")
  ap.add_argument("--only", default=None, help="comma list of verify,commit,decode,epilogue (default all)")
  args = ap.parse_args()
  date = datetime.date.today().isoformat()
  dev = "cpu" if args.small else "h200"
  commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
  res = dict(command=" ".join(sys.argv), device=str(jax.devices()[0].device_kind),
             jax_version=jax.__version__, date=date, git_commit=args.git_commit or commit or "unknown",
             tree=tree_of(args.tree or args.git_commit), rows=[])
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"kernels-kda-{dev}-{date}.json")

  def emit(line):
    print(line, flush=True)
    with open(path, "w") as f:                   # partial results survive a timeout
      json.dump(res, f, indent=1)
  print(f"{'name':56s} {'us':>8s} {'chain':>8s} {'wall':>8s} {'floor':>6s} {'frac':>6s} {'base_us':>8s} "
        f"{'err':>8s}", flush=True)
  try:
    bench(res["rows"], None, jax.random.key(0), small=args.small, emit=emit,
          ts=tuple(int(t) for t in args.ts.split(",")), ops=args.only and args.only.split(","))
  except KeyboardInterrupt:
    print("interrupted: writing partial results", flush=True)
  from bench.ceiling import Ceiling, apply

  ceiling = Ceiling.measure(jax.devices()[0])  # the one ceiling: floors recomputed with the run's best
  apply(res["rows"], ceiling)
  res.update(ceiling.summary())
  emit(f"wrote {path}")


if __name__ == "__main__":
  main()
