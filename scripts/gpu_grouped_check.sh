#!/usr/bin/env bash
# H200 pass for the grouped GEMM launchers and rules: the GPU tests of the Gluon grouped launchers
# (16-bit, FP8, fused GLU; their prepared launches included) and the MoE layer (CUDA-graph capture),
# the host time of each launch with and without the prepared path (scripts/diag_host_parts.py),
# the 16-bit tile configs on many small groups (scripts/diag_grouped_small.py: 128 x 256 against
# the small-groups rule's 128 x 128) and the FP8 TENSORWISE / ROWWISE registry rows in device time.
#
#   bash scripts/gpu_grouped_check.sh OUT
#
# Stages (GG_STAGES, default all): tests host small fp8. Each stage has its own time limit
# (GG_TEST_S, GG_HOST_S, GG_SMALL_S, GG_FP8_S) and prints a short summary; full output under OUT.
set -uo pipefail
OUT=${1:?usage: gpu_grouped_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
gpu_run_header "$OUT/header.log"
STAGES=" ${GG_STAGES:-tests host small fp8} "

if [[ $STAGES == *" tests "* ]]; then
  timeout "${GG_TEST_S:-240}" $PY -m pytest -q -n 8 -p no:cacheprovider tests/triton/test_launch.py \
      tests/triton/test_grouped_gemm_gluon.py tests/triton/test_grouped_gemm_fp8_gluon.py \
      tests/triton/test_grouped_gemm_glu_gluon.py tests/pytorch/modules/test_moe.py \
      -k "${GG_TEST_K:-prepared or launch or graph or scaled or rule or switch or matches or equals}" \
      > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"
fi
if [[ $STAGES == *" host "* ]]; then
  timeout "${GG_HOST_S:-120}" $PY scripts/diag_host_parts.py --rounds 5 > "$OUT/host_parts.log" 2>&1
  echo "host rc=$?"; cat "$OUT/host_parts.log"
fi
if [[ $STAGES == *" small "* ]]; then
  timeout "${GG_SMALL_S:-200}" $PY scripts/diag_grouped_small.py --configs n256k64s3e256 n128k64s5 \
      --only DSv3-EP4 --no-probes --no-tl --grids --rounds 5 --lens balanced unbalanced --out "$OUT/small" \
      > "$OUT/small.log" 2>&1
  echo "small rc=$?"; tail -25 "$OUT/small.log"
fi
if [[ $STAGES == *" fp8 "* ]]; then
  timeout "${GG_FP8_S:-240}" $PY benchmarks/bench_grouped_gemm.py --out "$OUT/fp8" --timing graph --modes fwd \
      --routings balanced --impls torch_grouped_mm turbo-default --fp8 TENSORWISE ROWWISE > "$OUT/fp8.log" 2>&1
  echo "fp8 rc=$?"; $PY scripts/summarize_bench.py "$OUT/fp8/grouped_gemm_bf16.json"
fi
