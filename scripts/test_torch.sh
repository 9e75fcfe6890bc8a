#!/usr/bin/env bash
# The GPU-relevant tests against another torch, in an environment of its own (.venv-torch<major.minor>, git-ignored),
# so the code is checked on the torch a GPU machine brings (2.11 on the one this project is lent) without touching
# .venv. Needs the package index: torch's Linux wheels there are CUDA builds that import only with their nvidia-*
# packages (a few GB, downloaded once); on a machine without a GPU they run on CPU like the CPU build.
#
#   scripts/test_torch.sh 2.11.0                 # create the env (once), then run the tests below
#   scripts/test_torch.sh 2.11.0 -k packed       # extra arguments go to pytest
#
# The tests: the GPU check's (unit and integration), compiling (unit, and the compiled cells: fsdp2 bf16 packed,
# megatron_ddp bf16 padded, pytorch float32 packed from the command line), the kernel paths, the host syncs of the
# packed path, and the fork server's CUDA guard.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: scripts/test_torch.sh TORCH_VERSION [pytest args], e.g. 2.11.0}"
shift
[[ "$version" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] || { echo "TORCH_VERSION: '$version' is not a release like 2.11.0" >&2; exit 2; }
venv=".venv-torch${version%.*}"
[[ "$version" =~ ^[0-9]+\.[0-9]+$ ]] && venv=".venv-torch$version"
py="$venv/bin/python"
if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  echo "creating $venv with torch $version (the first time downloads torch and its CUDA libraries)"
  "${PYTHON:-python3}" -m venv "$venv"
  "$py" -m pip install --quiet "torch==$version"
  # the project's other pins from the same places `make setup` uses; torch stays the one above
  echo "torch==$version" > "$venv/torch-pin.txt"
  "$py" -m pip install --quiet -c "$venv/torch-pin.txt" -r requirements/harness.txt -r requirements/test.txt
  "$py" -m pip install --quiet --no-deps --config-settings editable_mode=compat -e .
fi
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
exec "$py" -m pytest -q -p no:randomly -n 0 \
  tests/unit/test_gpu_check.py tests/integration/test_gpu_check.py \
  tests/unit/test_compiling.py tests/integration/test_compile.py \
  tests/unit/balance_batch/integrations/transformers/test_kernels.py tests/unit/test_host_syncs.py \
  "tests/integration/test_distributed.py::test_the_fork_server_imports_nothing_that_makes_a_cuda_context" "$@"
