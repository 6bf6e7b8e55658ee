#!/usr/bin/env bash
# GPU pass of session 49: the issue-level re-run on the H200 (issues 3, 4 and 6) after sessions
# 43-48's changes, stages in this order (S49_STAGES, default "new rest"), each under its own time
# limit, a short summary per stage, full output under OUT:
# new:  the GPU tests of session 48's MoE additions (router expert bias / normalize_topk, MoELayer's
#       balancing, loss, shared-expert and capacity options, the host-sync guard);
# rest: issues 3, 4 and 6's other op / module / kernel tests (gpu_s45_check.sh's t4 and t36 lists);
#       pytest -v, so a run cut by its limit still names every test it finished;
# fix:  the tests that failed or did not finish in call 1 (device-placement test bugs fixed);
# reg:  issue 4's eager 96-row BF16 registry (forward, forward+backward) x torch._grouped_mm;
# regsmall: its host-bound small rows only (Qwen3-30B-A3B, GPT-OSS-20B, EP 16 / 32, 1024 tokens);
# moe:  issue 6's MoE layer fwd+bwd at 16384 tokens, four models, BF16 and FP8 BLOCKWISE x the
#       TorchTitan-style baseline;
# lin:  issue 3's FP8 linear step (TENSORWISE, BLOCKWISE) fwd+bwd x BF16 cuBLAS, Llama-3.1-8B M 16384;
# mem:  issue 6's memory-bound kernels (norm / activations, permute / unpermute) x the device copy.
#
#   S49_STAGES="reg moe" bash scripts/gpu_s49_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s49_check.sh OUT}
mkdir -p "$OUT"
HERE="$(dirname "$0")"
source "$HERE/gpu_env.sh"
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
STAGES=" ${S49_STAGES:-new rest} "
NW=${S49_WORKERS:-14}

# pytest_stage NAME LIMIT FILES...: -v so each finished test is named even when the limit cuts the
# run; prints the counts and the failures.
pytest_stage() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" $PY -m pytest -v -p no:cacheprovider -n "$NW" "$@" > "$OUT/pytest_$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc ($((SECONDS - t0)) s): $(grep -c ' PASSED ' "$OUT/pytest_$name.log") passed," \
    "$(grep -c ' SKIPPED ' "$OUT/pytest_$name.log") skipped, $(grep -c ' FAILED \| ERROR ' "$OUT/pytest_$name.log") failed/error"
  grep -E "^FAILED|^ERROR|\] (FAILED|ERROR) " "$OUT/pytest_$name.log" | cut -c1-200 | sort -u | head -20
  tail -n 1 "$OUT/pytest_$name.log" | cut -c1-200
}

NEW="tests/pytorch/ops/test_moe_router.py tests/pytorch/modules/test_moe.py tests/pytorch/modules/test_moe_expert_bias.py
tests/pytorch/modules/test_moe_aux_losses.py tests/pytorch/test_no_host_sync.py"
REST="tests/triton/test_grouped_gemm_gluon.py tests/pytorch/ops/test_grouped_gemm.py tests/triton/test_grouped_gemm_fp8_gluon.py
tests/pytorch/ops/test_grouped_gemm_fp8.py tests/triton/test_launch.py
tests/pytorch/ops/test_quantization.py tests/pytorch/ops/test_gemm_fp8.py tests/pytorch/ops/test_gemm_fp4.py
tests/pytorch/ops/test_grouped_gemm_fp4.py tests/pytorch/core tests/pytorch/ops/test_moe_permute.py
tests/pytorch/ops/test_moe_permute_primus.py tests/pytorch/ops/test_moe_router_gemm.py
tests/pytorch/ops/test_activation.py tests/pytorch/ops/test_normalization.py tests/pytorch/modules/test_modules.py
tests/triton/test_quant_fp8_packed.py tests/triton/test_quant_fp4_packed.py tests/triton/test_quant_fp4_gluon.py
tests/triton/test_gemm_fp8_gluon.py tests/triton/test_gemm_fp8_kernel.py tests/triton/test_gemm_fp4_kernel.py
tests/triton/test_grouped_gemm_mx_kernel.py tests/triton/test_gather_quant.py tests/triton/test_permute_map_kernel.py
tests/triton/test_grouped_gemm_glu_gluon.py tests/testing/test_bench_moe_layer_smoke.py"

# shellcheck disable=SC2086
[[ $STAGES == *" new "* ]] && pytest_stage new "${S49_NEW_S:-150}" $NEW
# shellcheck disable=SC2086
[[ $STAGES == *" rest "* ]] && pytest_stage rest "${S49_REST_S:-340}" $REST

FIX="tests/pytorch/modules/test_moe_aux_losses.py tests/pytorch/ops/test_gemm_fp4.py tests/pytorch/core
tests/triton/test_gemm_fp4_kernel.py tests/pytorch/ops/test_grouped_gemm_fp4.py"
# shellcheck disable=SC2086
[[ $STAGES == *" fix "* ]] && pytest_stage fix "${S49_FIX_S:-150}" $FIX tests/pytorch/modules/test_moe.py::test_moe_layer_capacity_factor_drops \
  tests/pytorch/ops/test_grouped_gemm.py::test_flat_key_route_megatron_form tests/pytorch/ops/test_gemm_fp8.py::test_bad_input \
  tests/triton/test_gemm_fp8_kernel.py::test_gpu_4096 tests/pytorch/ops/test_grouped_gemm_fp8.py::test_grouped_gemm_fp8_blockwise_wgrad \
  tests/pytorch/ops/test_grouped_gemm_fp8.py::test_grouped_gemm_fp8_mx

if [[ $STAGES == *" regsmall "* ]]; then
  t0=$SECONDS
  timeout "${S49_REGS_S:-90}" $PY benchmarks/bench_grouped_gemm.py --out "$OUT/regsmall" --impls torch_grouped_mm \
    turbo-default --fp8 --models Qwen3-30B-A3B GPT-OSS-20B --ep 16 32 --tokens 1024 --routings balanced \
    --rounds 3 > "$OUT/regsmall.log" 2>&1
  echo "== regsmall rc=$? ($((SECONDS - t0)) s)"
  grep -E "^\| grouped_gemm_fwd" "$OUT/regsmall.log" | awk -F'|' '$5 ~ /turbo-default/' | cut -d'|' -f2,3,5,6,8,9
fi
if [[ $STAGES == *" reg "* ]]; then
  t0=$SECONDS
  timeout "${S49_REG_S:-300}" $PY benchmarks/bench_grouped_gemm.py --out "$OUT/registry" --impls torch_grouped_mm \
    turbo-default --fp8 --rounds 3 > "$OUT/registry.log" 2>&1
  echo "== registry rc=$? ($((SECONDS - t0)) s)"
  grep -E "^\| grouped_gemm_fwd(_bwd)? \| turbo-default \|" "$OUT/registry.log"
  echo "rows under 0.98:"
  grep -E "^\| grouped_gemm_fwd" "$OUT/registry.log" | awk -F'|' '$5 ~ /turbo-default/ && $9+0 < 0.98' | cut -c1-170
fi
if [[ $STAGES == *" moe "* ]]; then
  t0=$SECONDS
  timeout "${S49_MOE_S:-280}" $PY benchmarks/bench_moe_layer.py --out "$OUT/moe" > "$OUT/moe.log" 2>&1
  echo "== moe rc=$? ($((SECONDS - t0)) s)"; grep -E "moe_layer" "$OUT/moe.log" | cut -c1-150
fi
if [[ $STAGES == *" lin "* ]]; then
  t0=$SECONDS
  timeout "${S49_LIN_S:-230}" $PY benchmarks/bench_gemm_fp8.py --out "$OUT/linear" --models Llama-3.1-8B \
    --modes fwd_bwd --cases qkv attn_out gate_up down --impls cublas turbo-default \
    --linear-granularities TENSORWISE BLOCKWISE --rounds 2 > "$OUT/linear.log" 2>&1
  echo "== linear rc=$? ($((SECONDS - t0)) s)"; grep -E "^\|" "$OUT/linear.log" | tail -12 | cut -c1-170
fi
if [[ $STAGES == *" mem "* ]]; then
  t0=$SECONDS
  timeout "${S49_MEM_S:-120}" $PY benchmarks/bench_norm_act.py --out "$OUT/normact" > "$OUT/normact.log" 2>&1
  echo "== normact rc=$? ($((SECONDS - t0)) s)"; grep -E "^\| " "$OUT/normact.log" | grep -v device-copy | cut -c1-150 | tail -24
  t0=$SECONDS
  timeout "${S49_MEM_S:-120}" $PY benchmarks/bench_moe_permute.py --out "$OUT/permute" > "$OUT/permute.log" 2>&1
  echo "== permute rc=$? ($((SECONDS - t0)) s)"; grep -E "^\| " "$OUT/permute.log" | cut -c1-150 | tail -24
fi
