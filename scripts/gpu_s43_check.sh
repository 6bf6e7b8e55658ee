#!/usr/bin/env bash
# GPU pass of session 43: the flat-key host paths of the 16-bit grouped GEMM (issue 4's eager rows),
# stages in this order (S43_STAGES, default all), a short summary printed per stage, full output
# under OUT:
# tests: the GPU tests of the grouped launchers, the op, the launch module, the host-sync guard and
#   the MoE modules;
# host: scripts/diag_host_layers.py (host time per layer, and a labelled trace of one step), BASE
#   (a copy of the tree before the change, PYTHONPATH=$BASE) and this tree, interleaved twice;
# registry: bench_grouped_gemm.py over the default registry grid (96 rows, forward and forward+backward),
#   do_bench, this tree only: issue 4's eager rows (the s35 run read 0.970 geomean, 18 under 0.98);
# eager: bench_grouped_gemm.py forward+backward, do_bench, on the host-bound small rows (Qwen3-30B-A3B
#   and GPT-OSS-20B at EP 16 / 32, 1024 tokens per expert), BASE and this tree, alternating twice.
#
#   BASE=out/base bash scripts/gpu_s43_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s43_check.sh OUT}
mkdir -p "$OUT"
HERE="$(dirname "$0")"
source "$HERE/gpu_env.sh"
R=$(pwd)
BASE=${BASE:-}
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
STAGES=" ${S43_STAGES:-tests host eager} "
TESTS=${S43_TESTS:-tests/triton/test_grouped_gemm_gluon.py tests/pytorch/ops/test_grouped_gemm.py tests/triton/test_launch.py tests/pytorch/test_no_host_sync.py tests/pytorch/modules/test_moe.py}
if [[ $STAGES == *" tests "* ]]; then
  timeout "${S43_TEST_S:-300}" $PY -m pytest -q -p no:cacheprovider -n 8 \
    $TESTS > "$OUT/pytest.log" 2>&1
  echo "tests rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.log" | tail -5
fi
if [[ $STAGES == *" host "* ]]; then
  for round in 1 2; do
    for tree in base new; do
      [ $tree = base ] && [ -z "$BASE" ] && continue
      root=$R; [ $tree = base ] && root=$R/$BASE
      PYTHONPATH=$root timeout 120 $PY $root/scripts/diag_host_layers.py --rounds 5 > "$OUT/host_${tree}_r$round.log" 2>&1
      echo "== host $tree round $round rc=$?"
      grep -E "^(grouped_gemm_gluon|op |torch |backward body|Python Function|native)" "$OUT/host_${tree}_r$round.log"
    done
  done
fi
if [[ $STAGES == *" eager "* ]]; then
  [ -n "$BASE" ] && cp -r benchmarks "$R/$BASE/"
  for tree in base new base2 new2; do
    case $tree in new*) root=$R ;; *) [ -z "$BASE" ] && continue; root=$R/$BASE ;; esac
    PYTHONPATH=$root timeout 200 $PY $root/benchmarks/bench_grouped_gemm.py --out "$OUT/eager_$tree" \
      --models Qwen3-30B-A3B GPT-OSS-20B --ep 16 32 --tokens 1024 --modes fwd_bwd \
      --impls torch_grouped_mm turbo-default --fp8 --rounds 3 > "$OUT/eager_$tree.log" 2>&1
    echo "== eager $tree rc=$?"
    grep -E "^\| grouped_gemm_fwd_bwd \| turbo-default \|" "$OUT/eager_$tree.log"
  done
fi
if [[ $STAGES == *" registry "* ]]; then
  timeout "${S43_REG_S:-300}" $PY benchmarks/bench_grouped_gemm.py --out "$OUT/registry" --impls torch_grouped_mm \
    turbo-default --fp8 --rounds 3 > "$OUT/registry.log" 2>&1
  echo "== registry rc=$?"
  grep -E "^\| grouped_gemm_fwd(_bwd)? \| turbo-default \|" "$OUT/registry.log"
  grep -E "^\| grouped_gemm_fwd" "$OUT/registry.log" | awk -F'|' '$5 ~ /turbo-default/ && $9+0 < 0.98' | cut -c1-160
fi
find "$OUT" -name "*.md" -delete
