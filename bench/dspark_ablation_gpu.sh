#!/usr/bin/env bash
# DSpark draft for models/ling-demo on one GPU, with and without the acceptance-aware loss term in the SAME budget:
# both trainers run at once (same device share, same time budget, same pool size and seed), then the real
# DSpark step's accept length of each (bench.eval_accept, bf16, the 16 held-out prompts, 200 new tokens), NEXTN
# steps 5 alongside in the first eval (its tok/s are measured alone; the second eval runs after it).
# Usage: bash bench/dspark_ablation_gpu.sh OUT BUDGET_S POOL_SEQS      (needs .data/code-v2-tokens)
set -u
out=${1:?out}; budget=${2:-270}; pool=${3:-32768}
mkdir -p "$out/accept" "$out/plain"
common=(--target models/ling-demo --data .data/code-v2-tokens --steps 100000 --time-budget "$budget" --batch 16
        --seq 512 --anchors 32 --block-size 16 --distill-seqs "$pool" --distill-prompt 64 --distill-batch 1024
        --distill-fraction 0.75 --compile-threads 3 --seed 0)
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
t0=$(date +%s)
timeout -s INT -k 20 $((budget + 25)) python3 -m ling_jax.train.dspark "${common[@]}" --accept-weight 0.5 \
  --out "$out/accept/d" > "$out/train-accept.log" 2>&1 &
a=$!
timeout -s INT -k 20 $((budget + 25)) python3 -m ling_jax.train.dspark "${common[@]}" --accept-weight 0 \
  --out "$out/plain/d" > "$out/train-plain.log" 2>&1 &
b=$!
wait $a; echo "accept-aware trainer rc $? at $(( $(date +%s) - t0 )) s"
wait $b; echo "plain-loss trainer rc $? at $(( $(date +%s) - t0 )) s"
unset XLA_PYTHON_CLIENT_MEM_FRACTION
ev=(--model models/ling-demo --data .data/code-v2-tokens --dtype bfloat16 --new-tokens 200)
timeout 200 python3 -m bench.eval_accept "${ev[@]}" --steps 5 --eval-windows 8 --dspark "$out/accept/d" \
  --dspark-verify static,confidence --out "$out/accept" > "$out/eval-accept.log" 2>&1
echo "eval (accept-aware) rc $? at $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m bench.eval_accept "${ev[@]}" --steps 1 --eval-windows 1 --dspark "$out/plain/d" \
  --dspark-verify static --out "$out/plain" > "$out/eval-plain.log" 2>&1
echo "eval (plain loss) rc $? at $(( $(date +%s) - t0 )) s"
for f in train-accept train-plain eval-accept eval-plain; do
  echo "== $f"; grep -v "^step" "$out/$f.log" | tail -8; grep "^step" "$out/$f.log" | tail -2
done
rm -f "$out"/*/*.png "$out/plain/d/model.safetensors"
