"""Fault injection with real processes: out of memory, a killed worker, a hung worker, an interrupted sweep, a
controller killed outright."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time

import psutil

from tests.conftest import (
    REPO,
    harness_env,
    left_behind,
    load_json,
    rank_processes,
    run_harness,
    start_harness,
    sweep_results,
    wait_session_empty,
)
from tests.wandb_records import run_contents


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _log_time(line: str) -> float:
    """A console line's timestamp ([2026-12-04 19:28:37,603][...]) in seconds."""
    import datetime

    return datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _status(path):
    try:
        return load_json(path)
    except (OSError, ValueError):
        return None


def test_out_of_memory_is_a_result_and_the_sweep_goes_on(workdir):
    """Under a 1 GB cap the 4096 budget fits, a budget holding everything does not (8 sequences up to 4,096 tokens:
    each rank's one padded micro-batch runs out of memory; 16 sequences under 2 GB proved the same, slower)."""
    sweep = workdir / "sweep"
    proc = start_harness(
        "-m",
        "mtpm=4096,100000000",
        "planner=greedy",
        "layout=padded",
        "bench.baseline=false",
        "backend=fsdp2",
        "world_size=2",
        "workload=cpu_mixed",
        "workload.n_examples=8",
        "workload.max_len=4096",
        "bench.warmup=0",
        "bench.repeat=1",
        "bench.memory_limit_gb=1",
        f"hydra.sweep.dir={sweep}",
        cwd=workdir,
        log=workdir / "log.txt",
    )
    assert proc.wait(timeout=300) == 0, (workdir / "log.txt").read_text()  # only OOM failures: exit 0
    ok, oom = sweep_results(sweep)
    assert ok["status"] == "ok" and set(ok["passes"]) == {"forward", "forward_backward"}
    assert oom["status"] == "oom"
    assert oom["error"].startswith("out of memory in forward")
    assert "padded tokens" in oom["error"] and "memory_limit_gb=1" in oom["error"]
    # the failing rank's largest micro-batch (here each rank runs one)
    assert any(f"{n:,} padded tokens" in oom["error"] for n in oom["plan"]["padded_tokens_per_rank"])
    assert "| OOM " in (sweep / "report.md").read_text()
    # Checked at once: a point of the sweep failed, and the harness still reaped all it started before it exited
    assert left_behind(proc.pid) == []


def test_pytorch_backend_recovers_after_an_oom_point(workdir):
    """In-process OOM (8 sequences under 1 GB): memory is released, the next point runs; each point's W&B run is
    finished with its status."""
    sweep = workdir / "sweep"
    proc = run_harness(
        "-m",
        "mtpm=100000000,2048",
        "planner=greedy",
        "layout=padded",
        "bench.baseline=false",
        "backend=pytorch",
        "workload=cpu_mixed",
        "workload.n_examples=8",
        "bench.warmup=0",
        "bench.repeat=1",
        "bench.memory_limit_gb=1",
        f"hydra.sweep.dir={sweep}",
        cwd=workdir,
        env=harness_env(WANDB_MODE="offline"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["status"] for r in sweep_results(sweep)] == ["oom", "ok"]
    runs = [run_contents(next(sweep.glob(f"{i}/wandb/offline-run-*/run-*.wandb"))) for i in (0, 1)]
    assert [r["summary"]["status"] for r in runs] == ["oom", "ok"]
    assert "out of memory" in runs[0]["summary"]["error"]


def test_a_stopped_worker_ends_the_run_with_a_clear_error(workdir):
    """A spawned rank held stopped (SIGSTOP: alive, silent, as one hung with the interpreter locked) is told by its
    heartbeat, as a launched rank is, instead of holding the point forever. (A killed rank is told by its exit code:
    tests/integration/test_serve.py.)"""
    run = workdir / "run"
    proc = start_harness("backend=fsdp2", "world_size=2", "workload=cpu_mixed", f"hydra.run.dir={run}", cwd=workdir,
                         log=workdir / "log.txt", env=harness_env(BALANCE_BATCH_STALE_AFTER_S="3"))
    _wait_for(lambda: (_status(run / "results.json") or {}).get("passes", {}).get("forward"), 120, "the forward pass")
    victim = rank_processes(proc.pid)[-1]
    victim.suspend()
    stopped_at = time.monotonic()
    code = proc.wait(timeout=60)
    assert time.monotonic() - stopped_at < 60
    assert code == 1
    res = load_json(run / "results.json")
    assert res["status"] == "error"
    assert "stopped answering (killed or hung: no heartbeat for 3 s)" in res["error"] and "rank " in res["error"]
    assert res["passes"]["forward"]["tok_per_s"] > 0  # what was measured before is kept
    log = (workdir / "log.txt").read_text()
    assert "no heartbeat for 3 s" in log and "Traceback" not in log
    assert left_behind(proc.pid) == []  # the stopped rank too, reaped before the harness exited


def test_a_hung_worker_times_out(workdir):
    run = workdir / "run"
    pidfile = workdir / "hung.pid"
    env = harness_env(BALANCE_BATCH_TEST_PIDFILE=str(pidfile))
    proc = start_harness(
        "backend=fsdp2",
        "world_size=2",
        "workload=smoke",
        "backend.hooks=tests.faults:FSDP2HangMidPass",
        "bench.pass_timeout_s=5",
        "bench.warmup=0",
        f"hydra.run.dir={run}",
        cwd=workdir,
        env=env,
    )
    assert proc.wait(timeout=120) == 1
    res = load_json(run / "results.json")
    assert res["status"] == "timeout" and "pass_timeout_s=5" in res["error"]
    assert (
        not psutil.pid_exists(int(pidfile.read_text()))
        or psutil.Process(int(pidfile.read_text())).status() == psutil.STATUS_ZOMBIE
    )
    assert left_behind(proc.pid) == []  # the hung rank too, reaped before the harness exited


def test_a_start_up_that_hangs_ends_at_its_deadline_in_one_line(workdir):
    """Ranks that never become ready (as under a memory limit that left one unable to start gloo's thread, which
    then waited forever) are stopped at backend.startup_timeout_s, the same wait a real start-up has."""
    run = workdir / "run"
    # A fresh interpreter: its fork server is still importing when the ranks are spawned, and the deadline counts that
    proc = run_harness("backend=fsdp2", "world_size=2", "workload=smoke", "backend.startup_timeout_s=2",
                       "backend.hooks=tests.faults:FSDP2HangAtStartUp", f"hydra.run.dir={run}", cwd=workdir, fresh=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = load_json(run / "results.json")
    assert res["status"] == "timeout"
    assert res["error"].startswith("start-up: 0/2 ranks ready after ") and "backend.startup_timeout_s=2" in res["error"]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and res["error"] in errors[0], proc.stdout + proc.stderr
    # the time it states is the start-up's, spawning the ranks included (seconds of the fork server's imports here):
    # from "starting" to the line, less stopping the ranks (a fraction of a second; up to 3 s on a loaded machine)
    stated = float(res["error"].split("ready after ")[1].split(" s")[0])
    stamps = [_log_time(line) for line in (proc.stdout + proc.stderr).splitlines()
              if "starting 2 ranks" in line or "[ERROR]" in line]
    assert stated >= 2 and stated >= stamps[-1] - stamps[0] - 3, (stated, stamps)

    # Under bench.memory_limit_gb, ranks that hang at their limit are the limit: out of memory, a result (exit 0).
    proc = run_harness("backend=fsdp2", "world_size=2", "workload=smoke", "backend.startup_timeout_s=2",
                       "bench.memory_limit_gb=8", "backend.hooks=tests.faults:FSDP2HangAtItsMemoryLimit",
                       f"hydra.run.dir={run}-at-limit", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = load_json(workdir / "run-at-limit" / "results.json")
    assert res["status"] == "oom" and "bench.memory_limit_gb=8" in res["error"] and "at its limit" in res["error"]


def test_auto_whose_ranks_cannot_start_under_the_limit_records_an_oom_candidate(workdir):
    """0.3 GB is less than a megatron rank holds once forked: its threads cannot start (the C library aborts it).
    Out of memory, the search's answer, in one line: the baseline and the smallest budget oom, the rest above it."""
    run = workdir / "run"
    proc = run_harness("backend=megatron_ddp", "mtpm=auto", "bench.memory_limit_gb=0.3", "workload=smoke",
                       "backend.startup_timeout_s=120", f"hydra.run.dir={run}", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # out of memory is a result
    res = load_json(run / "results.json")
    assert res["status"] == "oom" and res["error"].startswith("mtpm=auto: no budget fits in 0.30 GiB per rank")
    auto = res["auto"]
    assert auto["baseline"]["status"] == "oom" and "start-up" in auto["baseline"]["error"]
    smallest, *larger = auto["candidates"]
    assert smallest["status"] == "oom" and "memory_limit_gb=0.3" in smallest["reason"], smallest
    assert larger and all(c["status"] == "over_limit" for c in larger)
    console = proc.stdout + proc.stderr
    errors = [line for line in console.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "start-up" in errors[0], console
    assert "Traceback" not in console and "ABORT" not in console and "terminate called" not in console, console
    assert console.count("starting megatron_ddp") == 1  # nothing measurable is left to start ranks for again


def test_auto_starts_ranks_again_only_for_a_budget_left_to_measure(workdir):
    """An out of memory takes the ranks with it: the next candidate starts fresh ones, and after the last one nothing
    does (it started ranks with nothing left to measure)."""
    run = workdir / "run"
    proc = run_harness("backend=fsdp2", "mtpm=auto", "workload=smoke", "workload.n_examples=4", "bench.warmup=0",
                       "bench.repeat=1", "backend.hooks=tests.faults:FSDP2OutOfMemoryInTraining",
                       f"hydra.run.dir={run}", cwd=workdir)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    res = load_json(run / "results.json")
    assert res["status"] == "oom" and res["auto"]["baseline"]["status"] == "oom"
    smallest, *larger = res["auto"]["candidates"]
    assert smallest["status"] == "oom" and larger and all(c["status"] == "over_limit" for c in larger)
    assert log.count("ranks ready") == 2, log  # the baseline's ranks, then the smallest budget's


def test_an_interrupted_sweep_resumes_where_it_stopped(workdir):
    sweep = workdir / "sweep"
    args = [
        "-m",
        "mtpm=600,5000",  # the first point finishes, the second is interrupted: resume runs the second alone
        "bench.baseline=false",
        "backend=fsdp2",
        "workload=cpu_mixed",
        "workload.n_examples=8",
        "bench.warmup=0",
        "bench.repeat=1",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = start_harness(*args, cwd=workdir, log=workdir / "log.txt")
    # The second point is starting its ranks: a Ctrl-C then stops them too (tests/conftest.py says why a suite
    # started in the background once lost this signal).
    _wait_for(lambda: "mtpm=5000 mbs=1] starting fsdp2" in (workdir / "log.txt").read_text(), 180, "the second point")
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the harness only (workers ignore it and are stopped by it)
    code = proc.wait(timeout=60)
    log = (workdir / "log.txt").read_text()
    assert code == 130, log[-4000:]
    assert "resume=true" in log and f"hydra.sweep.dir={sweep}" in log
    assert left_behind(proc.pid) == []  # an interrupted run reaps what it started too
    first = sweep / "0" / "results.json"
    assert load_json(first)["status"] == "ok"
    assert load_json(sweep / "1" / "results.json")["status"] == "interrupted"
    before = _digest(first)

    again = run_harness(*args, "resume=true", cwd=workdir, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already ok" in again.stdout + again.stderr
    assert _digest(first) == before  # the finished point was not run again
    assert [r["status"] for r in sweep_results(sweep)] == ["ok", "ok"]


def test_a_controller_killed_outright_leaves_no_rank_and_no_fork_server(workdir):
    """SIGKILL gives the controller no chance to stop its ranks: its fork server sees it go and leaves, and the
    ranks die with the fork server (before the fix, each idle rank held the server open and both stayed)."""
    code = ("import time\n"
            "from backends.specs import BackendSpec, ModelSpec\n"
            "from backends.start import make_backend\n"
            "with make_backend(BackendSpec(name='fsdp2', world_size=2, device='cpu'), ModelSpec()):\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=harness_env(), stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        assert len(rank_processes(proc.pid)) == 2
    finally:
        proc.kill()
        proc.wait()
    assert wait_session_empty(proc.pid) == []


_LEAVES_A_PROCESS_RUNNING = """
import logging
import subprocess

from backends.runtime.children import become_subreaper, end_children

logging.basicConfig(format="%(message)s")
become_subreaper()
# The shell starts sleep and exits: sleep, orphaned, becomes this process's child, and never exits by itself
out = subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
print(out.stdout.strip(), flush=True)
end_children(wait_s=0.5)
"""


def test_a_process_left_running_at_exit_is_killed_in_one_line_and_reaped(workdir):
    """What the harness runs before it exits (backends/runtime/children.py), given a descendant that never exits:
    after its wait it kills it, says so in one line, reaps it, and returns."""
    proc = subprocess.Popen([sys.executable, "-c", _LEAVES_A_PROCESS_RUNNING], cwd=REPO, env=harness_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    sleeper = int(out.split()[-1])
    assert err.splitlines() == [f"exit: killed sleep (pid {sleeper}), still running 0.5 s after the run ended"]
    assert left_behind(proc.pid) == []
