#!/usr/bin/env bash
# The GPU check as one command for a lent GPU machine (scripts/gpu_check.py; --budget-s 300 by default, --plan to
# see its steps first). Prepare the wheels here first: scripts/gpu_wheels.sh (they travel in .whl/). Everything it
# writes, the log included, goes under $OUT (gpu_check_out when unset); read $OUT/summary.json first.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# BUILD_KERNELS="causal-conv1d flash-attn" compiles those sources (KERNELS=1 scripts/gpu_wheels.sh) against this
# machine's torch, for its own GPU architecture only; the build's minutes count against the run's time.
# Each build is limited the way its setup.py reads it: flash-attn by FLASH_ATTN_CUDA_ARCHS ("90"; it ignores
# TORCH_CUDA_ARCH_LIST), causal-conv1d by nothing (it hard-codes sm75..sm121, and torch's TORCH_CUDA_ARCH_LIST is
# dropped once a -gencode is given), so its setup.py's list is replaced by this GPU's before building.
arch=$(python3 -c "import torch; print('%d%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 90)
for name in ${BUILD_KERNELS:-}; do
  src=$(ls .whl/src/"${name//-/_}"-*.tar.gz .whl/src/"$name"-*.tar.gz 2>/dev/null | head -1)
  if [ -z "$src" ]; then echo "BUILD_KERNELS: no source for $name in .whl/src (KERNELS=1 scripts/gpu_wheels.sh)"; continue; fi
  build=/tmp/kernel-build/$name
  rm -rf "$build" && mkdir -p "$build" && tar -xzf "$src" -C "$build" --strip-components=1
  if [ "$name" = causal-conv1d ]; then
    python3 - "$build/setup.py" "$arch" <<'EOF' || { echo "causal-conv1d: its setup.py changed; not built"; continue; }
import re
import sys

path, arch = sys.argv[1], sys.argv[2]
text = open(path).read()
anchor = "\n    if FORCE_CXX11_ABI:"
if text.count(anchor) != 1 or '"-gencode"' not in text:
    sys.exit(1)
one = f'\n    cc_flag = ["-gencode", "arch=compute_{arch},code=sm_{arch}"]  # gpu_check.sh: this GPU only'
open(path, "w").write(text.replace(anchor, one + anchor))
EOF
  fi
  echo "building $name for sm_$arch"
  CAUSAL_CONV1D_FORCE_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="$arch" \
    TORCH_CUDA_ARCH_LIST="${arch:0:-1}.${arch: -1}" MAX_JOBS="$(nproc)" \
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site "$build" \
    2>&1 | tail -5 | tee -a "$out/kernel_build.log" || echo "building $name failed: the torch fallback runs"
  export PYTHONPATH=/tmp/site
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/nvidia-smi.txt" || true
python3 scripts/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
