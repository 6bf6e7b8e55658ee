#!/usr/bin/env bash
# H200 check of the quantizers' direct launches (session 38): their GPU tests, the FP8 linear
# step's host time at attn_out / qkv (scripts/diag_fp8_linear_host.py) and the FP8 linear step at
# the four Llama-3.1-8B shapes (scripts/gpu_fp8_linear_check.sh's linear stage).
#
#   bash scripts/gpu_fp8_host_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_fp8_host_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
timeout "${FH_TEST_S:-150}" $PY -m pytest -q -n 8 -p no:cacheprovider tests/pytorch/ops/test_quantization.py \
    tests/triton/test_quant_fp8_packed.py tests/pytorch/ops/test_gemm_fp8.py tests/triton/test_launch.py \
    > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head; tail -1 "$OUT/pytest.log"
for g in TENSORWISE BLOCKWISE; do
  for n in 4096 6144; do
    timeout 60 $PY scripts/diag_fp8_linear_host.py --n $n --gran $g > "$OUT/host_${g}_n$n.log" 2>&1
    echo "host rc=$? $(head -1 "$OUT/host_${g}_n$n.log")"
  done
done
FL_STAGES=linear bash "$(dirname "$0")/gpu_fp8_linear_check.sh" "$OUT/fp8lin"
