#!/usr/bin/env bash
# H200 follow-up of session 38's attn_out diagnosis (the FP8 linear step there is host-bound: GPU
# busy 1.46 of 2.02 ms): the step's host time and CPU profile at attn_out and qkv, TENSORWISE and
# BLOCKWISE; then moe_permute from top-k indices per kernel (scripts/diag_permute_indices.py).
#
#   bash scripts/gpu_diag_fp8_host_permute.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_diag_fp8_host_permute.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
for g in TENSORWISE BLOCKWISE; do
  for n in 4096 6144; do
    timeout 90 $PY scripts/diag_fp8_linear_host.py --n $n --gran $g > "$OUT/host_${g}_n$n.log" 2>&1
    echo "host $g n=$n rc=$?"; head -40 "$OUT/host_${g}_n$n.log"
  done
done
timeout 120 $PY scripts/diag_permute_indices.py > "$OUT/permute.log" 2>&1
echo "permute rc=$?"; cat "$OUT/permute.log"
