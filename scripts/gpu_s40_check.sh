#!/usr/bin/env bash
# H200 pass of session 40, one call: (1) the GPU tests of the changed code (session 39's and 40's:
# host-sync guard and CUDA-graph capture, permute kernels, quantizers, FP8 GEMM / Gluon prepared
# launches, launch paths, input audit), with the failing test ids printed; (2) the FP8 linear step
# (fwd + bwd, quantization included) against BF16 cuBLAS at the four Llama-3.1-8B M 16384 shapes,
# TENSORWISE and BLOCKWISE, eager (do_bench), two interleaved rounds. Few files under OUT (the
# device returns a limited number).
#
#   bash scripts/gpu_s40_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s40_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
STAGES=" ${S40_STAGES:-tests linear} "
if [[ $STAGES == *" tests "* ]]; then
  timeout "${S40_TEST_S:-240}" $PY -m pytest -q -n 8 -p no:cacheprovider --tb=line -rfE \
    tests/pytorch/test_no_host_sync.py tests/testing/test_host_sync.py tests/triton/test_permute_map_kernel.py \
    tests/pytorch/ops/test_moe_permute_primus.py tests/pytorch/ops/test_moe_permute.py \
    tests/pytorch/core/test_quantized_tensor_grouped.py tests/pytorch/core/test_quantized_tensor.py \
    tests/pytorch/ops/test_quantization.py tests/pytorch/ops/test_gemm_fp8.py tests/triton/test_launch.py \
    tests/triton/test_gemm_fp8_gluon.py tests/triton/test_quant_fp8_packed.py tests/pytorch/core/test_backend.py \
    tests/pytorch/test_input_validation_audit.py ${S40_TEST_EXTRA:-} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | cut -c1-220 | head -30; tail -1 "$OUT/pytest.log"
fi
if [[ $STAGES == *" linear "* ]]; then
  timeout "${S40_LINEAR_S:-240}" $PY benchmarks/bench_gemm_fp8.py --out "$OUT/linear" --models Llama-3.1-8B \
      --modes fwd_bwd --cases qkv attn_out gate_up down --impls cublas turbo-default \
      --linear-granularities TENSORWISE BLOCKWISE --rounds 2 > "$OUT/linear.log" 2>&1
  echo "linear rc=$?"; grep -E "^\|" "$OUT/linear.log" | tail -12; $PY scripts/summarize_bench.py "$OUT/linear/gemm_fp8.json"
fi
