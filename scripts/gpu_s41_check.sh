#!/usr/bin/env bash
# H200 pass of session 41, one call (few files under OUT), stages in this order (S41_STAGES):
# audit: the input-validation audit's tests (the empty-input ones on CUDA tensors too);
# blockwise: the BLOCKWISE FP8 forward GEMM against BF16 cuBLAS over the dense registry (Llama-3.1-8B
#   and -70B, every case, M 4096 and 16384) in device time (issue 3's 1.5x geomean had only partial
#   H200 runs: s4 five shapes, s6 the 70B rows at M 4096);
# grouped: the grouped GEMM launchers' GPU tests and host parts (scripts/gpu_grouped_check.sh's tests
#   and host stages).
#
#   bash scripts/gpu_s41_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s41_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
STAGES=" ${S41_STAGES:-audit blockwise grouped} "
if [[ $STAGES == *" audit "* ]]; then  # the empty-input tests, now on CUDA tensors too
  timeout "${S41_AUDIT_S:-120}" $PY -m pytest -q -n 8 -p no:cacheprovider --tb=short -rfE \
      tests/pytorch/test_input_validation_audit.py > "$OUT/audit.log" 2>&1
  echo "audit rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/audit.log" | cut -c1-220 | head -20; tail -1 "$OUT/audit.log"
fi
if [[ $STAGES == *" blockwise "* ]]; then
  timeout "${S41_BW_S:-240}" $PY benchmarks/bench_gemm_fp8.py --out "$OUT/bw" --modes fwd --timing graph \
      --granularities BLOCKWISE --impls cublas turbo-default --rounds "${S41_BW_ROUNDS:-3}" > "$OUT/bw.log" 2>&1
  echo "blockwise rc=$?"; grep -E "^\| fp8_fwd_blockwise" "$OUT/bw.log" | grep turbo | cut -c1-160 | head -24
  $PY scripts/summarize_bench.py "$OUT/bw/gemm_fp8.json"
fi
if [[ $STAGES == *" grouped "* ]]; then
  GG_STAGES="${S41_GG_STAGES:-tests host}" bash "$(dirname "$0")/gpu_grouped_check.sh" "$OUT/gg"
fi
