#!/usr/bin/env bash
# Continuous batching on one device, demo model: output throughput and TPOT at concurrency 1, 2, 4, 8
# (bench_serving --concurrency-sweep against a server with --max-running-requests 8), and the concurrency-1
# baseline against a server with --max-running-requests 1 (the batch-1 programs alone, no scheduler), so the
# concurrency-1 TPOT of both is compared in one run. One persistent compilation cache for both servers.
# Usage: bash bench/batching_sweep.sh OUT_DIR [--batch8-only] [extra server flags]   (writes OUT_DIR/*.json, *.png, *.log)
# --batch8-only: skip the batch-1 server (one server start less; the summary then shows no batch-1 TPOT).
# e.g. bash bench/batching_sweep.sh $OUT/n2 --batch8-only --num-continuous-decode-steps 2
set -u
out=${1:?out dir}; shift
batch1=1
if [ "${1:-}" = --batch8-only ]; then batch1=0; shift; fi
mkdir -p "$out"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/ling-jax-batching-cache}
flags=(--model-path models/ling-demo --context-length 2048 --speculative-algorithm NEXTN --speculative-num-steps 3
       --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "$@")
bench=(--backend sglang --dataset-name random --tokenizer-free --random-input-len 128 --random-output-len 256
       --random-range-ratio 1 --seed 1)

source "$(dirname "$0")/serve_wait.sh"
serve() { local name=$1 port=$2; shift 2; start_server "$name" "$port" "$out/server-$name.log" "${flags[@]}" "$@"; }

if [ $batch1 = 1 ]; then
  serve batch1 30201 --max-running-requests 1 && \
    timeout 120 python3 -m bench.bench_serving --port 30201 "${bench[@]}" --concurrency-sweep 1 --num-prompts 24 \
      --output-file "$out/serving-sweep-batch1.json"
  kill $pid 2> /dev/null; wait $pid 2> /dev/null
fi
serve batch8 30202 --max-running-requests 8 && \
  timeout 240 python3 -m bench.bench_serving --port 30202 "${bench[@]}" --concurrency-sweep 1,2,4,8 --num-prompts 24 \
    --output-file "$out/serving-sweep-batch8.json"
kill $pid 2> /dev/null; wait $pid 2> /dev/null
python3 - "$out" <<'PY'
import json, os, sys
lv = json.load(open(f"{sys.argv[1]}/serving-sweep-batch8.json"))["levels"]
if os.path.exists(f"{sys.argv[1]}/serving-sweep-batch1.json"):
    one = json.load(open(f"{sys.argv[1]}/serving-sweep-batch1.json"))["levels"][0]
    print(f"concurrency-1 TPOT: batch-1 server {one['mean_tpot_ms']:.3f} ms, batching server {lv[0]['mean_tpot_ms']:.3f} "
          f"ms ({lv[0]['mean_tpot_ms'] / one['mean_tpot_ms'] - 1:+.1%}; target within 3 %)")
else:
    print(f"concurrency-1 TPOT: batching server {lv[0]['mean_tpot_ms']:.3f} ms (no batch-1 server in this run)")
for m in lv:
    print(f"  concurrency {m['max_concurrency']}: {m['output_throughput']:.0f} tok/s = {m['throughput_vs_first_level']:.2f}x, "
          f"TPOT {m['mean_tpot_ms']:.2f} ms (target at 8: >= 4x)")
PY
