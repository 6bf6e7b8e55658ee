#!/usr/bin/env bash
# Per-tile cost of the Gluon attention forwards (FP8 against bf16): the compare over a sequence
# scan at fixed tokens (the same tile count at every length, so the time per key block and the
# fixed cost per tile separate), then Nsight Compute on the shortest length, where the fixed
# cost weighs most, with per-instruction stall samples.
#
#   bash scripts/diag_attn_tile_cost.sh OUT_DIR
# Environment: DIAG_TESTS (pytest selection run first), DIAG_SEQS / DIAG_SEQS64 (head dim 128 / 64
# lengths), DIAG_CONFIGS (FP8 configs next to the default), DIAG_ROUNDS, DIAG_NO_NCU.
set -u
OUT="${1:?usage: bash scripts/diag_attn_tile_cost.sh OUT_DIR}"
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
if [ -n "${DIAG_TESTS:-}" ]; then  # GPU tests first (e.g. the configs about to be timed)
    timeout "${DIAG_TEST_S:-200}" $PY -m pytest -q -x -p no:cacheprovider $DIAG_TESTS > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest.log"
    tail -3 "$OUT/pytest.log"
fi
SEQS="${DIAG_SEQS:-1024 2048 4096 8192 16384}"
SEQS64="${DIAG_SEQS64:-1024 4096 16384}"
CFGS="${DIAG_CONFIGS:-n128s4kc2t}"
timeout "${DIAG_CMP_S:-240}" $PY scripts/check_gluon_attn_fp8.py --compare --no-tl --graph --rounds "${DIAG_ROUNDS:-3}" \
    --head-dims 128 64 --seq $SEQS --seq-d64 $SEQS64 --fp8-configs $CFGS --out "$OUT" > "$OUT/compare.log" 2>&1
echo "compare rc=$?" >> "$OUT/compare.log"
NCU_SEQ="${DIAG_NCU_SEQ:-1024}"
if [ -z "${DIAG_NO_NCU:-}" ] && command -v ncu > /dev/null; then
    ncu --version > "$OUT/ncu.log" 2>&1
    for case in fp8 bf16; do
        timeout 150 ncu --clock-control none --kernel-name regex:attn_ --launch-skip 1 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
            --section LaunchStats --section Occupancy --import-source no -f -o "$OUT/ncu_$case" \
            $PY scripts/ncu_attn.py --case $case --head-dim 128 --seq "$NCU_SEQ" >> "$OUT/ncu.log" 2>&1
        ncu -i "$OUT/ncu_$case.ncu-rep" --print-details all > "$OUT/ncu_${case}_details.txt" 2>&1
        ncu -i "$OUT/ncu_$case.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${case}_sass.csv" 2>> "$OUT/ncu.log"
        gzip -f "$OUT/ncu_${case}_sass.csv"
        rm -f "$OUT/ncu_$case.ncu-rep"
    done
fi
tar czf "$OUT/all.tgz" -C "$OUT" --exclude all.tgz . 2>/dev/null
grep -E "TFLOP|geomean" "$OUT/compare.log" | cut -c1-220
tail -3 "$OUT/ncu.log"
