#!/usr/bin/env bash
# H200 check of the top-k indices row-map kernels (one-hot tiles built from the slots, the map form's
# schedule; session 39): GPU tests of the permute kernels and ops, then the indices forms with the
# torch row-map builder against the fused kernels at 16384 x 7168, top-8 of 32 and of 256 and top-4
# of 32 (per-kernel profile + do_bench), then the permute benchmark with the current default and
# with the fused kernels forced. Decides FUSED_MAP_MAX_INDEX_ROWS (moe_permute.py).
#
#   bash scripts/gpu_permute_indices_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_permute_indices_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
gpu_run_header "$OUT/header.log"
timeout 240 $PY -m pytest -q -x -p no:cacheprovider tests/triton/test_permute_map_kernel.py \
  tests/pytorch/ops/test_moe_permute.py tests/pytorch/ops/test_moe_permute_primus.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"
for cfg in "32 8" "256 8" "32 4"; do
  set -- $cfg
  timeout 100 $PY scripts/diag_permute_indices.py --e "$1" --k "$2" > "$OUT/diag_e$1_k$2.log" 2>&1
  echo "diag e=$1 k=$2 rc=$?"; grep "^==" "$OUT/diag_e$1_k$2.log"
done
for mode in auto 1; do
  PRIMUS_TURBO_PERMUTE_FUSED_MAP=$mode timeout 150 $PY benchmarks/bench_moe_permute.py --out "$OUT/bench_fused_$mode" \
    > "$OUT/bench_fused_$mode.log" 2>&1
  echo "bench fused=$mode rc=$?"; tail -14 "$OUT/bench_fused_$mode.log"
done
