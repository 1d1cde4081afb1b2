"""Registers, spills and modeled latency of kda_verify's programs without a GPU (the table in
pallas_kernels/kda_verify.py's docstring): the tiled verify (BV columns a program) and the folded epilogue (one
program per head), lowered for CUDA at the given head dims, the Triton IR compiled for sm_90a by the venv's pip
Triton, its PTX through ptxas -v (registers, stack, spill bytes), its SASS through bench/sass_model's in-order model
of one warp (cycles -> us at 1.98 GHz). XLA compiles the same IR with its own Triton and ptxas: a ranking, not a
timing (bench/kernels_kda.py --only epilogue is the GPU's).

  python3 -m bench.sass_kda_verify                         (the docstring's table, ~3 min)
  python3 -m bench.sass_kda_verify --cases 5x64:6:w2:folded 5x64:6:w4:bv32
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import jax.numpy as jnp

from bench.sass_model import caught_triton_ir, compile_sm90, model, own_locations, sass_counts
from pallas_kernels.kda_verify import KdaConfig, kda_verify
from tests.cuda_lowering import S, lower_cuda

CASES = ["5x64:1:w4:bv32", "5x64:1:w2:folded", "5x64:1:w4:folded", "5x64:6:w4:bv32", "5x64:6:w2:folded",
         "5x64:6:w4:folded", "5x64:17:w4:bv32", "5x64:17:w2:folded", "5x64:17:w4:folded", "32x128:1:w4:bv32",
         "32x128:1:w4:folded", "32x128:1:w8:folded", "32x128:6:w4:bv32", "32x128:6:w4:folded", "32x128:6:w8:folded"]


def verify_ir(h, dk, t, warps, folded, bv=32, n_layers=6):
  """kda_verify's Triton IR at H heads of Dk = Dv, T rows (bf16 activations, n_layers stacked states)."""
  hd = h * dk
  cfg = KdaConfig(block_v=bv, num_warps=warps, epilogue_num_warps=warps)
  args = (S((1, t, 5, hd), jnp.bfloat16), S((1, t, h), jnp.bfloat16), S((h,), jnp.float32), S((hd,), jnp.float32),
          S((3, hd, 1, 4), jnp.bfloat16), S((n_layers, 1, 3, 3, hd), jnp.bfloat16),
          S((n_layers, 1, h, dk, dk), jnp.float32), S((), jnp.int32))
  with caught_triton_ir() as caught:
    lower_cuda(lambda w, *a: kda_verify(*a, config=cfg, o_norm=w if folded else None), S((dk,), jnp.bfloat16), *args)
  return own_locations(caught["kda_verify"])[0]


def ptxas_usage(ir, warps):
  """(registers, stack bytes, spill store bytes, spill load bytes) of the IR's kernel on sm_90a."""
  import triton
  from triton.backends.compiler import GPUTarget
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ir)
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    ptx = os.path.join(tmp, "kernel.ptx")
    with open(ptx, "w") as f:
      f.write(k.asm["ptx"])
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                         capture_output=True, text=True)
  text = out.stderr + out.stdout
  regs = re.search(r"Used (\d+) registers", text)
  stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
  if regs is None:
    raise RuntimeError(f"ptxas: {text[:2000]}")
  return (int(regs.group(1)),) + (tuple(int(x) for x in stack.groups()) if stack else (0, 0, 0))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", nargs="*", default=CASES, help="HxK:T:wWARPS:bvBV|folded")
  args = ap.parse_args()
  print(f"{'case':22s} {'regs':>5s} {'stack':>6s} {'spill st/ld':>12s} {'cycles':>8s} {'us':>6s} {'BAR':>4s} "
        f"{'instr':>6s}", flush=True)
  for case in args.cases:
    heads, t, warps, form = case.split(":")
    h, dk = (int(x) for x in heads.split("x"))
    folded = form == "folded"
    ir = verify_ir(h, dk, int(t), int(warps[1:]), folded, bv=32 if folded else int(form[2:]))
    regs, stack, st, ld = ptxas_usage(ir, int(warps[1:]))
    sass, _ = compile_sm90(ir, int(warps[1:]))
    cycles, _ = model(sass)
    counts = sass_counts(sass)
    print(f"{case:22s} {regs:5d} {stack:6d} {f'{st}/{ld}':>12s} {cycles:8d} {cycles / 1.98e3:6.2f} {counts['BAR']:4d} "
          f"{counts['instructions']:6d}", flush=True)


if __name__ == "__main__":
  main()
