#!/usr/bin/env bash
# H200 diagnosis of two rows of session 38's pass: the FP8 linear step at Llama-3.1-8B attn_out
# (16384 x 4096 x 4096: 1.05x / 1.13x BF16 where qkv reads 1.63x / 1.39x) and moe_permute from
# top-k indices at 16384 x 7168 top-8 of 32 (0.83x the device copy; 1.08x in session 25).
#
#   bash scripts/gpu_diag_attn_out_permute.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_diag_attn_out_permute.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
gpu_run_header "$OUT/header.log"
for shape in "4096 4096" "6144 4096"; do
  set -- $shape
  timeout 150 $PY scripts/diag_fp8_linear.py --out "$OUT/lin_n$1" --m 16384 --n "$1" --k "$2" > "$OUT/lin_n$1.log" 2>&1
  echo "linear n=$1 rc=$?"; cat "$OUT/lin_n$1.log"
done
timeout 120 $PY scripts/diag_permute_indices.py > "$OUT/permute.log" 2>&1
echo "permute rc=$?"; cat "$OUT/permute.log"
