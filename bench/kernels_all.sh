#!/usr/bin/env bash
# The new kernels' GPU checks and timings in one device call (each bench checks against the model's jnp first
# and exits non-zero on a mismatch). Usage: bash bench/kernels_all.sh $OUT [seconds per bench]
set -u
out=${1:?out dir}; lim=${2:-150}
for b in kernels_fused_linear kernels_head_mla kernels_moe_fp8; do
  echo "== $b"; PYTHONUNBUFFERED=1 timeout -s INT "$lim" python3 -m bench.$b --out "$out" 2>&1 \
    | grep -v "^WARNING\|^I0000\|^W0000" | tail -40 || echo "FAILED ($?): $b"
done
