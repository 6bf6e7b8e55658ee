#!/usr/bin/env bash
# One device call over the candidates prepared on CPU (benchmarks/results/h200/NOTES.md, "Changed after
# the last GPU call"): their GPU tests first, then their timings next to the defaults in the same run.
#   - the FP8 attention forward's opt-in q (two Q buffers for the persistent CTAs);
#   - the one- and two-warp programs of the two-copy quantizers (FP8 MX / BLOCKWISE, MXFP4).
#
#   bash scripts/gpu_candidates.sh OUT_DIR
set -u
OUT="${1:?usage: bash scripts/gpu_candidates.sh OUT_DIR}"
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
timeout "${CAND_TEST_S:-150}" $PY -m pytest -q -n 8 -p no:cacheprovider \
    tests/triton/test_flash_attn_fp8_gluon.py -k "persistent_rounds or kc2tq" > "$OUT/pytest.log" 2>&1
echo "pytest (attention) rc=$?" >> "$OUT/pytest.log"
timeout "${CAND_TEST_S:-150}" $PY -m pytest -q -n 8 -p no:cacheprovider \
    tests/triton/test_quant_fp8_packed.py tests/triton/test_quant_fp4_packed.py >> "$OUT/pytest.log" 2>&1
echo "pytest (quantizers) rc=$?" >> "$OUT/pytest.log"
timeout 200 $PY scripts/check_gluon_attn_fp8.py --compare --no-tl --graph --rounds 3 --head-dims 128 64 \
    --seq 1024 4096 16384 --seq-d64 1024 4096 --fp8-configs n128s4kc2t n128s4kc2tq n128s4kc2ltq n128s4kc2ltqx3j \
    --out "$OUT/attn" > "$OUT/attn.log" 2>&1
echo "attn rc=$?" >> "$OUT/attn.log"
timeout 240 $PY scripts/tune_quant.py --out "$OUT/quant" --only with_trans_mx with_trans_blockwise fp4_with_trans \
    --shapes 16384x7168 --match "1, 'packed" "2, 'packed" > "$OUT/quant.log" 2>&1
echo "quant rc=$?" >> "$OUT/quant.log"
grep -E "passed|failed|rc=" "$OUT/pytest.log"
grep -E "TFLOP|geomean|rc=" "$OUT/attn.log" | cut -c1-260
tail -25 "$OUT/quant.log"
true
