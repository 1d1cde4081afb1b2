#!/usr/bin/env bash
# Continuous batching on one device, demo model: output throughput and TPOT at concurrency 1, 2, 4, 8
# (bench_serving --concurrency-sweep against a server with --max-running-requests 8), and the concurrency-1
# baseline against a server with --max-running-requests 1 (the batch-1 programs alone, no scheduler).
# Both servers run at once (each with 45 % of the device's memory), and their concurrency-1 runs alternate
# (batch-1, batching, x ROUNDS), so a drift of the host (the demo step is host-bound) lands on both: the summary
# compares the medians of the alternated runs. One persistent compilation cache for both servers.
# Usage: bash bench/batching_sweep.sh OUT_DIR [--batch8-only] [extra server flags]   (writes OUT_DIR/*.json, *.png, *.log)
# --batch8-only: skip the batch-1 server (the summary then shows no batch-1 TPOT).  ROUNDS=3 by default.
# e.g. bash bench/batching_sweep.sh $OUT/n2 --batch8-only --num-continuous-decode-steps 2
set -u
out=${1:?out dir}; shift
batch1=1
if [ "${1:-}" = --batch8-only ]; then batch1=0; shift; fi
rounds=${ROUNDS:-3}
mkdir -p "$out"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/ling-jax-batching-cache}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}
flags=(--model-path models/ling-demo --context-length 2048 --speculative-algorithm NEXTN --speculative-num-steps 3
       --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "$@")
bench=(--backend sglang --dataset-name random --tokenizer-free --random-input-len 128 --random-output-len 256
       --random-range-ratio 1 --seed 1)

source "$(dirname "$0")/serve_wait.sh"
serve() { local name=$1 port=$2; shift 2; start_server "$name" "$port" "$out/server-$name.log" "${flags[@]}" "$@"; }
pids=()
trap 'kill ${pids[@]} 2> /dev/null; wait 2> /dev/null' EXIT

serve batch8 30202 --max-running-requests 8 || exit 1
pids+=($pid)
if [ $batch1 = 1 ]; then
  serve batch1 30201 --max-running-requests 1 || exit 1
  pids+=($pid)
  for r in $(seq "$rounds"); do  # alternated concurrency-1 runs: batch-1 server, then the batching server
    for s in batch1:30201 batch8:30202; do
      timeout 120 python3 -m bench.bench_serving --port "${s#*:}" "${bench[@]}" --concurrency-sweep 1 --num-prompts 24 \
        --output-file "$out/serving-conc1-${s%:*}-r$r.json" > "$out/conc1-${s%:*}-r$r.log" 2>&1 || echo "conc-1 ${s%:*} r$r failed"
    done
  done
fi
timeout 240 python3 -m bench.bench_serving --port 30202 "${bench[@]}" --concurrency-sweep 1,2,4,8 --num-prompts 24 \
  --output-file "$out/serving-sweep-batch8.json"
python3 - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
lv = json.load(open(f"{out}/serving-sweep-batch8.json"))["levels"]
def conc1(name):
    runs = [json.load(open(p))["levels"][0] for p in sorted(glob.glob(f"{out}/serving-conc1-{name}-r*.json"))]
    return [r["mean_tpot_ms"] for r in runs], [r["mean_ttft_ms"] for r in runs]
one, one_ttft = conc1("batch1")
if one:
    b8, b8_ttft = conc1("batch8")
    m1, m8 = statistics.median(one), statistics.median(b8)
    print(f"concurrency-1 TPOT, alternated runs: batch-1 server {', '.join(f'{x:.3f}' for x in one)} ms; batching "
          f"server {', '.join(f'{x:.3f}' for x in b8)} ms; medians {m1:.3f} vs {m8:.3f} ({m8 / m1 - 1:+.1%}; target "
          f"within 3 %)")
    print(f"concurrency-1 TTFT medians: batch-1 {statistics.median(one_ttft):.2f} ms, batching "
          f"{statistics.median(b8_ttft):.2f} ms")
    json.dump({"batch1_tpot_ms": one, "batch8_tpot_ms": b8, "batch1_ttft_ms": one_ttft, "batch8_ttft_ms": b8_ttft,
               "median_ratio": m8 / m1}, open(f"{out}/conc1-alternated.json", "w"), indent=1)
else:
    print(f"concurrency-1 TPOT: batching server {lv[0]['mean_tpot_ms']:.3f} ms (no batch-1 server in this run)")
for m in lv:
    print(f"  concurrency {m['max_concurrency']}: {m['output_throughput']:.0f} tok/s = {m['throughput_vs_first_level']:.2f}x, "
          f"TPOT {m['mean_tpot_ms']:.2f} ms (target at 8: >= 4x)")
PY
