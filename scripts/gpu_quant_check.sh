#!/usr/bin/env bash
# H200 pass for the quantizers after a change to their kernels or defaults: the quantizer, FP8 and
# FP4 GEMM tests on the GPU, the quantization benchmark under do_bench and in device time (x the
# device copy in the same run), the two-copy candidates matching TUNE_MATCH (default tscale; empty: none), and
# the FP8 linear step's kernels.   bash scripts/gpu_quant_check.sh OUT
# (at most eight files come back: the logs are merged into run.log)
set -uo pipefail
OUT=${1:?usage: gpu_quant_check.sh OUT}
mkdir -p "$OUT/eager" "$OUT/graph"
source "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/run.log"
gpu_run_header "$LOG"
timeout "${QC_TEST_S:-240}" $PY -m pytest -q -n 8 -p no:cacheprovider tests/triton/test_quant_fp8_packed.py \
    tests/triton/test_quant_fp4_packed.py tests/pytorch/ops/test_quantization.py tests/pytorch/ops/test_gemm_fp8.py \
    tests/pytorch/ops/test_gemm_fp4.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"
timeout "${QC_BENCH_S:-150}" $PY benchmarks/bench_quantization.py --out "$OUT/eager" >> "$LOG" 2>&1
echo "bench rc=$?"
timeout "${QC_BENCH_S:-150}" $PY benchmarks/bench_quantization.py --timing graph --out "$OUT/graph" >> "$LOG" 2>&1
echo "bench graph rc=$?"
if [ -n "${TUNE_MATCH-tscale}" ]; then
  timeout "${QC_TUNE_S:-150}" $PY scripts/tune_quant.py --out /tmp/tune_quant_out --only with_trans_blockwise \
      with_trans_mx --shapes 16384x7168 8192x14336 --match ${TUNE_MATCH-tscale} >> "$LOG" 2>&1
  echo "tune rc=$?"
fi
timeout "${QC_LINEAR_S:-120}" $PY scripts/diag_fp8_linear.py --out "$OUT" >> "$LOG" 2>&1
echo "linear rc=$?"
for t in eager graph; do
  echo "== $t"
  grep "^| quantize" "$OUT/$t/quantization.md" 2>/dev/null | awk -F'|' '$4 ~ /16384x7168|8192x14336/ {print $3, $5, $6, $9}'
done
grep -E "^\| with_trans|best" "$LOG" | tail -6
grep -iE "^== " "$OUT/diag_fp8_linear.txt" 2>/dev/null | head -8
