#!/usr/bin/env bash
# H200 pass for issue 3's dense FP8 targets at every Llama-3.1-8B shape with the current defaults:
# the FP8 linear step (forward + backward, quantization included, TENSORWISE and BLOCKWISE E4M3)
# against the BF16 cuBLAS step at M 16384 for qkv / attn_out / gate_up / down (the last full run
# of these four predates the Gluon wgrad and two-copy quantizers: session 2 at M 4096, session 4
# qkv only), then the BLOCKWISE forward GEMM against cuBLAS BF16 in device time at M 4096 and
# 16384 for Llama-3.1-8B and -70B (its registry run was last cut after three cases).
#
#   bash scripts/gpu_fp8_linear_check.sh OUT
#
# Stages (FL_STAGES, default "linear fwd"; also "lgraph": the linear steps in device time, each step
# captured whole in a CUDA graph, to separate host-bound rows from slow kernels). Each has its own
# time limit (FL_LINEAR_S, FL_FWD_S, FL_LGRAPH_S) and prints its table; full results under OUT/<stage>.
set -uo pipefail
OUT=${1:?usage: gpu_fp8_linear_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
gpu_run_header "$OUT/header.log"
STAGES=" ${FL_STAGES:-linear fwd} "

if [[ $STAGES == *" linear "* ]]; then
  timeout "${FL_LINEAR_S:-240}" $PY benchmarks/bench_gemm_fp8.py --out "$OUT/linear" --models Llama-3.1-8B \
      --modes fwd_bwd --cases qkv attn_out gate_up down --impls cublas turbo-default turbo-triton \
      --linear-granularities TENSORWISE BLOCKWISE > "$OUT/linear.log" 2>&1
  echo "linear rc=$?"; $PY scripts/summarize_bench.py "$OUT/linear/gemm_fp8.json"
fi
if [[ $STAGES == *" lgraph "* ]]; then
  timeout "${FL_LGRAPH_S:-240}" $PY benchmarks/bench_gemm_fp8.py --out "$OUT/lgraph" --models Llama-3.1-8B \
      --modes fwd_bwd --cases qkv attn_out gate_up down --impls cublas turbo-default \
      --linear-granularities TENSORWISE BLOCKWISE --timing graph > "$OUT/lgraph.log" 2>&1
  echo "lgraph rc=$?"; $PY scripts/summarize_bench.py "$OUT/lgraph/gemm_fp8.json"
fi
if [[ $STAGES == *" fwd "* ]]; then
  timeout "${FL_FWD_S:-240}" $PY benchmarks/bench_gemm_fp8.py --out "$OUT/fwd" --models Llama-3.1-8B Llama-3.1-70B \
      --modes fwd --granularities BLOCKWISE --impls cublas turbo-default --timing graph > "$OUT/fwd.log" 2>&1
  echo "fwd rc=$?"; $PY scripts/summarize_bench.py "$OUT/fwd/gemm_fp8.json"
fi
