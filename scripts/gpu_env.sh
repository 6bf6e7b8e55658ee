# Sourced by the GPU job scripts (gpu_session.sh, gpu_attn_fp8_final.sh,
# diag_attn_tile_cost.sh): the project on PYTHONPATH (it is pure Python, run from the checkout),
# unbuffered output (a call cut by its limit keeps what was printed), the interpreter as PY.
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

# gpu_run_header LOG: the GPU, its power limit and clocks, the torch / triton versions and the date
# at the top of a job's log (overwrites LOG).
gpu_run_header() {
  { nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } > "$1" 2>&1
}
