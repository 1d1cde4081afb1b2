"""A Pallas Triton kernel's latency without a GPU: its sm_90 SASS (offline compile) and an in-order model of it.

  python3 -m bench.sass_model                 (router_segments' programs at the v2 demo's dims: a table, ~3 min)
  python3 -m bench.sass_model --t 6 --segments scatter --warps 1 --lines 15    (one program, its costliest lines)

How: the Pallas lowering's Triton IR (caught as jax's pallas_call lowering builds it, call-site locations replaced
by the callee's own so each op keeps its source line) compiled for sm_90 by the pip Triton of the venv
(triton.compile(ttir file, target=GPUTarget("cuda", 90, 32))), disassembled with line info by its nvdisasm, then
one warp's instructions issued in order: each at max(previous issue + 1, its operands ready), a result ready
LATENCY cycles after issue, BAR.SYNC after every pending shared store, DEPBAR after its cp.async groups, loops
unrolled `trips` times. Every warp runs the same code, so one warp's chain is the program's (a warp's work is
per thread: a layout replicated over the warps costs each warp the whole tensor). It ranks programs (the v2 demo's
router: 6.7 / 8.4 us modeled, 7.3 / 9.2 us measured without / with the norm) and names the lines that cost; the
GPU's own timing is bench/kernels_moe_router_tables.py. XLA compiles the same IR with its own Triton and ptxas:
layouts and schedules may differ in detail.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile

import jax.numpy as jnp

# Rough Hopper latencies (cycles) by opcode prefix; everything else LATENCY["ALU"].
LATENCY = {"ALU": 5, "MUFU": 18, "SHFL": 24, "LDS": 30, "LDSM": 32, "LDG": 450, "LDL": 450, "LDC": 12, "S2R": 20,
           "HMMA": 32, "F2F": 10, "F2I": 10, "I2F": 10, "F2FP": 10, "REDUX": 30, "VOTE": 30, "STS": 20, "BAR": 20}
NO_DEST = {"ST", "STS", "STG", "STL", "RED", "BAR", "BRA", "EXIT", "LDGSTS", "LDGDEPBAR", "DEPBAR", "NOP", "WARPSYNC",
           "BSSY", "BSYNC", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "YIELD", "RET", "CALL", "SYNCS", "BPT"}
SASS_LINE = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P[T\d]+\s+)?([A-Z0-9_.]+)\s*(.*?)\s*;")


@contextlib.contextmanager
def caught_triton_ir():
  """Collects the Triton IR text of every pallas_call lowered inside the block, as {kernel name: IR}."""
  from jax._src.pallas.triton import pallas_call_registration as registration
  caught, lower = {}, registration.lowering.lower_jaxpr_to_triton_module

  def spy(*a, **k):
    res = lower(*a, **k)
    text = res.module.operation.get_asm(enable_debug_info=True)
    caught[re.search(r"tt\.func public @(\w+)", text).group(1)] = text
    return res
  registration.lowering.lower_jaxpr_to_triton_module = spy
  try:
    yield caught
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower


def own_locations(ir):
  """Call-site locations -> the callee's (the op's own line); file f's lines renumbered f * 100000 + line (SASS
  line info keeps no file names). Returns (IR, {file index: path})."""
  calls = dict(re.findall(r"^(#loc\d+) = loc\(callsite\((#loc\d+) at #loc\d+\)\)$", ir, flags=re.M))

  def own(name):
    while name in calls:
      name = calls[name]
    return name
  ir = re.sub(r"^#loc\d+ = loc\(callsite\(.*\)\)\n", "", ir, flags=re.M)
  ir = re.sub(r"#loc\d+\b", lambda m: own(m.group(0)), ir)
  files = sorted(set(re.findall(r'loc\("([^"]+\.py)":\d+', ir)))
  ir = re.sub(r'loc\("([^"]+\.py)":(\d+)', lambda m: f'loc("{m.group(1)}":{files.index(m.group(1)) * 100000 + int(m.group(2))}', ir)
  return ir, dict(enumerate(files))


def compile_sm90(ir, num_warps, num_stages=1):
  """(SASS with line info, TTGIR) of the IR compiled for sm_90 by the venv's Triton."""
  import triton
  from triton.backends.compiler import GPUTarget
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ir)
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    cubin = os.path.join(tmp, "kernel.cubin")
    with open(cubin, "wb") as f:
      f.write(k.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", "-g", cubin], capture_output=True, text=True).stdout
  return sass, k.asm["ttgir"]


def _regs(operand, width=1):
  out = []
  for m in re.finditer(r"\b(U?R)(\d+)\b|\b(U?P)(\d)\b", operand):
    out += [f"{m.group(1)}{int(m.group(2)) + i}" for i in range(width)] if m.group(1) else [m.group(3) + m.group(4)]
  return out


def _width(op, i):
  if op.startswith("HMMA"):
    return {0: 4, 1: 4, 2: 2, 3: 4}.get(i, 1)
  if op.startswith("LDSM") and i == 0:
    m = re.search(r"\.M88\.(\d)", op)
    return int(m.group(1)) if m else 1
  return (4 if ".128" in op else 2 if ".64" in op or "WIDE" in op else 1) if i == 0 else 1


def _unrolled(sass, trips):
  """SASS lines, each loop body (a predicated backward branch's) repeated `trips` times; with source lines."""
  out, label_at, line = [], {}, None
  for text in sass.splitlines():
    if (m := re.search(r"line (\d+)", text)) and text.strip().startswith("//##"):
      line = int(m.group(1))
      continue
    if m := re.match(r"^(\.L_x_\d+):", text):
      label_at[m.group(1)] = len(out)
    if SASS_LINE.match(text):
      out.append((line, text))
      b = re.search(r"BRA `\((\.L_x_\d+)\)", text)
      if b and "@" in text and label_at.get(b.group(1), len(out)) < len(out) - 1:
        out += out[label_at[b.group(1)]:] * (trips - 1)
  return out


def model(sass, trips=1):
  """(cycles of one warp's in-order issue, {source line: cycles charged, instructions}) of the SASS."""
  ready = collections.defaultdict(int)
  t = smem_pending = cp_group = 0
  cp_groups, charge, count = [], collections.Counter(), collections.Counter()
  for line, text in _unrolled(sass, trips):
    pred, op, rest = SASS_LINE.match(text).groups()
    base = op.split(".")[0]
    ops = [o.strip() for o in re.split(r",(?![^\[]*\])", rest)] if rest else []
    if base in NO_DEST:
      n_dest = 0
    elif base == "SHFL" or base in ("ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "UISETP"):
      n_dest = 2
    else:
      n_dest = 1
      while n_dest < len(ops) and re.fullmatch(r"!?U?P[T\d]", ops[n_dest]) and base not in ("SEL", "FSEL", "PLOP3"):
        n_dest += 1
    need = [r for i, o in enumerate(ops[n_dest:]) for r in _regs(o, _width(op, i + n_dest))] + _regs(pred or "")
    if base == "HMMA":
      need += _regs(ops[0], 4)                                            # the accumulator
    start = max([t + 1] + [ready[r] for r in need])
    if base == "BAR":
      start = max(start, smem_pending) + LATENCY["BAR"]
    elif base == "DEPBAR":
      keep = int(m.group(1), 16) if (m := re.search(r"0x([0-9a-f]+)", rest)) else 0
      start = max([start] + cp_groups[:max(0, len(cp_groups) - keep)])
    elif base == "LDGDEPBAR":
      cp_groups.append(cp_group)
      cp_group = 0
    elif base == "LDGSTS":
      cp_group = max(cp_group, start + LATENCY["LDG"])
    elif base == "STS":
      smem_pending = max(smem_pending, start + LATENCY["STS"])
    charge[line] += start - t
    count[line] += 1
    t = start
    lat = next((v for k, v in LATENCY.items() if base.startswith(k) and k != "ALU"), LATENCY["ALU"])
    for i, o in enumerate(ops[:n_dest]):
      for r in _regs(o, _width(op, i)):
        if r not in ("PT", "RZ"):
          ready[r] = max(ready[r], start + lat)
  return max([t] + list(ready.values())), {k: (charge[k], count[k]) for k in charge}


def sass_counts(sass):
  ops = collections.Counter(m.group(2).split(".")[0] for l in sass.splitlines() if (m := SASS_LINE.match(l)))
  return {k: ops[k] for k in ("BAR", "SHFL", "LDG", "LDGSTS", "STG", "HMMA")} | {"instructions": sum(ops.values())}


def router_ir(t, segments, norm=False, live=False, cfg_name="ling-demo-v2"):
  """router_segments' Triton IR (and its file table) at a preset's dims, T rows (live: 2 sequences, one padded)."""
  from ling_jax.config import PRESETS
  from ling_jax.kernel_calls import KernelCalls
  from pallas_kernels import router_segments as RS
  from tests.cuda_lowering import S, lower_cuda
  cfg = PRESETS[cfg_name]
  d, e = cfg.hidden_size, cfg.num_experts
  rc = dataclasses.replace(KernelCalls()._router_config(S((t, d), jnp.bfloat16), e, cfg), segments=segments)
  kw = dict(n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
            routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob, has_shared=False,
            rows_per_seq=t // 2 if live else 0, config=rc)

  def f(x, g, b, w, lr):
    return RS.route_segments(x, g, b, lr if live else None, w if norm else None, eps=1e-6 if norm else None, **kw)
  with caught_triton_ir() as caught:
    lower_cuda(f, S((t, d), jnp.bfloat16), S((e, d), jnp.bfloat16), S((e,), jnp.float32), S((d,), jnp.bfloat16),
               S((2,), jnp.int32))
  return own_locations(caught["router_segments"])


def show_lines(per_line, files, top):
  total = sum(c for c, _ in per_line.values())
  source = {}
  for i, path in files.items():
    with open(path) as f:
      source.update({i * 100000 + n: (os.path.basename(path), n, s.strip()[:80]) for n, s in enumerate(f, 1)})
  for line, (c, n) in sorted(per_line.items(), key=lambda kv: -kv[1][0])[:top]:
    name, n_line, text = source.get(line, ("?", line, ""))
    print(f"  {c:6d} cyc {100 * c / total:5.1f} %  {n:4d} instr  {name}:{n_line}: {text}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--t", type=int, default=None, help="one program at T rows (else the table)")
  ap.add_argument("--segments", default="scatter", choices=("onehot", "scatter"))
  ap.add_argument("--warps", type=int, default=1)
  ap.add_argument("--stages", type=int, default=1)
  ap.add_argument("--norm", action="store_true")
  ap.add_argument("--live", action="store_true")
  ap.add_argument("--lines", type=int, default=12, help="source lines to show (one program)")
  ap.add_argument("--ghz", type=float, default=1.98)
  a = ap.parse_args()
  if a.t is not None:
    ir, files = router_ir(a.t, a.segments, a.norm, a.live)
    sass, _ = compile_sm90(ir, a.warps, a.stages)
    cycles, per_line = model(sass, trips=5)
    print(f"T={a.t} {a.segments} warps={a.warps}: {cycles} cycles = {cycles / a.ghz / 1e3:.2f} us, {sass_counts(sass)}")
    show_lines(per_line, files, a.lines)
    return
  # (T, program, warps, stages, norm, live): the programs as route_segments launches them
  runs = [(t, "onehot", 4, 4, False, False) for t in (1, 6)] + [(t, "scatter", 1, 1, False, False) for t in (1, 6)] + [
      (6, "onehot", 4, 4, False, True), (6, "scatter", 1, 1, False, True),
      (6, "onehot", 4, 4, True, False), (6, "scatter", 4, 1, True, False)]
  print(f"{'program':34s} {'us':>6s} {'instr':>6s} {'BAR':>4s} {'SHFL':>5s} {'HMMA':>5s}")
  for t, seg, warps, stages, norm, live in runs:
    ir, _ = router_ir(t, seg, norm, live)
    sass, _ = compile_sm90(ir, warps, stages)
    cycles, _ = model(sass, trips=5)
    c = sass_counts(sass)
    name = f"T={t}{' live' if live else ''}{' norm' if norm else ''} {seg} w{warps}"
    print(f"{name:34s} {cycles / a.ghz / 1e3:6.2f} {c['instructions']:6d} {c['BAR']:4d} {c['SHFL']:5d} {c['HMMA']:5d}",
          flush=True)


if __name__ == "__main__":
  main()
