#!/usr/bin/env bash
# One device call that checks and measures what changed: focused GPU tests, a profile of the FP8
# linear step, then the benchmarks, each under its own time limit so one slow part cannot starve
# the rest. Everything lands under OUT/r and is packed into OUT/results.tgz (the device returns
# few files); a short summary is printed last.
#
#   bash scripts/gpu_session.sh OUT_DIR
#
# Environment: GPU_SESSION_TESTS="tests/..." overrides the test selection (GPU_SESSION_TEST_S its
# time limit); GPU_SESSION_SHARD=K/N runs shard K of N of the whole tests/ tree instead (every N-th
# test, tests/conftest.py's --shard: the full tree in N calls); GPU_SESSION_RESUME=RESULT_LOG leaves
# out the tests an earlier call's r/results.log records as passed (--skip-passed);
# GPU_SESSION_STAGES picks the stages after the tests (default: diag_fp8 diag_moe moe_layer grouped memory permute_fused attention; also tune_attn with GPU_SESSION_TUNE_ARGS,
# attn_configs (the Gluon attention forward's opt-in configs, GPU_SESSION_ATTN_CONFIGS) and moe4 (the
# MoE layer at the four model shapes, 16384 tokens)); GPU_SESSION_ATTN_S the attention benchmark's
# time limit.
set -u
OUT="${1:?usage: bash scripts/gpu_session.sh OUT_DIR}"
R="$OUT/r"
mkdir -p "$R"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

TESTS="${GPU_SESSION_TESTS:-tests/pytorch/ops/test_grouped_gemm.py tests/pytorch/ops/test_grouped_gemm_fp8.py \
tests/pytorch/ops/test_grouped_gemm_fp4.py tests/triton/test_grouped_gemm_mx_kernel.py tests/triton/test_zero_tail.py \
tests/triton/test_grouped_gemm_fp8_kernel.py tests/pytorch/ops/test_attention_fp8.py tests/pytorch/ops/test_quantization.py \
tests/pytorch/ops/test_gemm_fp4.py tests/pytorch/ops/test_gemm_fp8.py tests/pytorch/ops/test_moe_permute.py \
tests/pytorch/modules tests/pytorch/core/test_quantized_tensor.py tests/testing/test_bench_moe_layer_smoke.py \
tests/triton/test_permute_map_kernel.py tests/triton/test_grouped_gemm_kernel.py tests/triton/test_flash_attn_kernel.py \
tests/triton/test_gather_quant.py tests/triton/test_gemm_fp8_gluon.py tests/triton/test_grouped_gemm_fp8_gluon.py \
tests/triton/test_grouped_gemm_fp8_variable_k_gluon.py tests/triton/test_flash_attn_gluon.py \
tests/triton/test_flash_attn_bwd_gluon.py tests/triton/test_flash_attn_fp8_gluon.py tests/triton/test_grouped_gemm_gluon.py \
tests/triton/test_quant_fp4_packed.py tests/triton/test_quant_fp8_packed.py tests/triton/test_grouped_gemm_glu_gluon.py \
tests/pytorch/ops/test_moe_router_gemm.py}"
SELECT=""
if [ -n "${GPU_SESSION_SHARD:-}" ]; then  # K/N: every N-th test of the whole tests/ tree
    TESTS="tests"
    SELECT="--shard $GPU_SESSION_SHARD"
fi
if [ -n "${GPU_SESSION_RESUME:-}" ]; then
    SELECT="$SELECT --skip-passed $GPU_SESSION_RESUME"
fi
existing=""
for t in $TESTS; do [ -e "$t" ] && existing="$existing $t"; done

echo "== tests"
if [ -n "$existing" ]; then  # GPU_SESSION_TESTS=none skips them
    # shellcheck disable=SC2086
    PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE=0 PRIMUS_TURBO_TEST_FAILURE_LOG="$R/failures.log" \
        PRIMUS_TURBO_TEST_RESULT_LOG="$R/results.log" \
        timeout "${GPU_SESSION_TEST_S:-180}" "$PY" -m pytest -q -n 14 -p no:cacheprovider --timeout=110 $SELECT $existing \
        > "$R/pytest.log" 2>&1
    echo "pytest exit $?: $(tail -n 1 "$R/pytest.log")"
else
    echo "(none)" > "$R/pytest.log"
fi
pack() { (cd "$OUT" && tar czf results.tgz r); }  # after every stage: a run cut short keeps what it has
pack

STAGES="${GPU_SESSION_STAGES:-diag_fp8 diag_moe moe_layer grouped memory permute_fused attention}"
want() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }

if want diag_fp8; then
    echo "== FP8 linear step profile"
    timeout 40 "$PY" scripts/diag_fp8_linear.py --out "$R" > "$R/diag.log" 2>&1
    grep "^== " "$R/diag.log"
    pack
fi
if want diag_moe; then
    echo "== MoE layer step profile"
    timeout 60 "$PY" scripts/diag_moe_layer.py --out "$R" > "$R/diag_moe.log" 2>&1
    grep "^== " "$R/diag_moe.log"
    pack
fi
if want tune_attn; then
    echo "== attention tile sweep (${GPU_SESSION_TUNE_ARGS:---fp8 --no-bwd --dims 128 64})"
    # shellcheck disable=SC2086
    timeout 120 "$PY" scripts/tune_attention.py --out "$R" ${GPU_SESSION_TUNE_ARGS:---fp8 --no-bwd --dims 128 64} \
        > "$R/tune_attn.log" 2>&1
    grep "^d[0-9]*:" "$R/tune_attn.log"
    pack
fi

if want attn_configs; then
    echo "== Gluon attention forward configs (${GPU_SESSION_ATTN_CONFIGS:-n128s2o n128s2po n128s3o})"
    # shellcheck disable=SC2086
    timeout 300 "$PY" scripts/check_gluon_attn.py --out "$R/attn_cfg" --only d128_full_bf16 d128_causal_bf16 \
        d64_full_bf16 d64_causal_bf16 --timeout 60 --configs ${GPU_SESSION_ATTN_CONFIGS:-n128s2o n128s2po n128s3o} \
        > "$R/attn_configs.log" 2>&1
    echo "exit $?"; grep "geomean" "$R/attn_configs.log"
    pack
fi

run_bench() {  # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    want "$name" || return 0
    echo "== $name"
    timeout "$secs" "$PY" "$@" > "$R/$name.log" 2>&1
    echo "exit $?"
    pack
}
run_bench moe_layer 70 benchmarks/bench_moe_layer.py --out "$R/moe" --quick
run_bench moe4 200 benchmarks/bench_moe_layer.py --out "$R/moe4" --rep-ms 150 --warmup-ms 50
run_bench grouped 60 benchmarks/bench_grouped_gemm.py --out "$R/grouped" --models DeepSeek-V3 Qwen3-30B-A3B \
    --ep 8 --tokens 2048 --routings balanced --warmup-ms 5 --rep-ms 25
run_bench memory 40 benchmarks/run_all.py --out "$R/mem" --only quantization norm_act moe_permute
# the fused permute map (off on CUDA by default until validated): same benchmark with it on
PRIMUS_TURBO_PERMUTE_FUSED_MAP=1 run_bench permute_fused 30 benchmarks/bench_moe_permute.py --out "$R/pf"
run_bench attention "${GPU_SESSION_ATTN_S:-50}" benchmarks/bench_attention.py --out "$R/attn" --quick \
    --impls sdpa-cudnn sdpa-flash turbo-default turbo-triton turbo-fp8

echo
echo "===== summary ====="
echo "tests: $(tail -n 1 "$R/pytest.log")"
[ -s "$R/failures.log" ] && grep '^==== ' "$R/failures.log" | sort -u | head -20
grep -h "step" "$R"/diag*.log 2>/dev/null | head -8
for f in "$R"/*.log; do
    sed -n '/^## Geomean/,/^$/p' "$f" | grep '^| [a-z]' | grep -v '^| op '
done
