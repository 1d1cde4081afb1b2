#!/usr/bin/env bash
# The GPU runs owed by CPU-only sessions, in ONE device call each (bench/issue11_gpu.sh's piece scheme: each piece
# under its own timeout sized from one deadline, continuing if the one before failed).
#   bash bench/gpu_pending.sh a OUTDIR TREE   (H100 or H200, ~8 min) merged without a GPU run, 2026-12-08:
#       fused_linear_fp8's unpadded scale TMA (3ff6a62: correctness at T = 6), KDA verify's 6-row chunks (df374c5:
#       kernels_kda at T = 6 / 17), then the DSpark vs NEXTN demo step with its kernel census (--profile)
#   bash bench/gpu_pending.sh b OUTDIR TREE   (H200: the full fp8 model, ~10 min) moe_fp8_tables (1c178f5..):
#       the kernel's check + time against the XLA chain, then the full fp8 step A/B (plain, NEXTN5, TTFT 8192)
# Output: OUTDIR/log and each bench's JSON; commit the JSONs under bench/results and cite them.
set -u
which=${1:?usage: bash bench/gpu_pending.sh a|b OUTDIR TREE}; out=${2:?OUTDIR}; tree=${3:?TREE}
mkdir -p "$out"; log="$out/log"; deadline=$((SECONDS + 560)); export PYTHONUNBUFFERED=1
piece() {
  local name=$1 cap=$2 reserve=$3 t0=$SECONDS; shift 3
  local lim=$((deadline - SECONDS - reserve)); ((lim > cap)) && lim=$cap
  if ((lim < 10)); then echo "== $name SKIPPED (${lim} s left)" >>"$log"; return; fi
  echo "== $name: timeout ${lim} s, $(date +%T): $*" >>"$log"
  timeout -s INT -k 5 "$lim" "$@" 2>&1 | grep -v "^WARNING: All log messages\|^I0000\|^W0000\|DeprecationWarning" >>"$log"
  echo "== $name: rc ${PIPESTATUS[0]} after $((SECONDS - t0)) s" >>"$log"
}
{ echo "gpu_pending.sh $which $(date -u +%FT%TZ) tree=$tree"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; } >"$log" 2>&1
case $which in
  a)
    piece "fused_linear_fp8 --quick" 120 330 python3 -m bench.kernels_fused_linear_fp8 --quick --ts 6 --out "$out" --tree "$tree"
    piece "kernels_kda T = 6, 17" 90 240 python3 -m bench.kernels_kda --ts 6,17 --out "$out" --tree "$tree"
    piece "bench_dspark --profile" 340 0 python3 -m bench.bench_dspark --profile --out "$out" ;;
  b)
    piece "kernels_moe_fp8 tables vs XLA chain" 150 400 python3 -m bench.kernels_moe_fp8 --out "$out" --ts 6,1,17 \
      --variants "fp8 partial-bits registers n16 ks6,fp8 partial-bits registers n16 ks6 tables"
    piece "bench_step fp8 full model, moe_fp8_tables A/B" 560 0 python3 -m bench.bench_step --quantization fp8 --tp 1 \
      --steps 5 --reps 10 --ttft 8192 --moe-fp8-tables --baseline-set moe_fp8_tables=0 --tree "$tree" --out "$out" ;;
  *) echo "unknown call $which (a or b)" >&2; exit 2 ;;
esac
echo "== done after $SECONDS s" >>"$log"; tail -c 9000 "$log"
