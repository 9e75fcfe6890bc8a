#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (it has torch, transformers and peft, but maybe
# not new enough, and no registry access). Python 3.12 (the GPU machine's python3, whatever this one is),
# x86-64 manylinux. They go to .whl/.
# Every version is pinned: the ones this project is tested with (the venv's), and kernel packages
# at the release checked against them, so the GPU machine runs what was tested, whatever python3 has here.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
py=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform any --only-binary=:all: --no-deps -d .whl)
pins=(
  hydra-core==1.3.8 omegaconf==2.3.1 megatron-core==0.16.1
  transformers==5.24.0 huggingface-hub==2.4.0 peft==0.21.2 tokenizers==0.23.3 safetensors==0.8.0
  flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 nvidia-ml-py==13.615.71
)
# A venv whose versions drifted from the pins is worth a warning: the wheels would not be what the tests ran on.
venv_python="${PYTHON:-.venv/bin/python}"
if [ -x "$venv_python" ]; then
  for pin in "${pins[@]}"; do
    name="${pin%%==*}"; want="${pin#*==}"
    have=$("$venv_python" -c "from importlib import metadata as m; print(m.version('$name'))" 2>/dev/null || true)
    if [ -n "$have" ] && [ "$have" != "$want" ]; then echo "note: $name $have in $venv_python, pinned $want here" >&2; fi
  done
fi
python3 -m pip download "${py[@]}" "${pins[@]}"
# antlr4 4.9.3 (what omegaconf 2.3 needs) is published as source only: build its pure-Python wheel here.
python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3

# Optional CUDA kernels, pinned at their latest releases: flash-attn 2.8.3.post2 (packed full attention,
# flash_attn_varlen_func) and causal-conv1d 1.7.0 (the short convolution). PyPI has source distributions
# only for both (their prebuilt wheels are GitHub release assets, built for older torch and CUDA 12, and
# that host is out of reach), so they must be compiled against the GPU machine's own torch and CUDA.
# Without them the harness runs the torch fallbacks and results.json says so (passes.<type>.kernels).
# KERNELS=1 fetches the sources into .whl/src (not installed by gpu_check.sh unless BUILD_KERNELS names
# them): causal-conv1d compiles in minutes for one architecture; flash-attn takes far longer than a
# 10-minute device run, so build it once on a machine that keeps it.
kernel_pins=(causal-conv1d==1.7.0 flash-attn==2.8.3.post2)
if [ "${KERNELS:-0}" = 1 ]; then
  mkdir -p .whl/src
  # Preparing their metadata imports torch (any build; the venv's CPU one will do) and would compile: skip that.
  CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE \
    "$venv_python" -m pip download --no-deps --no-binary=:all: --no-build-isolation -d .whl/src "${kernel_pins[@]}"
fi
du -sh .whl
