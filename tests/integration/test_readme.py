"""The shell blocks of the README and of docs/, run as pasted: every block parses, and those that run on a CPU run and
succeed. Each block is run once, wherever it lives."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, harness_env, wait_session_empty

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PLACES = [(page.relative_to(REPO).as_posix(), block) for page in PAGES
          for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)]
BLOCKS = [block for _, block in PLACES]

# `python` for the blocks: the real interpreter, with `python -m harness` kept CPU-sized. A client
# run (target.url=) measures a small workload; any other run plans only (dry_run=true), which
# still composes the config and expands the sweep; each run gets a folder of its own. A sweep's report
# leaves its figures out (half a CPU-second a point; the blocks' sweeps hold over a hundred points, and the
# figures are test_plan_figure's and test_report_inputs' to check), as the suite's own runs do (unpaired).
SHIM = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "harness" ]; then
  shift 2
  n=$(date +%s%N)
  case " $* " in
    *" --cfg "*) exec {python} -m harness "$@" ;;
    *" target.url="*) exec {python} -m harness "$@" workload=smoke workload.n_examples=4 bench.warmup=0 \\
        bench.repeat=1 logger=none hydra.run.dir=outputs/readme-$n ;;
    *" -m "*) exec {python} -m harness "$@" dry_run=true hydra.sweep.dir=multirun/readme-$n \\
        hydra.callbacks.report.plots=false ;;
    *) exec {python} -m harness "$@" dry_run=true hydra.run.dir=outputs/readme-$n ;;
  esac
fi
exec {python} "$@"
"""

# `torchrun` for the blocks: the harness's arguments as written, as 2 ranks of a real torchrun on this
# machine (the block's node count, GPUs per node and rendezvous are a cluster's); `python` above plans.
TORCHRUN_SHIM = """#!{python}
import os, sys
args = sys.argv[1:]
harness = args[args.index("-m") + 2:] if "-m" in args else []
assert args[args.index("-m") + 1] == "harness", args
os.execv("{python}", ["{python}", "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
                      "--no-python", os.path.join(os.path.dirname(__file__), "python"), "-m", "harness", *harness])
"""

# `srun` for the blocks: the command as 2 tasks of one step on this machine, each with the variables
# Slurm gives a task (the job's own #SBATCH sizes are a cluster's).
SRUN_SHIM = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[1:]
env = dict(os.environ, SLURM_JOB_ID=str(os.getpid()), SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_NNODES="1",
           SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="127.0.0.1", MASTER_PORT=os.environ["PORT"])
tasks = [subprocess.Popen(args, env=dict(env, SLURM_PROCID=str(i), SLURM_LOCALID=str(i))) for i in range(2)]
sys.exit(max(t.wait() for t in tasks))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pasted(tmp_path):
    """Runs a block in a fresh folder whose `python` and `.venv/bin/python` are the shim."""
    for folder in (tmp_path / "bin", tmp_path / ".venv" / "bin"):
        folder.mkdir(parents=True)
        shim = folder / "python"
        shim.write_text(SHIM.format(python=sys.executable))
        shim.chmod(0o755)
    for name, text in (("torchrun", TORCHRUN_SHIM), ("srun", SRUN_SHIM)):
        shim = tmp_path / "bin" / name
        shim.write_text(text.format(python=sys.executable))
        shim.chmod(0o755)
    env = harness_env(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO),
                      PORT=str(_free_port()), BALANCE_BATCH_CACHE=str(tmp_path / "tokenized"))
    env.pop("BALANCE_BATCH_ADMIN_TOKEN", None)

    def run(block: str) -> subprocess.CompletedProcess:
        log = tmp_path / "block.log"  # a file, not a pipe: a server the block leaves behind must not hold it open
        with open(log, "w") as out:
            proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=540)
        finally:
            left = wait_session_empty(proc.pid, timeout_s=60)  # the server stops its workers first
            for p in left:  # a failed block may leave its server running: stop it, then fail
                p.kill()
        out = log.read_text()
        assert left == [], out  # the block stopped what it started
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    return run


def _runs_on_a_cpu(block: str) -> bool:
    # make runs the whole set-up and test suite; that is CI's job, not this test's
    return not re.search(r"^\s*make\b", block, flags=re.M)


def test_every_block_parses():
    assert len(BLOCKS) >= 4 and any(page.startswith("docs/") for page, _ in PLACES)
    for page, block in PLACES:
        proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert proc.returncode == 0, f"{page}:\n{block}\n{proc.stderr}"


@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if _runs_on_a_cpu(b)],
                         ids=lambda i: f"{PLACES[i][0]}-{sum(p == PLACES[i][0] for p, _ in PLACES[:i])}")
def test_block_runs_as_pasted(pasted, tmp_path, index):
    block = BLOCKS[index]
    proc = pasted(block)
    assert proc.returncode == 0, f"{block}\n{proc.stdout}"
    assert "Traceback" not in proc.stdout, proc.stdout
    results = [json.loads(p.read_text()) for p in Path(tmp_path).rglob("results.json")]
    if re.search(r"python -m harness |-m harness ", block):  # the benchmark ran (planned, or measured as a client)
        assert results and all(r["status"] in ("ok", "planned") for r in results)
    for launcher in ("torchrun", "srun"):  # one result, written by rank 0 of the 2 ranks the launcher started
        if re.search(rf"^\s*{launcher} ", block, flags=re.M):
            name = "slurm" if launcher == "srun" else launcher
            assert [r["launch"] for r in results] == [{"launcher": name, "nnodes": 1, "world_size": 2}], results
    if "target.url=" in block:  # the live-control block: the client measured through the server
        measured = [r for r in results if r["status"] == "ok"]
        assert len(measured) == 1 and measured[0]["mtpm"] == 32768 and measured[0]["target"]
        assert measured[0]["plan"]["max_tokens_per_microbatch"] == 32768
