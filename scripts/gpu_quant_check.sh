#!/usr/bin/env bash
# H200 pass for the quantizers after a change to their kernels or defaults: the quantizer and FP8
# GEMM tests on the GPU, the quantization benchmark (x the device copy in the same run), the MXFP4
# two-copy candidates matching TUNE_MATCH, and the FP8 linear step's kernels.
#   bash scripts/gpu_quant_check.sh OUT      (at most eight files come back: logs are merged)
set -uo pipefail
OUT=${1:?usage: gpu_quant_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } \
    > "$OUT/gpu.txt" 2>&1
timeout "${QC_TEST_S:-240}" $PY -m pytest -q -n 8 -p no:cacheprovider tests/triton/test_quant_fp8_packed.py \
    tests/triton/test_quant_fp4_packed.py tests/pytorch/ops/test_quantization.py tests/pytorch/ops/test_gemm_fp8.py \
    > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"
timeout "${QC_BENCH_S:-180}" $PY benchmarks/bench_quantization.py --out "$OUT" > "$OUT/run.log" 2>&1
echo "bench rc=$?"
if [ -n "${TUNE_MATCH:-tscale}" ]; then
  timeout "${QC_TUNE_S:-100}" $PY scripts/tune_quant.py --out "$OUT" --only fp4_with_trans \
      --shapes 16384x7168 8192x14336 --match ${TUNE_MATCH:-tscale} >> "$OUT/run.log" 2>&1
  echo "tune rc=$?"
fi
timeout "${QC_LINEAR_S:-120}" $PY scripts/diag_fp8_linear.py --out "$OUT" >> "$OUT/run.log" 2>&1
echo "linear rc=$?"
grep "^| quantize" "$OUT/quantization.md" 2>/dev/null | awk -F'|' '{print $3, $5, $6, $9}' | head -60
grep -E "fp4_with_trans|best" "$OUT/run.log" | tail -12
grep -iE "step|total" "$OUT/diag_fp8_linear.txt" 2>/dev/null | head -12
