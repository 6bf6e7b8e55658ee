#!/usr/bin/env bash
# Sets up the CPU environment and runs the quick-start demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu_env.sh
exec .venv/bin/python examples/quickstart.py "$@"
