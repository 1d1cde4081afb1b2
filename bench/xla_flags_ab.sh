#!/usr/bin/env bash
# A/B of XLA's command-buffer (CUDA graph) update modes on the demo model's steps: is the host's per-step
# dispatch (graph update of every kernel node when a buffer address changes) the fixed cost? One process per
# flag set (XLA reads its flags at backend start). Usage (device): bash bench/xla_flags_ab.sh $OUT [cb|multistep]
set -u
out=${1:?out dir}; shift
run() { tag=$1; flags=$2; shift 2; echo "== $tag: XLA_FLAGS=$flags $*"; XLA_FLAGS="$flags" PYTHONUNBUFFERED=1 timeout 120 \
  python3 -m bench.bench_step --out "$out" --model models/ling-demo --steps 5 --reps 30 --no-census --tag="$tag" "$@" \
  2>&1 | grep -vE "^\s+File|^W0000|^I0000|^HBM|^params|^wrote" | tail -8; }
case "${1:-cb}" in
cb)  # command-buffer update modes (2026-12-01: none helped; the step is host-bound at ~1.1-1.4 ms either way)
  run -cb-default ""
  run -cb-skip-temp "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  run -cb-skip-profiled "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
  run -cb-off "--xla_gpu_enable_command_buffer="
  run -cb-default-again "" ;;
multistep)  # N steps per dispatch (lax.scan inside one program), with and without the while loop in a CUDA graph
  wl="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
  run -ms1 ""
  run -ms8 "" --multi-step 8
  run -ms8-graph "$wl" --multi-step 8
  run -ms1-again "" ;;
esac
