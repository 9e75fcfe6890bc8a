#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (it has torch, and maybe other versions of transformers, peft and
# accelerate, and no registry access), for its Python 3.12, x86-64 manylinux. They go to .whl/.
#
# Every package the harness imports at run time is pinned, with every package those need: the closure of the
# project's runtime imports, each at the version this venv has (the one the tests ran on), read from the venv's own
# metadata. Left out: torch and what torch itself requires (the GPU machine's CUDA build brings its own), and numpy
# (that machine's other compiled packages were built against its own). fla, which this CPU venv does not hold, is
# pinned by hand below.
#
#   scripts/gpu_wheels.sh              # the pins, then pip download into .whl/
#   PINS_ONLY=1 scripts/gpu_wheels.sh  # print the pins and stop (nothing downloaded)
#   KERNELS=1 scripts/gpu_wheels.sh    # also the flash-attn and causal-conv1d sources, built by gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv_python="${PYTHON:-.venv/bin/python}"
[ -x "$venv_python" ] || { echo "PYTHON: $venv_python is not an interpreter; set PYTHON to the tested venv's" >&2; exit 2; }

# The harness's runtime imports (python -m harness and its ranks; the report and W&B are not run by gpu_check).
roots=(transformers peft accelerate safetensors tokenizers huggingface-hub megatron-core hydra-core omegaconf
       nvidia-ml-py psutil)
# Not in the CPU venv: fla (the gated delta rule's and the short convolution's Triton kernels) and what it needs,
# pinned once, in requirements/gpu.txt.
mapfile -t fixed < <(grep -v '^\s*\(#\|$\)' requirements/gpu.txt)

mapfile -t pins < <("$venv_python" - "${roots[@]}" <<'EOF'
import re
import sys
from importlib import metadata


def name(requirement: str) -> str:
    return re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def needs(dist: str) -> list[str]:
    """What ``dist`` requires on this interpreter (markers evaluated; extras left out)."""
    from packaging.requirements import Requirement

    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(name(text))
    return out


def closure(roots: list[str]) -> dict[str, str]:
    seen: dict[str, str] = {}
    stack = list(roots)
    while stack:
        dist = stack.pop()
        if dist in seen:
            continue
        try:
            seen[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            sys.exit(f"{dist}: required but not installed in {sys.executable}")
        stack += needs(dist)
    return seen


torch_side = set(closure(["torch"])) | {"numpy"}  # the GPU machine's torch brings these, built for it
for dist, version in sorted(closure(sys.argv[1:]).items()):
    if dist not in torch_side:
        print(f"{dist}=={version}")
EOF
)
pins+=("${fixed[@]}")
if [ "${PINS_ONLY:-0}" = 1 ]; then
  printf '%s\n' "${pins[@]}"
  exit 0
fi

exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
py=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform any --only-binary=:all: --no-deps -d .whl)
sdist_only=(antlr4-python3-runtime)  # published as source only: built into a pure-Python wheel here
binary=()
for pin in "${pins[@]}"; do
  case " ${sdist_only[*]} " in *" ${pin%%==*} "*) python3 -m pip wheel -q --no-deps -w .whl "$pin" ;; *) binary+=("$pin") ;; esac
done
python3 -m pip download "${py[@]}" "${binary[@]}"

# Optional CUDA kernels, pinned at their latest releases: flash-attn 2.8.3.post2 (packed full attention,
# flash_attn_varlen_func) and causal-conv1d 1.7.0 (the short convolution). PyPI has source distributions
# only for both, so they are compiled on the GPU machine against its own torch and CUDA, for its one
# architecture (scripts/gpu_check.sh with BUILD_KERNELS): flash-attn's setup.py reads FLASH_ATTN_CUDA_ARCHS;
# causal-conv1d's hard-codes its -gencode list (sm75 to sm121), which gpu_check.sh rewrites to the one present.
# Without them the harness runs the torch fallbacks and results.json says so (passes.<type>.kernels).
kernel_pins=(causal-conv1d==1.7.0 flash-attn==2.8.3.post2)
if [ "${KERNELS:-0}" = 1 ]; then
  mkdir -p .whl/src
  # Preparing their metadata imports torch (any build; the venv's CPU one will do) and would compile: skip that.
  CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE \
    "$venv_python" -m pip download --no-deps --no-binary=:all: --no-build-isolation -d .whl/src "${kernel_pins[@]}"
fi
du -sh .whl
