#!/usr/bin/env bash
# Creates .venv with the CPU test stack (idempotent). Pins: torch 2.13.0 (the CPU build), triton
# 3.6.0 (the GPU machines' version, whose interpreter runs our kernels on CPU) and numpy<2.3
# (numpy 2.4 breaks the interpreter's loops over runtime integers).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check \
  "torch==2.13.0" "triton==3.6.0" "numpy<2.3" "pytest>=8" pytest-timeout pytest-xdist
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
