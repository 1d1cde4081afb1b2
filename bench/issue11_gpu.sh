#!/usr/bin/env bash
# Issue 11's GPU pieces in ONE device call on one H200, in this order (each continues if the one before failed):
#   (a) the v2 demo step (models/ling-demo), fused projections on vs off, 8 steps per dispatch
#   (c) the kernel wiring check at Ling-3.0-flash dims against the XLA-only model, with and without fused
#       projections: --layers 6 (one layer group: 5 KDA + 1 MLA; a 4-layer slice of Ling is all MLA, no KDA)
#   (d) the KDA kernel bench (T = 1, 6) and the fp8 fused-linear kernel bench (T = 6, the default fp8 tiles,
#       both scale placements)
#   (b) the 12-layer Ling slice's NEXTN5 step at ctx 8192, fused projections on vs off (--skip-plain: its plain
#       step pair would not fit; the routing of the floor from the earlier 12-layer run, no capture compile)
# Every piece runs under its own `timeout` (SIGINT, then SIGKILL 5 s later), sized from one deadline: a piece gets
# min(its cap, the time left minus what the pieces after it keep in reserve), so a piece that ends early leaves
# its time to (b), and the whole script ends within ~330 s. The benches rewrite their JSON after each row, so a
# piece cut short keeps its finished rows. Output (5 files): OUTDIR/issue11.log (all pieces' output) and the
# JSONs step-ling-demo-kdaverify-fl-*, kernels-kda-*, kernels-fused-linear-fp8-*, step-kdaverify-fl-*.
#
#   bash bench/issue11_gpu.sh OUTDIR [TREE]    (TREE: the commit being run, recorded in each JSON's `tree`;
#                                               default: the copy's git HEAD, which may be stale)
set -u
out=${1:?usage: bash bench/issue11_gpu.sh OUTDIR [TREE]}
tree=${2:-}
mkdir -p "$out"
log="$out/issue11.log"
deadline=$((SECONDS + 325))
export PYTHONUNBUFFERED=1
tree_args=()
[ -n "$tree" ] && tree_args=(--tree "$tree")

# piece NAME CAP RESERVE CMD...: CMD under timeout min(CAP, deadline - now - RESERVE), its output appended to the log
piece() {
  local name=$1 cap=$2 reserve=$3 t0=$SECONDS
  shift 3
  local lim=$((deadline - SECONDS - reserve))
  ((lim > cap)) && lim=$cap
  if ((lim < 10)); then
    echo "== $name SKIPPED (${lim} s left)" >>"$log"
    return
  fi
  echo "== $name: timeout ${lim} s, $(date +%T): $*" >>"$log"
  timeout -s INT -k 5 "$lim" "$@" 2>&1 | grep -v "^WARNING: All log messages\|^I0000\|^W0000\|DeprecationWarning\|return rule(" >>"$log"
  echo "== $name: rc ${PIPESTATUS[0]} after $((SECONDS - t0)) s" >>"$log"
}

{
  echo "issue11_gpu.sh $(date -u +%FT%TZ) tree=${tree:-"(none given; git HEAD $(git rev-parse HEAD 2>/dev/null))"}"
  { nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; } 2>&1 | head -2
} >"$log"

piece "(a) demo step, fused vs not, multi-step 8" 95 230 \
  python3 -m bench.bench_step --model models/ling-demo --steps 5 --reps 30 --fused-linear --baseline-fused-linear \
  --multi-step 8 --out "$out" ${tree_args[@]+"${tree_args[@]}"}
piece "(c) check_gpu_wiring, 6 Ling layers" 65 165 \
  python3 -m bench.check_gpu_wiring --layers 6 --tp 1 --fused-linear
piece "(d) kernels_kda" 40 125 \
  python3 -m bench.kernels_kda --out "$out" --ts 1,6 ${tree_args[@]+"${tree_args[@]}"}
piece "(d) kernels_fused_linear_fp8" 40 85 \
  python3 -m bench.kernels_fused_linear_fp8 --out "$out" --ts 6 --configs 1cta-k128 ${tree_args[@]+"${tree_args[@]}"}
piece "(b) 12-layer Ling slice NEXTN5, fused vs not" 600 0 \
  python3 -m bench.bench_step --layers 12 --tp 1 --steps 5 --reps 10 --skip-plain --fused-linear \
  --baseline-fused-linear --routing-from bench/results/step-h200x1-2026-12-01.json --out "$out" ${tree_args[@]+"${tree_args[@]}"}
echo "== done after $SECONDS s; files: $(ls "$out" | tr '\n' ' ')" >>"$log"
