#!/usr/bin/env bash
# H200 pass of session 39's changes, in one call: (1) the indices row-map kernels (one-hot tiles)
# against the torch builder at 16384 x 7168 top-8 of 32 and of 256 (per-kernel profile + do_bench);
# (2) the FP8 linear step's host time at attn_out, BASE (a copy of the tree before the host-time
# cuts, PYTHONPATH=$BASE) and this tree interleaved, two rounds; (3) the TENSORWISE quantizer (amax
# partials reduced in the tile kernel instead of a zero-filled atomic word) against the device copy,
# both trees, device time; (4) the GPU tests of the changed code, as far as the time allows.
#
#   BASE=out/hc_base bash scripts/gpu_s39_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s39_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
R=$(pwd)
BASE=${BASE:-}
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
for cfg in "32 8" "256 8"; do
  set -- $cfg
  timeout 70 $PY scripts/diag_permute_indices.py --e "$1" --k "$2" > "$OUT/permute_e$1_k$2.log" 2>&1
  echo "permute e=$1 k=$2 rc=$?"; grep "^==" "$OUT/permute_e$1_k$2.log"
done
for round in 1 2; do
  for g in TENSORWISE BLOCKWISE; do
    if [ -n "$BASE" ]; then
      PYTHONPATH=$R/$BASE timeout 45 $PY $R/$BASE/scripts/diag_fp8_linear_host.py --gran $g > "$OUT/host_base_${g}_r$round.log" 2>&1
      echo "base r$round $(head -1 "$OUT/host_base_${g}_r$round.log")"
    fi
    timeout 45 $PY scripts/diag_fp8_linear_host.py --gran $g > "$OUT/host_new_${g}_r$round.log" 2>&1
    echo "new  r$round $(head -1 "$OUT/host_new_${g}_r$round.log")"
  done
done
[ -n "$BASE" ] && cp -r benchmarks "$R/$BASE/"  # the benchmark then imports BASE's package (its own root)
for tree in base new; do
  [ $tree = base ] && [ -z "$BASE" ] && continue
  root=$R; [ $tree = base ] && root=$R/$BASE
  PYTHONPATH=$root timeout 60 $PY $root/benchmarks/bench_quantization.py --out "$OUT/quant_$tree" \
    --quantizers device-copy tensorwise --timing graph > "$OUT/quant_$tree.log" 2>&1
  echo "quant $tree rc=$?"; grep -i "tensorwise\|device-copy" "$OUT/quant_$tree.log" | tail -8
done
PRIMUS_TURBO_TEST_RESULT_LOG="$OUT/results.log" timeout ${S39_TEST_S:-200} $PY -m pytest -q -n 8 -p no:cacheprovider \
  tests/pytorch/test_no_host_sync.py tests/testing/test_host_sync.py tests/triton/test_permute_map_kernel.py \
  tests/pytorch/ops/test_moe_permute_primus.py tests/pytorch/core/test_quantized_tensor_grouped.py \
  tests/pytorch/core/test_quantized_tensor.py tests/pytorch/ops/test_quantization.py tests/pytorch/ops/test_gemm_fp8.py \
  tests/triton/test_launch.py tests/triton/test_gemm_fp8_gluon.py tests/triton/test_quant_fp8_packed.py \
  tests/pytorch/core/test_backend.py tests/pytorch/ops/test_moe_permute.py tests/pytorch/test_input_validation_audit.py \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -1 "$OUT/pytest.log"
grep -c "^passed" "$OUT/results.log"; grep -vc "^passed\|^skipped" "$OUT/results.log"
