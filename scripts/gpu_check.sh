#!/usr/bin/env bash
# The GPU path check, as one command for a lent GPU machine (see scripts/gpu_check.py); --budget-s 450 by default.
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
# BUILD_KERNELS="causal-conv1d flash-attn" compiles those sources (scripts/gpu_wheels.sh with KERNELS=1) against
# this machine's torch for its own GPU architecture first; the build's minutes count against the run's time.
for name in ${BUILD_KERNELS:-}; do
  src=$(ls .whl/src/"${name//-/_}"-*.tar.gz 2>/dev/null | head -1)
  if [ -z "$src" ]; then echo "BUILD_KERNELS: no source for $name in .whl/src (KERNELS=1 scripts/gpu_wheels.sh)"; continue; fi
  arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 9.0)
  echo "building $src for sm $arch"
  CAUSAL_CONV1D_FORCE_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" \
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site "$src" \
    2>&1 | tail -5 | tee -a "$out/kernel_build.log" || echo "building $name failed: the torch fallback runs"
  export PYTHONPATH=/tmp/site
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/nvidia-smi.txt" || true
python3 scripts/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
