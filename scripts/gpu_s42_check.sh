#!/usr/bin/env bash
# H200 pass of session 42: the issue-level re-runs that exist only on an H100 or in older sessions,
# stages in this order (S42_STAGES, default all), each under its own time limit, a short summary
# printed per stage, full output under OUT:
# blockwise: BLOCKWISE FP8 forward against BF16 cuBLAS over the 20 dense registry shapes, device time
#   (issue 3; on the H200 only partial runs before: s4, s6);
# linear: the FP8 linear step (TENSORWISE, BLOCKWISE) fwd+bwd against BF16 cuBLAS, Llama-3.1-8B
#   M 16384 (issue 3; last H200 run s38, before the s39-s40 host-time cuts);
# ggfp8: grouped FP8 TENSORWISE / ROWWISE registry forward against torch._scaled_grouped_mm in one
#   run with the Gluon default (issue 4);
# moe: the MoE layer fwd+bwd, four models, BF16 and FP8 BLOCKWISE against the TorchTitan-style
#   baseline (issue 6; last full run s26).
#
#   bash scripts/gpu_s42_check.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_s42_check.sh OUT}
mkdir -p "$OUT"
HERE="$(dirname "$0")"
source "$HERE/gpu_env.sh"
gpu_run_header "$OUT/header.log"; cat "$OUT/header.log"
STAGES=" ${S42_STAGES:-blockwise linear ggfp8 moe} "
if [[ $STAGES == *" blockwise "* ]]; then
  S41_STAGES=blockwise S41_BW_S="${S42_BW_S:-230}" bash "$HERE/gpu_s41_check.sh" "$OUT/bw"
fi
if [[ $STAGES == *" linear "* ]]; then
  S40_STAGES=linear S40_LINEAR_S="${S42_LINEAR_S:-230}" bash "$HERE/gpu_s40_check.sh" "$OUT/lin"
fi
if [[ $STAGES == *" ggfp8 "* ]]; then
  GG_STAGES=fp8 GG_FP8_S="${S42_GG_S:-240}" bash "$HERE/gpu_grouped_check.sh" "$OUT/gg"
fi
if [[ $STAGES == *" moe "* ]]; then
  timeout "${S42_MOE_S:-300}" $PY benchmarks/bench_moe_layer.py --out "$OUT/moe" > "$OUT/moe.log" 2>&1
  echo "moe rc=$?"; grep -E "moe_layer" "$OUT/moe.log" | cut -c1-150
fi
# the device returns few files: drop the markdown twins (the json and logs hold the same rows)
find "$OUT" -name "*.md" -delete
