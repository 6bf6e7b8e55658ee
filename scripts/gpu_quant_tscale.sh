#!/usr/bin/env bash
# H200 check and timing of the two-copy FP8 quantizer with its scales stored transposed ("tscale"):
# the pair-kernel GPU tests (bit-exact against the reference), then scripts/tune_quant.py on the
# tscale candidates next to the defaults (x the device copy in the same run), then the stage
# removal of the MX kernel with and without tscale.   bash scripts/gpu_quant_tscale.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_quant_tscale.sh OUT}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout "${TS_TEST_S:-150}" $PY -m pytest -q -n 8 -p no:cacheprovider tests/triton/test_quant_fp8_packed.py -k gpu \
    > "$OUT/pytest_packed.log" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/pytest_packed.log"
timeout "${TS_TUNE_S:-240}" $PY scripts/tune_quant.py --out "$OUT" --only with_trans_mx with_trans_blockwise \
    --shapes 16384x7168 8192x14336 --match tscale ${TS_MATCH_EXTRA:-} > "$OUT/tune_quant.log" 2>&1
echo "tune rc=$?"
for o in "" tscale; do
  timeout 60 $PY scripts/diag_quant_stages.py --mx ${o:+--opts $o} > "$OUT/stages_mx_${o:-default}.txt" 2>&1
  timeout 60 $PY scripts/diag_quant_stages.py ${o:+--opts $o} > "$OUT/stages_bw_${o:-default}.txt" 2>&1
done
for f in "$OUT"/stages_*.txt; do echo "== $(basename "$f")"; cat "$f"; done
grep -E "copy|x copy|default|tscale" "$OUT/tune_quant.log" | tail -40
