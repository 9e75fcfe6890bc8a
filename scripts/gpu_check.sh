#!/usr/bin/env bash
# The GPU path check, as one command for a lent GPU machine (see scripts/gpu_check.py).
# Prepare the wheels here first: scripts/gpu_wheels.sh (they travel in .whl/).
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 scripts/gpu_check.py --out "${OUT:-gpu_check_out}" "$@" 2>&1 | tee "${OUT:-gpu_check_out}.log"
exit "${PIPESTATUS[0]}"
