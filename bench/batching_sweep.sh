#!/usr/bin/env bash
# Continuous batching on one device, demo model: output throughput and TPOT at concurrency 1, 2, 4, 8
# (bench_serving --concurrency-sweep against a server with --max-running-requests 8), and the concurrency-1
# baseline against a server with --max-running-requests 1 (the batch-1 programs alone, no scheduler).
# Both servers run at once (each with 45 % of the device's memory), and their concurrency-1 runs alternate
# (batch-1, batching, x ROUNDS), so a drift of the host (the demo step is host-bound) lands on both: the summary
# compares the medians of the alternated runs. One persistent compilation cache for both servers.
#
# Usage: bash bench/batching_sweep.sh OUT_DIR [--batch8-only] [--timed] [--vlog] [--trivial] [extra server flags]
#   --batch8-only: skip the batch-1 server (the summary then shows no batch-1 TPOT).
#   Environment: ROUNDS (alternated concurrency-1 rounds, 4, after one discarded warm-up run per server), PROMPTS
#   (prompts per level of the sweep, 24), PROMPTS1 (prompts per concurrency-1 run, 48: a 24-prompt run lasts ~1.5 s).
#   --timed: both servers run through bench/serve_host_overhead.py --serve (the real model; every step program call
#     and device_get timed, ~2 us each): the summary splits each run's per-step interval into the step program's
#     call (host dispatch), the one-step-late read (the wait for the device) and the rest (the Python around them).
#   --vlog: --timed, with XLA's command-buffer VLOG in the server logs: the summary counts each server's CUDA-graph
#     re-recordings ("Update command buffer") against its step calls.
#   --trivial: --timed with trivial step and prefill programs (bench/serve_host_overhead.trivial_steps: 3 tokens
#     per step, no model compute): the servers' host path alone. The CPU smoke run of this script (a 2-core host,
#     ~30 s: PROMPTS=4 PROMPTS1=4 ROUNDS=2 bash bench/batching_sweep.sh /tmp/sweep-cpu --trivial); its TPOTs are the
#     host's per-step cost, not the model's.
# Writes three files (the device returns at most 8): OUT_DIR/summary.json (the alternated concurrency-1 TPOT / TTFT,
# the sweep's levels, with --timed the per-step split per run), OUT_DIR/sweep.log (this script's output) and
# OUT_DIR/runs.tar.gz (every bench_serving JSON + PNG, the servers' and clients' logs, the step timings).
# e.g. bash bench/batching_sweep.sh $OUT/n2 --batch8-only --num-continuous-decode-steps 2
# Time on an H100 (2026-12-07, cold compilation cache): both servers up after ~225 s (the batching one ~190 s, the
# batch-1 one loading most of its programs from the shared cache), then ~1-2 min of runs at PROMPTS=24 ROUNDS=3.
set -u
cmdline="bash bench/batching_sweep.sh $*"
out=${1:?out dir}; shift
batch1=1; timed=0; vlog=0; accept=0  # accept: tokens per trivial step (0: the real model)
while [ $# -gt 0 ]; do
  case "$1" in
    --batch8-only) batch1=0 ;;
    --timed) timed=1 ;;
    --vlog) vlog=1; timed=1 ;;
    --trivial) accept=3; timed=1 ;;
    *) break ;;
  esac
  shift
done
rounds=${ROUNDS:-4}; prompts=${PROMPTS:-24}; prompts1=${PROMPTS1:-48}
runs=$out/runs
mkdir -p "$runs"
exec > >(tee "$out/sweep.log") 2>&1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/ling-jax-batching-cache}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}
flags=(--model-path models/ling-demo --context-length 2048 --speculative-algorithm NEXTN --speculative-num-steps 3
       --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "$@")
bench=(--backend sglang --dataset-name random --tokenizer-free --random-input-len 128 --random-output-len 256
       --random-range-ratio 1 --seed 1)

source "$(dirname "$0")/serve_wait.sh"
serve() {
  local name=$1 port=$2; shift 2
  if [ $timed = 1 ]; then
    if [ $vlog = 1 ]; then export TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0; fi
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} start_command "$name" "$port" "$runs/server-$name.log" \
      python3 bench/serve_host_overhead.py --serve $accept 0 0 "$runs/steps-$name.json" --port "$port" "${flags[@]}" "$@"
    unset TF_CPP_VMODULE TF_CPP_MIN_LOG_LEVEL
  else
    start_server "$name" "$port" "$runs/server-$name.log" "${flags[@]}" "$@"
  fi
}
pids=()
# on exit: end the servers still up (wait names them: a bare wait would also wait for the tee above, forever)
trap '[ ${#pids[@]} -gt 0 ] && { kill ${pids[@]} 2> /dev/null; wait ${pids[@]} 2> /dev/null; }' EXIT

serve batch8 30202 --max-running-requests 8 || exit 1
pids+=($pid)
if [ $batch1 = 1 ]; then
  serve batch1 30201 --max-running-requests 1 || exit 1
  pids+=($pid)
  # warm-up: one discarded concurrency-1 run per server first. On 2026-12-07 (H100, ROUNDS=4, 24 prompts a run) the
  # batching server's first two rounds ran at 0.354 / 0.328 ms TPOT and its last two at 0.246 / 0.264 (the batch-1
  # server 0.21-0.26 throughout): whatever the first requests after start-up pay, it is not the steady state
  for s in batch1:30201 batch8:30202; do
    timeout 120 python3 -m bench.bench_serving --port "${s#*:}" "${bench[@]}" --concurrency-sweep 1 --num-prompts "$prompts1" \
      --output-file "$runs/warmup-conc1-${s%:*}.json" > "$runs/warmup-conc1-${s%:*}.log" 2>&1 || echo "warm-up ${s%:*} failed"
  done
  for r in $(seq "$rounds"); do  # alternated concurrency-1 runs: batch-1 server, then the batching server
    for s in batch1:30201 batch8:30202; do
      timeout 120 python3 -m bench.bench_serving --port "${s#*:}" "${bench[@]}" --concurrency-sweep 1 --num-prompts "$prompts1" \
        --output-file "$runs/serving-conc1-${s%:*}-r$r.json" > "$runs/conc1-${s%:*}-r$r.log" 2>&1 || echo "conc-1 ${s%:*} r$r failed"
    done
  done
fi
timeout 240 python3 -m bench.bench_serving --port 30202 "${bench[@]}" --concurrency-sweep 1,2,4,8 --num-prompts "$prompts" \
  --output-file "$runs/serving-sweep-batch8.json"
kill -TERM ${pids[@]} 2> /dev/null  # a timed server writes its step timings as it exits (uvicorn: <= 5 s)
for _ in $(seq 60); do kill -0 ${pids[@]} 2> /dev/null || break; sleep 0.5; done
kill -KILL ${pids[@]} 2> /dev/null
wait ${pids[@]} 2> /dev/null
pids=()
python3 -m bench.batching_sweep_summary "$out" --command "$cmdline"
tar -czf "$out/runs.tar.gz" -C "$out" runs && rm -rf "$runs"
echo "sweep done after ${SECONDS}s"
ls -la "$out"
