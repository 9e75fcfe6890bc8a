#!/usr/bin/env bash
# The GPU path check, as one command for a lent GPU machine (see scripts/gpu_check.py); about 6-9 minutes.
# Prepare the wheels here first: scripts/gpu_wheels.sh (they travel in .whl/). Everything it writes,
# the log included, goes under $OUT (gpu_check_out when unset).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/nvidia-smi.txt" || true
python3 scripts/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
