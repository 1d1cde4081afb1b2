#!/usr/bin/env bash
# DSpark draft for models/ling-demo trained with the eval's anchors (issue 15), then the real step on one GPU:
# bench.eval_accept (bf16, static verify, the 16 held-out prompts of 64 tokens, 200 greedy new tokens) for the new
# draft, the shipped models/ling-demo-dspark and NEXTN steps 5, in ONE run (same prompts, same plain-greedy rows).
# Training: anchors in the first 200 generated positions after the pool's 64-token prompt (--anchor-window 200,
# --seq 288 = 64 + 200 + 16 + 8), a 65536-text pool (each text seen ~4 times), else the v2c recipe.
# Usage (repo root, carry .data; also bench/dspark_anchors_gpu.sh), $OUT the output dir:
#   bash .data/gpu_dspark.sh [TRAIN_S=300] [PROMPTS=16] [POOL=65536] [EVAL_S=220]
# CPU flag check: OUT=/tmp/x PYTHON=.venv/bin/python JAX_PLATFORMS=cpu bash .data/gpu_dspark.sh 150 1 64 500
set -u
out=${OUT:?set OUT}; train_s=${1:-300}; prompts=${2:-16}; pool=${3:-65536}; eval_s=${4:-220}
py=${PYTHON:-python3}
mkdir -p "$out/draft" "$out/eval"
t0=$(date +%s)
train=(--target models/ling-demo --data .data/code-v2-tokens --out "$out/draft" --steps 100000
       --time-budget $((train_s - 20)) --batch 16 --seq 288 --anchors 32 --block-size 16 --accept-weight 0.5
       --distill-seqs "$pool" --distill-prompt 64 --distill-batch 4096 --distill-fraction 0.75 --anchor-window 200
       --eval-prompts 16 --eval-new-tokens 200 --compile-threads 3 --seed 0)
timeout -s INT -k 20 "$train_s" "$py" -m ling_jax.train.dspark "${train[@]}" > "$out/train.log" 2>&1
echo "trainer rc $? at $(( $(date +%s) - t0 )) s"
grep -E "^(compiled|greedy texts|wrote|warning)|Error" "$out/train.log" | cut -c1-240
grep "^step" "$out/train.log" | tail -1
ev=(--model models/ling-demo --data .data/code-v2-tokens --dtype bfloat16 --prompts "$prompts" --new-tokens 200
    --steps 5 --eval-windows 8 --dspark "$out/draft,models/ling-demo-dspark" --dspark-verify static --out "$out/eval")
timeout -k 10 "$eval_s" "$py" -m bench.eval_accept "${ev[@]}" > "$out/eval.log" 2>&1
echo "eval rc $? at $(( $(date +%s) - t0 )) s"
grep -E "^(steps=|DSPARK|plain)|Error" "$out/eval.log" | cut -c1-200
rm -f "$out"/eval/*.png
"$py" - "$out" <<'PY'
import glob, json, sys
out = sys.argv[1]
m = json.load(open(f"{out}/draft/metrics.json"))
f = m["final"]
print(f"new draft: {m['steps']} steps, {m['step_ms']:.1f} ms/step, pool {m['greedy_s']:.0f} s, compiles "
      f"{sum(m['compile_s'].values()):.0f} s, pool epochs {m['pool_epochs']:.1f}, anchors {m['anchor_range']}")
print("trainer held-out (teacher-forced): eval anchors walk %.3f / every anchor %.3f; old greedy windows %.3f"
      % (f.get("heldout_eval_walk_accept", float("nan")), f.get("heldout_eval_greedy_accept", float("nan")),
         f.get("heldout_greedy_greedy_accept", float("nan"))))
for p in glob.glob(f"{out}/eval/eval-accept-*.json"):
    r = json.load(open(p))
    print(f"| drafter ({r['device']} {r['dtype']}, {r['prompts']} prompts x {r['new_tokens']}) | accept | pos 1-4 | "
          f"tok/s | lossless |")
    for row in r["rows"]:
        if row["steps"] == 0:
            continue
        name = "NEXTN steps %d" % row["steps"] if row["algorithm"] == "NEXTN" else \
            "DSPARK %s %s" % (row["dspark_draft"], row["dspark_verify"])
        pos = ", ".join(f"{x:.3f}" for x in row["acceptance_rate_per_position"][:4])
        print(f"| {name} | {row['mean_accept_length']:.3f} | {pos} | {row['decode_tokens_per_s']:.0f} | "
              f"{row['lossless_prompts']}/{r['prompts']} |")
PY
ls "$out" "$out/draft" "$out/eval"
