#!/usr/bin/env bash
# H200 pass for the Gluon two-copy MXFP4 quantizer (quant_fp4_gluon.py): its GPU tests and the
# MXFP4 quantizer / GEMM tests (the default with_trans path now runs it), the spread over fresh
# allocations in device time (x the device copy, the tl pair kernel in the same run), the
# quantization benchmark in device time and (FG_EAGER=1) eager, and the stage breakdown
# (scripts/diag_fp4_gluon.py).   bash scripts/gpu_fp4_gluon_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_fp4_gluon_check.sh OUT}
mkdir -p "$OUT/graph" "$OUT/eager"
source "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/run.log"
gpu_run_header "$LOG"
timeout "${FG_TEST_S:-200}" $PY -m pytest -q -n 8 -p no:cacheprovider tests/triton/test_quant_fp4_gluon.py \
    tests/triton/test_quant_fp4_packed.py tests/pytorch/ops/test_gemm_fp4.py tests/pytorch/ops/test_grouped_gemm_fp4.py \
    tests/pytorch/modules/test_modules.py tests/pytorch/ops/test_quantization.py \
    -k "${FG_TEST_K:-gluon or fp4 or FP4}" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"
timeout "${FG_SPREAD_S:-200}" $PY scripts/diag_quant_spread.py --kinds fp4 --timing graph --trials "${FG_TRIALS:-5}" \
    > "$OUT/spread_graph.log" 2>&1
echo "spread rc=$?"; grep -E "^fp4|ratio" "$OUT/spread_graph.log"
if [ "${FG_BENCH:-1}" = 1 ]; then
  timeout "${FG_BENCH_S:-150}" $PY benchmarks/bench_quantization.py --timing graph --out "$OUT/graph" >> "$LOG" 2>&1
  echo "bench graph rc=$?"
  grep "^| quantize" "$OUT/graph/quantization.md" 2>/dev/null | awk -F'|' '$4 ~ /16384x7168|8192x14336/ {print $3, $5, $6, $9}'
fi
if [ "${FG_EAGER:-0}" = 1 ]; then
  timeout "${FG_BENCH_S:-150}" $PY benchmarks/bench_quantization.py --out "$OUT/eager" >> "$LOG" 2>&1
  echo "bench eager rc=$?"
  grep "^| quantize" "$OUT/eager/quantization.md" 2>/dev/null | awk -F'|' '$4 ~ /16384x7168|8192x14336/ && $5 ~ /fp4/ {print $3, $5, $6, $9}'
fi
if [ "${FG_DIAG:-1}" = 1 ]; then
  timeout 150 $PY scripts/diag_fp4_gluon.py --trials 3 --shapes 16384x7168 8192x14336 > "$OUT/diag.log" 2>&1
  echo "diag rc=$?"; tail -20 "$OUT/diag.log"
fi
