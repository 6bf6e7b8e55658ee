#!/usr/bin/env bash
# GPU pass of session 44: the kept-launch host paths extended to Megatron's calling form of the
# 16-bit grouped GEMM and to the FP8 M-grouped forward (issue 4's eager rows), stages in this
# order (S44_STAGES, default "tests megatron fp8"), a short summary per stage, full output under OUT:
# tests: the GPU tests of the grouped launchers (16-bit and FP8), the ops, the launch module, the
#   host-sync guard and the MoE modules (covers session 43's derived-offsets step route and its
#   review refactor, and this session's Megatron step and FP8 flat signatures);
# megatron: scripts/diag_megatron_grouped.py (Megatron's form against torch._grouped_mm + main_grad
#   add_, eager fwd+bwd), BASE (a copy of the tree before the change, PYTHONPATH=$BASE) and this
#   tree, alternating twice;
# fp8: bench_grouped_gemm.py --fp8 TENSORWISE ROWWISE, forward, do_bench, the small rows (Qwen3-30B-A3B,
#   GPT-OSS-20B at EP 16 / 32, 1024 tokens) against torch._scaled_grouped_mm, BASE and this tree
#   alternating twice;
# registry: bench_grouped_gemm.py over the default registry grid (96 rows, BF16 forward and
#   forward+backward, do_bench), this tree only (issue 4's eager target on this card);
# sweep: scripts/diag_grouped16_configs.py on the large DeepSeek-V3 forward shapes that trailed
#   cuBLAS on the H100 in session 43 (device time, per config).
#
#   BASE=out/base bash scripts/gpu_s44_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s44_check.sh OUT}
mkdir -p "$OUT"
HERE="$(dirname "$0")"
source "$HERE/gpu_env.sh"
R=$(pwd)
BASE=${BASE:-}
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
STAGES=" ${S44_STAGES:-tests megatron fp8} "
TESTS=${S44_TESTS:-tests/triton/test_grouped_gemm_gluon.py tests/pytorch/ops/test_grouped_gemm.py tests/triton/test_grouped_gemm_fp8_gluon.py tests/pytorch/ops/test_grouped_gemm_fp8.py tests/triton/test_launch.py tests/pytorch/test_no_host_sync.py tests/pytorch/modules/test_moe.py}
if [[ $STAGES == *" tests "* ]]; then
  timeout "${S44_TEST_S:-360}" $PY -m pytest -q -p no:cacheprovider -n 8 \
    $TESTS > "$OUT/pytest.log" 2>&1
  echo "tests rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.log" | tail -5
fi
if [[ $STAGES == *" megatron "* ]]; then
  [ -n "$BASE" ] && cp scripts/diag_megatron_grouped.py "$R/$BASE/scripts/"
  for tree in base new base2 new2; do
    case $tree in new*) root=$R ;; *) [ -z "$BASE" ] && continue; root=$R/$BASE ;; esac
    PYTHONPATH=$root timeout 200 $PY $root/scripts/diag_megatron_grouped.py --models Qwen3-30B-A3B GPT-OSS-20B \
      --ep 16 32 --out "$OUT/megatron_$tree.json" > "$OUT/megatron_$tree.log" 2>&1
    echo "== megatron $tree rc=$?"; grep -E "geomean|error" "$OUT/megatron_$tree.log" | cut -c1-200
  done
fi
if [[ $STAGES == *" fp8 "* ]]; then
  [ -n "$BASE" ] && cp -r benchmarks "$R/$BASE/"
  for tree in base new base2 new2; do
    case $tree in new*) root=$R ;; *) [ -z "$BASE" ] && continue; root=$R/$BASE ;; esac
    PYTHONPATH=$root timeout 200 $PY $root/benchmarks/bench_grouped_gemm.py --out "$OUT/fp8_$tree" \
      --models Qwen3-30B-A3B GPT-OSS-20B --ep 16 32 --tokens 1024 --modes fwd --routings balanced \
      --impls torch_grouped_mm turbo-default scaled_grouped_mm --fp8 TENSORWISE ROWWISE --rounds 3 \
      > "$OUT/fp8_$tree.log" 2>&1
    echo "== fp8 $tree rc=$?"
    grep -E "^\| grouped_fp8_fwd_(tensorwise|rowwise) \|" "$OUT/fp8_$tree.log" | awk -F'|' '$5 ~ /turbo-default/' \
      | cut -d'|' -f2,3,5,6,8,9
  done
fi
if [[ $STAGES == *" registry "* ]]; then
  timeout "${S44_REG_S:-300}" $PY benchmarks/bench_grouped_gemm.py --out "$OUT/registry" --impls torch_grouped_mm \
    turbo-default --fp8 --rounds 3 > "$OUT/registry.log" 2>&1
  echo "== registry rc=$?"
  grep -E "^\| grouped_gemm_fwd(_bwd)? \| turbo-default \|" "$OUT/registry.log"
  grep -E "^\| grouped_gemm_fwd" "$OUT/registry.log" | awk -F'|' '$5 ~ /turbo-default/ && $9+0 < 0.98' | cut -c1-160
fi
if [[ $STAGES == *" sweep "* ]]; then
  # the forward shapes of session 43's H100 rows under 0.98 in device time (DeepSeek-V3 gate_up EP8 1024
  # tokens, EP32 4096 tokens; down EP16 1024 tokens), every listed config against torch._grouped_mm
  timeout "${S44_SWEEP_S:-300}" $PY scripts/diag_grouped16_configs.py --shape 32 1024 4096 7168 \
    --shape 8 4096 4096 7168 --shape 16 1024 7168 2048 > "$OUT/sweep.log" 2>&1
  echo "== sweep rc=$?"; tail -25 "$OUT/sweep.log"
fi
find "$OUT" -name "*.md" -delete
