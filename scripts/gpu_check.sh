#!/usr/bin/env bash
# Full check on a GPU machine: environment, the whole test suite, then the benchmarks.
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# The project does not need to be installed: PYTHONPATH is set to the repository root here.
# Writes OUT_DIR/pytest.log, OUT_DIR/bench.log and the benchmark results (OUT_DIR/*.json, *.md),
# and prints a short summary last. Test failures do not stop the benchmarks.
#
# Environment:
#   GPU_CHECK_SKIP_TESTS=1     skip the test suite
#   GPU_CHECK_SKIP_BENCH=1     skip the benchmarks
#   GPU_CHECK_BENCH_ARGS="..." extra arguments for benchmarks/run_all.py (e.g. "--quick")
#   GPU_CHECK_PYTEST_ARGS="..." extra arguments for pytest (e.g. "-k gemm")
#   GPU_CHECK_JOBS=N           pytest-xdist workers sharing the GPU (default 8)
#   GPU_CHECK_TEST_TIMEOUT=S   stop the test suite after S seconds (default: no limit)
#   GPU_CHECK_BENCH_TIMEOUT=S  stop the benchmarks after S seconds (default: no limit)
#   PYTHON=...                 interpreter (default python3)
set -u

if [ $# -lt 1 ]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1" || { echo "gpu_check: cannot create $1" >&2; exit 2; }
OUT_DIR="$(cd "$1" && pwd)"
PY="${PYTHON:-python3}"

export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
cd "$REPO_ROOT" || exit 2

echo "===== environment ====="
echo "repo: $REPO_ROOT  (git: $(git rev-parse --short HEAD 2>/dev/null || echo n/a))"
echo "out:  $OUT_DIR"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true
else
    echo "nvidia-smi: not found"
fi
"$PY" - <<'EOF' || echo "gpu_check: python/torch check failed"
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}, devices {torch.cuda.device_count()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except Exception as exc:
    print(f"triton: not importable ({exc!r})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
EOF

# ---- tests ------------------------------------------------------------------------------------
TEST_RC="skipped"
if [ "${GPU_CHECK_SKIP_TESTS:-0}" != "1" ]; then
    echo
    echo "===== tests ====="
    TIMEOUT_ARGS=()
    if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
        TIMEOUT_ARGS=(--timeout=900)
    else
        echo "gpu_check: pytest-timeout not installed; running without per-test timeouts"
    fi
    # shellcheck disable=SC2086
    # Every failure's traceback goes to failures.log the moment it happens (tests/conftest.py), and
    # -rA lists every outcome: a run cut short by a time limit still says what failed and why.
    : > "$OUT_DIR/failures.log"
    # Per-shape kernel tuning off for the suite's thousands of small shapes (the tests that check
    # tuning turn it on themselves); the benchmarks below run with it on, as users do.
    PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE="${PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE:-0}" \
    PRIMUS_TURBO_TEST_FAILURE_LOG="$OUT_DIR/failures.log" \
    ${GPU_CHECK_TEST_TIMEOUT:+timeout "$GPU_CHECK_TEST_TIMEOUT"} "$PY" -m pytest tests -q -n "${GPU_CHECK_JOBS:-8}" --maxfail=200 ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} \
        -p no:cacheprovider -p no:warnings ${GPU_CHECK_PYTEST_ARGS:-} 2>&1 | tee "$OUT_DIR/pytest.log"
    TEST_RC="${PIPESTATUS[0]}"
    echo "gpu_check: pytest exit code $TEST_RC"
fi

# ---- benchmarks -------------------------------------------------------------------------------
BENCH_RC="skipped"
if [ "${GPU_CHECK_SKIP_BENCH:-0}" != "1" ]; then
    echo
    echo "===== benchmarks ====="
    # shellcheck disable=SC2086
    ${GPU_CHECK_BENCH_TIMEOUT:+timeout "$GPU_CHECK_BENCH_TIMEOUT"} "$PY" benchmarks/run_all.py --out "$OUT_DIR" ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee "$OUT_DIR/bench.log"
    BENCH_RC="${PIPESTATUS[0]}"
    echo "gpu_check: benchmarks exit code $BENCH_RC"
fi

# ---- summary (last) ---------------------------------------------------------------------------
echo
echo "===== gpu_check summary ====="
if [ "$TEST_RC" = "skipped" ]; then
    echo "tests: skipped"
else
    # pytest's final line, e.g. "123 passed, 4 skipped in 56.78s"
    FINAL="$(grep -E '(passed|failed|error|errors|skipped|no tests ran)' "$OUT_DIR/pytest.log" 2>/dev/null | tail -n 1)"
    [ -n "$FINAL" ] || FINAL="$(tail -n 1 "$OUT_DIR/pytest.log" 2>/dev/null)"
    echo "tests (exit $TEST_RC): $FINAL"
    if [ -s "$OUT_DIR/failures.log" ]; then
        echo "failed tests (tracebacks in $OUT_DIR/failures.log):"
        grep '^==== ' "$OUT_DIR/failures.log" | head -40
    fi
fi
if [ "$BENCH_RC" = "skipped" ]; then
    echo "benchmarks: skipped"
else
    echo "benchmarks (exit $BENCH_RC): results in $OUT_DIR"
    found=0
    for md in "$OUT_DIR"/*.md; do
        [ -f "$md" ] || continue
        if grep -q '^## Geomean speedup' "$md"; then
            sed -n '/^## Geomean speedup/,$p' "$md"
            echo
            found=1
        fi
    done
    [ "$found" = 1 ] || echo "(no geomean tables found; see $OUT_DIR/bench.log)"
fi

STATUS=0
[ "$TEST_RC" = "skipped" ] || [ "$TEST_RC" = "0" ] || STATUS=1
[ "$BENCH_RC" = "skipped" ] || [ "$BENCH_RC" = "0" ] || STATUS=1
exit "$STATUS"
