# Sourced by the GPU job scripts (gpu_session.sh, gpu_attn_fp8_final.sh,
# diag_attn_tile_cost.sh): the project on PYTHONPATH (it is pure Python, run from the checkout),
# unbuffered output (a call cut by its limit keeps what was printed), the interpreter as PY.
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
