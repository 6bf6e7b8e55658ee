#!/usr/bin/env bash
# Session 45's GPU tests of the day's CPU-side changes, in one call (two pytest runs, each under its
# own limit; full logs under OUT): (1) the FP8 GEMM TORCH-backend changes, the modules' torch.compile
# tests, permute / router, the host-sync guard; (2) the grouped GEMM tests added for issue 4 (G 16 /
# 32, the issue's (N, K) pairs, clamped offsets, num_cu, signature). Session 46 added Megatron's fused form
# under torch.compile for every op (test_compile_megatron.py) and the FP8 / MXFP4 grouped ops' compile
# tests.   bash scripts/gpu_s45_tests.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s45_tests.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
timeout "${S45_A_S:-200}" $PY -m pytest -q -p no:cacheprovider -n 14 tests/pytorch/ops/test_gemm_fp8.py \
  tests/pytorch/modules tests/pytorch/ops/test_moe_permute.py tests/pytorch/ops/test_moe_router.py \
  tests/pytorch/test_no_host_sync.py tests/pytorch/ops/test_compile_megatron.py tests/pytorch/test_autocast.py \
  tests/pytorch/test_checkpoint.py tests/pytorch/test_compile_dynamic.py > "$OUT/pytest_a.log" 2>&1
echo "a rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pytest_a.log" | tail -15
timeout "${S45_B_S:-150}" $PY -m pytest -q -p no:cacheprovider -n "${S45_B_N:-8}" tests/pytorch/ops/test_grouped_gemm.py \
  tests/triton/test_grouped_gemm_kernel.py tests/pytorch/ops/test_grouped_gemm_fp8.py tests/pytorch/ops/test_grouped_gemm_fp4.py \
  -k "issue_nk or overrunning or G16 or G32 or signature or schedule_values or num_cu or many_groups or megatron_fused or compile or inductor" \
  > "$OUT/pytest_b.log" 2>&1
echo "b rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pytest_b.log" | tail -15
$PY - <<'PY'
import torch
from primus_turbo.pytorch.backends import gemm_fp8 as be
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
e = torch.float8_e4m3fn
for o in (torch.float32, torch.float16, torch.bfloat16):
    print("scaled_mm row-wise ->", o, be._scaled_mm_reason(torch.device("cuda:0"), G.ROWWISE, e, e, o))
PY
