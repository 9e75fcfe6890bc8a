#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (it has torch, transformers and peft, but maybe
# not new enough, and no registry access). Python 3.12, x86-64 manylinux. They go to .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
py=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform any --only-binary=:all: --no-deps -d .whl)
python3 -m pip download "${py[@]}" \
  hydra-core==1.3.8 omegaconf==2.3.1 \
  megatron-core==0.16.1 "transformers==$(python3 -c 'import transformers; print(transformers.__version__)')" \
  "huggingface-hub==$(python3 -c 'import huggingface_hub; print(huggingface_hub.__version__)')" \
  "peft==$(python3 -c 'import peft; print(peft.__version__)')" \
  "tokenizers==$(python3 -c 'import tokenizers; print(tokenizers.__version__)')" \
  "safetensors==$(python3 -c 'import safetensors; print(safetensors.__version__)')" \
  flash-linear-attention fla-core einops
# antlr4 4.9.3 (what omegaconf 2.3 needs) is published as source only: build its pure-Python wheel here.
python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
du -sh .whl
