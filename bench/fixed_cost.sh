#!/usr/bin/env bash
# The fixed-cost measurements of one H200 in one call: the demo model (pure fixed cost) and the 12-layer slice,
# each with XLA's PDL flags off and on (A/B in the same run; XLA flags are read at backend start, so one process
# each). Usage (device): bash bench/fixed_cost.sh $OUT [extra bench_step args]
set -u
out=${1:?out dir}; shift
pdl="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"
run() { echo "== $*"; PYTHONUNBUFFERED=1 timeout 140 python3 -m bench.bench_step --out "$out" "$@" || echo "FAILED ($?): $*"; }
run --model models/ling-demo --steps 5 --reps 30 --dump-hlo "$@"
XLA_FLAGS="$pdl" run --model models/ling-demo --steps 5 --reps 30 --tag=-xla-pdl "$@"
run --layers 12 --steps 5 --reps 10 "$@"
XLA_FLAGS="$pdl" run --layers 12 --steps 5 --reps 10 --tag=-xla-pdl --no-census "$@"
# command buffers around every kernel (the staged compiler's options), demo model: does the host gap close?
XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
  run --model models/ling-demo --steps 5 --reps 30 --tag=-cmdbuf "$@"
