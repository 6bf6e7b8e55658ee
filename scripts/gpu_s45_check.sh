#!/usr/bin/env bash
# GPU pass of session 45: the issue-level checks on the H200 (issues 3, 4 and 6), stages in this order
# (S45_STAGES, default "t4 reg"), each under its own time limit, a short summary per stage, full
# output under OUT:
# t4:   issue 4's GPU tests (grouped launchers 16-bit and FP8, the grouped ops, launch module,
#       host-sync guard, MoE modules): scripts/gpu_s44_check.sh's "tests" stage;
# reg:  the eager 96-row BF16 registry (forward and forward+backward, do_bench) against
#       torch._grouped_mm: gpu_s44_check.sh's "registry" stage;
# t36:  issues 3 and 6's op / module / core tests and their kernels' tests (quantizers, FP8 / FP4 GEMM,
#       QuantizedTensor, grouped FP4, router, permute, activation, normalization, modules);
# moe:  the MoE layer fwd+bwd at 16384 tokens, four models, BF16 and FP8 BLOCKWISE against the
#       TorchTitan-style baseline (gpu_s42_check.sh's "moe" stage);
# lin:  the FP8 linear step (TENSORWISE, BLOCKWISE) fwd+bwd against BF16 cuBLAS, Llama-3.1-8B M 16384
#       (gpu_s40_check.sh's "linear" stage);
# quant: bench_quantization.py in device time (x the device copy measured in the same run);
# mem:  bench_norm_act.py (RMSNorm, SwiGLU / GeGLU with probs, forward and backward) and
#       bench_moe_permute.py (the permute / unpermute forms; bytes moved, token rows read once), x the
#       device copy in the same run (issue 6's memory-bound targets).
#
#   S45_STAGES="t36 moe" bash scripts/gpu_s45_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s45_check.sh OUT}
mkdir -p "$OUT"
HERE="$(dirname "$0")"
source "$HERE/gpu_env.sh"
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
STAGES=" ${S45_STAGES:-t4 reg} "
if [[ $STAGES == *" t4 "* ]]; then
  S44_STAGES=tests S44_TEST_S="${S45_T4_S:-220}" bash "$HERE/gpu_s44_check.sh" "$OUT/t4" | grep -v "^[A-Za-z]*,\|^torch\|UTC"
fi
if [[ $STAGES == *" reg "* ]]; then
  S44_STAGES=registry S44_REG_S="${S45_REG_S:-340}" bash "$HERE/gpu_s44_check.sh" "$OUT/reg" | grep -v "^[A-Za-z]*,\|^torch\|UTC"
fi
if [[ $STAGES == *" t36 "* ]]; then
  T36="tests/pytorch/ops/test_quantization.py tests/pytorch/ops/test_gemm_fp8.py tests/pytorch/ops/test_gemm_fp4.py
tests/pytorch/ops/test_grouped_gemm_fp4.py tests/pytorch/core tests/pytorch/ops/test_moe_permute.py
tests/pytorch/ops/test_moe_permute_primus.py tests/pytorch/ops/test_moe_router.py tests/pytorch/ops/test_moe_router_gemm.py
tests/pytorch/ops/test_activation.py tests/pytorch/ops/test_normalization.py tests/pytorch/modules/test_modules.py
tests/triton/test_quant_fp8_packed.py tests/triton/test_quant_fp4_packed.py tests/triton/test_quant_fp4_gluon.py
tests/triton/test_gemm_fp8_gluon.py tests/triton/test_gemm_fp8_kernel.py tests/triton/test_gemm_fp4_kernel.py
tests/triton/test_grouped_gemm_mx_kernel.py tests/triton/test_gather_quant.py tests/triton/test_permute_map_kernel.py
tests/triton/test_grouped_gemm_glu_gluon.py tests/testing/test_bench_moe_layer_smoke.py"
  # shellcheck disable=SC2086
  timeout "${S45_T36_S:-300}" $PY -m pytest -q -p no:cacheprovider -n 14 $T36 > "$OUT/pytest_t36.log" 2>&1
  echo "t36 rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pytest_t36.log" | tail -12
fi
if [[ $STAGES == *" moe "* ]]; then
  S42_STAGES=moe S42_MOE_S="${S45_MOE_S:-300}" bash "$HERE/gpu_s42_check.sh" "$OUT/moe" | grep -v "^[A-Za-z]*,\|^torch\|UTC"
fi
if [[ $STAGES == *" lin "* ]]; then
  S40_STAGES=linear S40_LINEAR_S="${S45_LIN_S:-230}" bash "$HERE/gpu_s40_check.sh" "$OUT/lin"
fi
if [[ $STAGES == *" quant "* ]]; then
  timeout "${S45_QUANT_S:-200}" $PY benchmarks/bench_quantization.py --timing graph --out "$OUT/quant" \
    > "$OUT/quant.log" 2>&1
  echo "quant rc=$?"
  grep "^| quantize" "$OUT/quant.log" | awk -F'|' '$4 ~ /16384x7168|8192x14336/' | cut -c1-170
fi
if [[ $STAGES == *" mem "* ]]; then
  timeout "${S45_MEM_S:-200}" $PY benchmarks/bench_norm_act.py --out "$OUT/normact" > "$OUT/normact.log" 2>&1
  echo "normact rc=$?"; grep -E "^\| " "$OUT/normact.log" | grep -v device-copy | cut -c1-150 | tail -24
  timeout "${S45_MEM_S:-200}" $PY benchmarks/bench_moe_permute.py --out "$OUT/permute" > "$OUT/permute.log" 2>&1
  echo "permute rc=$?"; grep -E "^\| " "$OUT/permute.log" | cut -c1-150 | tail -24
fi
find "$OUT" -name "*.md" -delete
