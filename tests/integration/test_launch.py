"""A point run under an external launcher: two real torchrun "nodes" on 127.0.0.1, and a conflicting world_size on the
command line."""

from __future__ import annotations

import math
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.conftest import harness_env, load_json, run_harness, wait_session_empty

# A few small examples; sizes as in tests/integration/test_distributed.py.
POINT = ("workload=smoke", "workload.n_examples=6", "mtpm=700", "bench.warmup=0", "bench.repeat=1",
         "bench.save_outputs=true", "logger=none")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(workdir: Path, *args: str, nnodes: int = 2) -> list[subprocess.Popen]:
    """``torchrun --nnodes=2 --nproc-per-node=1 --node-rank i`` per "node", each in its own folder and session."""
    port = _free_port()
    procs = []
    for node in range(nnodes):
        cwd = workdir / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
                   f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   "--max-restarts=0", "-m", "harness", *args]
        with open(cwd / "node.log", "w") as out:
            procs.append(subprocess.Popen(command, cwd=cwd, env=harness_env(), stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return procs


def node_logs(workdir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(workdir.glob("node*/node.log")))


def results_files(workdir: Path) -> list[Path]:
    return sorted(p for p in workdir.rglob("results.json") if "spawned" not in p.parts)


def rank_process(procs: list[subprocess.Popen], rank: int) -> psutil.Process:
    """The worker process torchrun started for a global rank (the c10d rendezvous assigns ranks in arrival order)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for agent in procs:
            for child in psutil.Process(agent.pid).children(recursive=True):
                try:
                    if child.environ().get("RANK") == str(rank) and "harness" in child.cmdline():
                        return child
                except psutil.Error:
                    continue
        time.sleep(0.2)
    raise AssertionError(f"no process for rank {rank}")


def test_conflicting_world_size_is_one_line_and_exit_2(workdir):
    """RANK/WORLD_SIZE set by a launcher, world_size= disagreeing: one line naming world_size, status 2, no
    traceback."""
    port = str(_free_port())
    # rank 1 of the job, started as the launcher would: it serves rank 0 and leaves when told to
    rank1 = subprocess.Popen([sys.executable, "-m", "harness", "backend=fsdp2", "world_size=3", *POINT], cwd=workdir,
                             env=harness_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                                             MASTER_PORT=port),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    env = harness_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    proc = run_harness("backend=fsdp2", "world_size=3", *POINT, "hydra.run.dir=run", cwd=workdir, env=env, timeout=120)
    rank1.communicate(timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "world_size: 3 conflicts" in line]
    assert lines and "Traceback" not in proc.stdout + proc.stderr
    assert load_json(workdir / "run" / "results.json")["status"] == "error"


def test_under_torchrun_a_conflicting_world_size_is_named_in_torchruns_summary(workdir):
    """torchrun's summary once said "To enable traceback see ..." for rank 0's exit 2; it names the line now.

    torchrun itself exits 1 whenever a rank fails (its own status, not the harness's); the rank's exitcode is 2.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
               f"--master-port={_free_port()}", "--max-restarts=0", "-m", "harness", "backend=fsdp2",
               "world_size=3", "dry_run=true", "workload=smoke", "hydra.run.dir=run"]
    proc = subprocess.run(command, cwd=workdir, env=harness_env(), capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # torchrun's own status for a failed job
    summary = out[out.index("Root Cause"):]
    assert "exitcode  : 2" in summary and "world_size: 3 conflicts" in summary, out
    assert "To enable traceback" not in summary
    assert load_json(workdir / "run" / "results.json")["status"] == "error"


@pytest.mark.parametrize("backend", ["fsdp2", "megatron_ddp"])
def test_two_torchrun_nodes_match_the_spawned_ranks(workdir, backend):
    """Same per-example losses and gradient norm as the harness's own 2 ranks; one results.json; nothing left."""
    spawned = run_harness(f"backend={backend}", "world_size=2", *POINT, f"hydra.run.dir={workdir / 'spawned'}",
                          cwd=workdir, timeout=300)
    assert spawned.returncode == 0, spawned.stdout + spawned.stderr
    # No hydra.run.dir: each "node" would name its own outputs/<date>/<time> folder; only rank 0 may write one.
    procs = start_nodes(workdir, f"backend={backend}", *POINT)
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], node_logs(workdir)
    files = results_files(workdir)
    assert len(files) == 1, files
    doc = load_json(files[0])
    assert doc["status"] == "ok" and doc["world_size"] == 2
    assert doc["launch"] == {"launcher": "torchrun", "nnodes": 2, "world_size": 2}
    assert len(list(workdir.rglob("plan.json"))) == 2  # the spawned run's and rank 0's
    got = load_json(files[0].parent / "example_outputs.json")
    ref = load_json(workdir / "spawned" / "example_outputs.json")
    for pass_type in ("forward", "forward_backward"):
        np.testing.assert_allclose(got[pass_type]["loss"], ref[pass_type]["loss"], rtol=1e-5)
    assert ref["forward_backward"]["grad_norm"] > 0
    assert math.isclose(got["forward_backward"]["grad_norm"], ref["forward_backward"]["grad_norm"], rel_tol=1e-5)
    assert load_json(workdir / "spawned" / "results.json")["launch"] == {
        "launcher": "spawn",
        "nnodes": 1,
        "world_size": 2,
    }
    # Both ranks loaded the way the spawned ranks do, and rank 0 records each rank's load peak.
    load, ref_load = doc["load"], load_json(workdir / "spawned" / "results.json")["load"]
    assert load["method"] == ref_load["method"]
    assert len(load["host_peak_bytes"]) == 2 and all(b > 0 for b in load["host_peak_bytes"])
    for p in procs:
        assert wait_session_empty(p.pid) == []


@pytest.mark.parametrize("backend, sig", [("fsdp2", signal.SIGKILL), ("megatron_ddp", signal.SIGSTOP)])
def test_a_killed_or_hung_rank_ends_the_point_on_every_node(workdir, backend, sig):
    """Rank 1 killed (or stopped: hung) mid-run: rank 0 records the failure, both torchruns end within 60 s, nothing is
    left."""
    procs = start_nodes(workdir, f"backend={backend}", *POINT[:-3], "bench.repeat=15", "logger=none",
                        "hydra.run.dir=run")
    victim = rank_process(procs, 1)
    rank_process(procs, 0)
    deadline = time.monotonic() + 240
    # the forward pass is recorded, forward_backward is running
    while "forward_backward repeat 1/" not in node_logs(workdir) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), node_logs(workdir)
        time.sleep(0.5)
    victim.send_signal(sig)
    codes = [p.wait(timeout=60) for p in procs]
    assert all(c != 0 for c in codes), node_logs(workdir)
    files = results_files(workdir)
    assert len(files) == 1
    doc = load_json(files[0])
    # torchrun usually stops rank 0 before the heartbeats can name rank 1; the line says what rank 0 saw
    assert doc["status"] == "error", doc
    assert any(s in doc["error"] for s in ("rank 1 ", "another rank died", "the launcher ended the job")), doc["error"]
    assert list(doc["passes"]) == ["forward"], "the pass finished before the kill is kept"
    assert doc["error"] in node_logs(workdir)
    for p in procs:
        assert wait_session_empty(p.pid) == []


def test_rank_0_keeps_the_store_until_a_late_rank_has_left(workdir):
    """srun-style ranks: rank 0 finishes a dry run before rank 1 has even started; rank 1 must still
    find the store, read ``exit`` and leave, and rank 0 must wait for it (it used to leave rank 1
    retrying a dead store for minutes)."""
    port = _free_port()
    slurm = dict(SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_NNODES="1",
                 SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="127.0.0.1", MASTER_PORT=str(port))
    args = [sys.executable, "-m", "harness", "backend=fsdp2", "dry_run=true", "logger=none",
            f"hydra.run.dir={workdir / 'run'}"]

    def start(rank: int) -> subprocess.Popen:
        env = harness_env(**slurm, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
        return subprocess.Popen(args, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    rank0 = start(0)
    deadline = time.monotonic() + 120
    while not (workdir / "run" / "results.json").exists():  # rank 0's dry run is done
        assert rank0.poll() is None and time.monotonic() < deadline, (
            rank0.stdout.read() if rank0.poll() else "no result"
        )
        time.sleep(0.1)
    rank1 = start(1)
    out1, _ = rank1.communicate(timeout=120)
    out0, _ = rank0.communicate(timeout=60)
    assert (rank0.returncode, rank1.returncode) == (0, 0), out0 + out1
    assert load_json(workdir / "run" / "results.json")["status"] == "planned"
    for p in (rank0, rank1):
        assert wait_session_empty(p.pid) == []
