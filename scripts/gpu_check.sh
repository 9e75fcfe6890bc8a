#!/usr/bin/env bash
# The GPU check as one command for a lent GPU machine (scripts/gpu_check.py; --plan shows its steps first, other
# arguments go to it). Prepare the wheels here first: scripts/gpu_wheels.sh (they travel in .whl/).
#
# --plan prints the steps and their estimates and stops: nothing installed, run or written.
#
# Everything is written under a scratch folder ($GPU_CHECK_SCRATCH, default /tmp/gpu_check; a rerun on the same
# machine reuses its Triton and inductor caches), and after every step gpu_check.py copies at most 8 files to $OUT
# (gpu_check_out when unset), none in a folder, each written whole: summary.json (read it first), gpu_check.log,
# kernels.log when kernels were built, one log per step, gpu_check_results.tar.gz (each point's results.json and
# configs: small) and, at the end, gpu_check_rest.tar.gz with the rest (traces, Triton's and inductor's caches). A
# later run starts warm from that cache:
#   tar -xzf gpu_check_rest.tar.gz triton && TRITON_CACHE_DIR=$PWD/triton scripts/gpu_check.sh
# Stopped (SIGTERM, SIGINT: an outer time limit), the check stops the harness and its ranks, records the cut step
# and the finished ones in summary.json and has copied what finished: the Python check replaces this shell (exec),
# so the signal reaches it; before that, a stop is written to summary.json here.
#
# A package the harness needs that neither the machine nor .whl/ has stops it at once, in one line (exit 2).
# BUILD_KERNELS="causal-conv1d flash-attn" also compiles those sources (KERNELS=1 scripts/gpu_wheels.sh) against
# this machine's torch, for its own GPU only, each under KERNEL_BUILD_TIMEOUT_S (default 600), output in kernels.log;
# without it the check runs SDPA and the torch convolution (flash-attn alone builds for tens of minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
scratch="${GPU_CHECK_SCRATCH:-/tmp/gpu_check}"
py="${PYTHON:-python3}"
fail() {  # one line on stderr and in $OUT's gpu_check.log and summary.json, then exit with $1
  local code=$1
  shift
  echo "gpu_check: $*" >&2
  if mkdir -p "$out" 2>/dev/null; then
    echo "gpu_check: $*" > "$out/gpu_check.log"
    local text=${*//\\/\\\\}
    printf '{"ok": false, "error": "%s"}\n' "${text//\"/\\\"}" > "$out/summary.json"
  fi
  exit "$code"
}
command -v "$py" >/dev/null 2>&1 || fail 2 "no $py on PATH: set PYTHON to the machine's Python (3.11 or newer)"
for arg in "$@"; do
  [ "$arg" = --plan ] && exec "$py" scripts/gpu_check.py "$@"  # the plan alone: before anything is installed
done
mkdir -p "$scratch" || fail 2 "GPU_CHECK_SCRATCH: cannot create $scratch"
rm -rf "$scratch"/*.log "$scratch/summary.json" "$scratch/runs" "$scratch/conf" "$scratch/nvidia-smi.txt"
log="$scratch/gpu_check.log"
# A stop before the check starts: the running install or build is stopped (its process group) and summary.json says
# where it was. Each long child runs in the background and is waited for, so a signal is acted on at once.
child=""
stopped() {  # exit code, signal
  [ -n "$child" ] && kill -TERM -- "-$child" 2>/dev/null
  local line="stopped by $2 before the check started (installing .whl/ or building kernels): no step ran"
  echo "gpu_check: $line" | tee -a "$log" >&2
  mkdir -p "$out" && cp "$log" "$out/gpu_check.log" &&
    printf '{"ok": false, "error": "%s", "cut": {"by": "%s", "step": null, "finished": []}}\n' "$line" "$2" \
    > "$out/summary.json"
  exit "$1"
}
trap 'stopped 143 SIGTERM' TERM
trap 'stopped 130 SIGINT' INT
trap 'stopped 129 SIGHUP' HUP
waited() {  # run "$@" as its own process group in the background and wait for it
  setsid "$@" &
  child=$!
  wait "$child"
  local rc=$?
  child=""
  return $rc
}

if ls .whl/*.whl >/dev/null 2>&1; then
  echo "installing .whl/ into $scratch/site" | tee -a "$log"
  waited "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch/site" \
    .whl/*.whl >> "$log" 2>&1 || fail 1 "installing .whl/ failed: see the end of $log"
  export PYTHONPATH="$scratch/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# What the harness imports, looked up without importing (seconds, even where torch is slow to import)
missing=$("$py" - <<'EOF'
import importlib.util

needed = {"torch": "torch", "transformers": "transformers", "peft": "peft", "accelerate": "accelerate",
          "safetensors": "safetensors", "hydra": "hydra-core", "omegaconf": "omegaconf",
          "megatron.core": "megatron-core", "psutil": "psutil", "pynvml": "nvidia-ml-py"}
gone = []
for module, dist in needed.items():
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        gone.append(dist)
print(", ".join(gone))
EOF
) || fail 2 "$py cannot run a script: set PYTHON to a working Python (3.11 or newer)"
if [ -n "$missing" ]; then
  where=$([ -d .whl ] && echo ".whl/ lacks them" || echo "no .whl/ here")
  fail 2 "missing $missing ($where): run scripts/gpu_wheels.sh where PyPI is reachable and bring .whl/ along"
fi

# Caches under the scratch folder, so they go back in the tarball and a rerun here starts warm
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$scratch/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$scratch/inductor}"

# Each build is limited the way its setup.py reads it: flash-attn by FLASH_ATTN_CUDA_ARCHS (it ignores
# TORCH_CUDA_ARCH_LIST), causal-conv1d by nothing (it hard-codes sm75..sm121, and torch's TORCH_CUDA_ARCH_LIST is
# dropped once a -gencode is given), so its setup.py's list is replaced by this GPU's before building.
if [ -n "${BUILD_KERNELS:-}" ]; then
  arch=$("$py" -c "import torch; print('%d%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 90)
  for name in $BUILD_KERNELS; do
    src=$(ls .whl/src/"${name//-/_}"-*.tar.gz .whl/src/"$name"-*.tar.gz 2>/dev/null | head -1)
    if [ -z "$src" ]; then echo "BUILD_KERNELS: no source for $name in .whl/src (KERNELS=1 scripts/gpu_wheels.sh)" | tee -a "$log"; continue; fi
    build="$scratch/build/$name"
    rm -rf "$build" && mkdir -p "$build" && tar -xzf "$src" -C "$build" --strip-components=1
    if [ "$name" = causal-conv1d ]; then
      "$py" - "$build/setup.py" "$arch" <<'EOF' || { echo "causal-conv1d: its setup.py changed; not built" | tee -a "$log"; continue; }
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
    limit="${KERNEL_BUILD_TIMEOUT_S:-600}"
    echo "building $name for sm_$arch (at most $limit s; output in kernels.log)" | tee -a "$log"
    if CAUSAL_CONV1D_FORCE_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="$arch" \
      TORCH_CUDA_ARCH_LIST="${arch:0:-1}.${arch: -1}" MAX_JOBS="$(nproc)" \
      waited timeout "$limit" "$py" -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir \
      --target "$scratch/site" "$build" >> "$scratch/kernels.log" 2>&1; then
      echo "built $name" | tee -a "$log"
    else
      echo "building $name failed or passed $limit s (kernels.log): the torch fallback runs" | tee -a "$log"
    fi
  done
  export PYTHONPATH="$scratch/site${PYTHONPATH:+:$PYTHONPATH}"
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$scratch/nvidia-smi.txt" 2>&1
fi
mkdir -p "$out" || fail 1 "OUT: cannot create $out"
# The check itself replaces this shell, so a stop signal reaches it: it writes gpu_check.log itself (after the lines
# above) and copies to $OUT after every step
exec "$py" scripts/gpu_check.py --out "$scratch" --back "$out" "$@"
