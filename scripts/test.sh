#!/usr/bin/env bash
# The test suite on a CPU-only machine: Triton kernels run through the Triton interpreter
# (tests/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA device).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu_env.sh
JOBS=${PYTEST_JOBS:-2}
exec .venv/bin/python -m pytest tests -q -n "$JOBS" --timeout=900 -p no:cacheprovider "$@"
