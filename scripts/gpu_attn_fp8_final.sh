#!/usr/bin/env bash
# The FP8 attention forward's GPU pass: its tests (the Gluon kernel's and the op's), then the issue's
# eight rows against our bf16 Gluon forward (device time, interleaved rounds), then extra rows.
#
#   bash scripts/gpu_attn_fp8_final.sh OUT_DIR
# Environment: FINAL_TEST_S (test time limit), FINAL_ROUNDS, FINAL_EXTRA (extra compare arguments;
# FINAL_EXTRA_S: their time limit;
# empty: none).
set -u
OUT="${1:?usage: bash scripts/gpu_attn_fp8_final.sh OUT_DIR}"
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
timeout "${FINAL_TEST_S:-280}" $PY -m pytest -q -n 8 -p no:cacheprovider tests/triton/test_flash_attn_fp8_gluon.py \
    tests/pytorch/ops/test_attention_fp8.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.log"
timeout 200 $PY scripts/check_gluon_attn_fp8.py --compare --no-tl --graph --rounds "${FINAL_ROUNDS:-7}" \
    --head-dims 128 64 --seq 4096 16384 --seq-d64 4096 16384 --fp8-configs --out "$OUT/final" > "$OUT/final.log" 2>&1
echo "compare rc=$?" >> "$OUT/final.log"
if [ -n "${FINAL_EXTRA:-}" ]; then
    timeout "${FINAL_EXTRA_S:-120}" $PY scripts/check_gluon_attn_fp8.py --compare --no-tl --graph $FINAL_EXTRA --out "$OUT/extra" \
        > "$OUT/extra.log" 2>&1
    echo "extra rc=$?" >> "$OUT/extra.log"
fi
grep -E "passed|failed|rc=" "$OUT/pytest.log" | tail -3
grep -E "TFLOP|geomean|rc=" "$OUT/final.log" | cut -c1-200
[ -f "$OUT/extra.log" ] && grep -E "TFLOP|geomean|rc=" "$OUT/extra.log" | cut -c1-250
true
