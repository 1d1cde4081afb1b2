#!/usr/bin/env bash
# Continuous decode steps through the server, demo model, batch 1: a server with --num-continuous-decode-steps 1,
# then one per N in STEPS (default "4 8"), each checked first (a greedy and a seeded-sampled /generate reply must
# equal N = 1's token for token), then bench_serving at concurrency 1: TPOT and output throughput per N against
# N = 1 from the same run. One persistent compilation cache for all servers.
# Usage: bash bench/decode_steps_serving.sh OUT_DIR [extra server flags]      (writes OUT_DIR/*.json, *.png, *.log)
set -u
out=${1:?out dir}; shift
mkdir -p "$out"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/ling-jax-batching-cache}
flags=(--model-path models/ling-demo --context-length 2048 --speculative-algorithm NEXTN --speculative-num-steps 3
       --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --max-running-requests 1 "$@")
bench=(--backend sglang --dataset-name random --tokenizer-free --random-input-len 128 --random-output-len 256
       --random-range-ratio 1 --seed 1 --concurrency-sweep 1 --num-prompts 6)
check='{"input_ids": [5, 17, 99, 3, 42, 8], "sampling_params": {"max_new_tokens": 61, "ignore_eos": true, SAMPLING}}'

source "$(dirname "$0")/serve_wait.sh"
serve() {  # serve N PORT: a server with N steps per dispatch
  start_server "N=$1" "$2" "$out/server-n$1.log" "${flags[@]}" --num-continuous-decode-steps "$1"
}

for n in 1 ${STEPS:-4 8}; do
  port=$((30300 + n))
  serve "$n" "$port" && {
    for s in '"temperature": 0' '"temperature": 0.8, "top_p": 0.9, "seed": 5'; do
      curl -s "http://127.0.0.1:$port/generate" -H 'Content-Type: application/json' -d "${check/SAMPLING/$s}"
      echo
    done > "$out/check-n$n.jsonl"
    timeout 180 python3 -m bench.bench_serving --port "$port" "${bench[@]}" --output-file "$out/serving-n$n.json"
  }
  kill $pid 2> /dev/null; wait $pid 2> /dev/null
done
python3 - "$out" ${STEPS:-4 8} <<'PY'
import json, sys
out, steps = sys.argv[1], [1] + [int(n) for n in sys.argv[2:]]
def ids(n):  # the check replies' tokens (an error reply has no output_ids: KeyError)
    got = [json.loads(line)["output_ids"] for line in open(f"{out}/check-n{n}.jsonl")]
    assert [len(g) for g in got] == [61, 61], f"N={n}: {[len(g) for g in got]} tokens, not 61"
    return got

lv = {n: json.load(open(f"{out}/serving-n{n}.json"))["levels"][0] for n in steps}
base = lv[1]
print("N  same tokens as N=1 (greedy, sampled)  TPOT ms  vs N=1  output tok/s")
for n in steps:
    same = [a == b for a, b in zip(ids(n), ids(1))]
    m = lv[n]
    print(f"{n:<2} {str(same):<36} {m['mean_tpot_ms']:7.3f}  {m['mean_tpot_ms'] / base['mean_tpot_ms']:5.2f}x  "
          f"{m['output_throughput']:8.0f}")
PY
