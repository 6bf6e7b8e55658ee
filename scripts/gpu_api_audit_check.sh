#!/usr/bin/env bash
# H200 pass confirming the reference-API audit's changes (session 37): the GPU tests whose
# expectations changed (module SNR bars, single-operand FP8 / MXFP4 gradients, the N-D quantizers,
# the masked permute / unpermute kernels), then the permute benchmark (expected unchanged by the
# masking) and the FP8 linear step at the four Llama-3.1-8B shapes (scripts/gpu_fp8_linear_check.sh).
#
#   bash scripts/gpu_api_audit_check.sh OUT
#
# Stages (AA_STAGES, default all): tests permute linear. Time limits AA_TEST_S, AA_PERM_S, FL_LINEAR_S.
set -uo pipefail
OUT=${1:?usage: gpu_api_audit_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
gpu_run_header "$OUT/header.log"
cat "$OUT/header.log"
STAGES=" ${AA_STAGES:-tests permute linear} "

if [[ $STAGES == *" tests "* ]]; then
  timeout "${AA_TEST_S:-240}" $PY -m pytest -q -n 8 -p no:cacheprovider -rf \
      tests/pytorch/modules/test_modules.py tests/pytorch/ops/test_gemm_fp8.py tests/pytorch/ops/test_gemm_fp4.py \
      tests/pytorch/ops/test_grouped_gemm_fp8.py tests/pytorch/ops/test_grouped_gemm_fp4.py \
      tests/pytorch/ops/test_quantization.py tests/pytorch/core/test_quantized_tensor.py \
      tests/pytorch/ops/test_moe_permute.py tests/pytorch/ops/test_moe_permute_primus.py \
      tests/pytorch/ops/test_moe_router.py tests/triton/test_permute_map_kernel.py \
      -k "${AA_TEST_K:-not nothing_deselected}" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -20; tail -2 "$OUT/pytest.log"
fi
if [[ $STAGES == *" permute "* ]]; then
  timeout "${AA_PERM_S:-120}" $PY benchmarks/bench_moe_permute.py --out "$OUT/permute" > "$OUT/permute.log" 2>&1
  echo "permute rc=$?"; tail -30 "$OUT/permute.log"
fi
if [[ $STAGES == *" linear "* ]]; then
  FL_STAGES=linear bash "$(dirname "$0")/gpu_fp8_linear_check.sh" "$OUT/fp8lin"
fi
