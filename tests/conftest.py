"""Shared helpers: run the real CLI in a subprocess, read what it wrote.

Two tiers: tests/unit (in-process, `make test-fast`, under a minute) and tests/integration (real processes:
the CLI, servers, torchrun, spawned ranks; and the in-process tests that run dozens of full model passes or take
seconds each: test_batching_invariance, the committed-gradient oracle, the FLOP counter, chunked log-probs, the
dataset loss oracle, the planner's growth). Each test is marked with its tier's name."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backends.runtime.collector import defer_full_collections

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "harness" / "conf"  # the Hydra configs python -m harness composes
TIERS = ("unit", "integration")


# Idle OpenMP threads sleep instead of spinning: the suite's ranks and CLI processes share 2 cores, and with
# two pytest workers (pytest -n 2) spinning threads burn the other worker's core (measured on two integration
# files: 636 s of CPU for 424 s of wall with spinning, 209 s for 174 s without; one worker: 224 s for 293 s). Set
# before torch is imported here, and inherited by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One compute thread per process: two pytest workers on 2 cores already keep both busy, and a process computing on
# two threads beside the other worker's waits at every parallel region for a thread without a core (two pytest
# processes side by side, test_harness_cli's runs beside test_reports', test_tracking's and
# test_batching_invariance's: 187 s and 335 core-seconds with torch's default of one thread per core, 160 s and 284
# with one). Every backend's ranks follow it, as in any run (backends.runtime.devices.threads_per_rank).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor (backend.compile=true: test_compile's cells) compiles each graph's C++ in the process that asks, one at a
# time: the default compile pool (a process per core, each importing torch) beside two pytest workers on 2 cores took
# 173 s of wall for the standard commands' first compiled forward (15 graphs) against 112 s in-process, on the same
# loaded machine.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Scalar C++ kernels: most of a cell's CPU is g++ compiling inductor's kernels (71 compiles, 48 s, of the megatron_ddp
# cell's 78 s alone), each one instantiating the vectorised templates of its precompiled header. Scalar kernels
# compile in less: the megatron_ddp cell took 70 CPU-seconds of the machine instead of 87. What the cells check (the
# eager answer within the dtype's rounding, which graphs compile and when, the graph breaks, the records) does not
# depend on how inductor's CPU code is vectorised, and no user runs that code: on a GPU inductor writes Triton.
# The suite keeps both cores busy, so CPU saved is wall saved.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Full garbage collections as the harness's processes have them (backends/runtime/collector.py): a worker imports
# torch, transformers and megatron-core, and each full collection of that heap visits all of it again.
defer_full_collections()
# The installed distribution holds no top-level tests package (a generic name in site-packages collides with other
# projects'): the processes the tests start (CLI runs in a temporary folder, their ranks) import tests.probes and
# tests.faults from this checkout.
if str(REPO) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

# The processes the tests start get Ctrl-C as from a terminal, even when the suite itself was started in the
# background: a shell starts a background job with SIGINT ignored, every process it starts inherits that, and
# Python installs no KeyboardInterrupt handler where SIGINT is ignored at start, so a test's SIGINT to a sweep it
# started was silently dropped (a `make test &` failed the interrupt tests; the same run in the foreground passed).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Session fixtures worth computing once: the tests that read one run on the same pytest-xdist worker.
SHARED_SESSION_FIXTURES = ("golden_sweep",)


def _xdist_group(item) -> str | None:
    """The worker group of a test: a backend's standard runs when it reads one backend's (the runs are made once
    for all workers, and a backend's compiled cell, its slowest, then keeps to one worker while the other worker
    takes another backend), else the shared session fixture it reads, else its module when it reads a
    module-scoped fixture (computed once per module, on one worker), else none (any worker)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "backend_runs" in info.names_closure and "backend" in params:
        return f"backend_runs-{params['backend']}"
    for name in SHARED_SESSION_FIXTURES:
        if name in info.names_closure:
            return name
    for defs in info.name2fixturedefs.values():
        if any(d.scope == "module" for d in defs):
            return str(Path(item.path).resolve().relative_to(REPO))
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test module's last test (its module fixtures gone): collect once, then keep what is left out of every
    later collection. What is left is what outlives a module: imported modules, caches, session fixtures; without
    this each full collection (a pass's, a compile's, the interpreter's own) visited them all again (what it saves:
    docs/development.md, "Garbage collection"). A later test's own objects are collected as before."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the group marks into node ids
def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's tier (``-m unit`` / ``-m integration`` select one), and with the
    pytest-xdist group that keeps shared fixtures computed once (``pytest -n 2 --dist loadgroup``)."""
    for item in items:
        rel = Path(item.path).resolve().relative_to(REPO / "tests")
        if rel.parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, rel.parts[0]))
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


SLOW_TEST_S = 60  # no single test should take longer on the 2-core machine CI runs on (README: tests)


def pytest_terminal_summary(terminalreporter):
    """After pytest's 20 slowest: every test whose run (set-up, call, tear-down) took over SLOW_TEST_S, named.

    A report for whoever reads the log, not an assertion: a loaded machine must not fail the suite, but a
    test that grows past the guard must be seen (and split, shared or named with a reason)."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown") and hasattr(report, "duration"):
                totals[report.nodeid] = totals.get(report.nodeid, 0.0) + report.duration
    over = sorted(((t, n) for n, t in totals.items() if t > SLOW_TEST_S), reverse=True)
    if over:
        terminalreporter.write_sep("=", f"tests over {SLOW_TEST_S} s (set-up + call + tear-down)")
        for t, nodeid in over:
            terminalreporter.write_line(f"{t:7.1f}s {nodeid}")


def harness_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    env.setdefault("WANDB_MODE", "disabled")
    env.setdefault("BALANCE_BATCH_STALE_AFTER_S", "6")  # a launched rank's death is seen in 6 s, not 15
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


_WARM: dict = {}  # this pytest worker's warm CLI server (tests/warm_cli.py), started on first use


def run_cli(module: str, *args: str, cwd: Path, timeout: float = 600, env: dict | None = None,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m module args`` to its end: forked from this worker's warm CLI server when the environment allows
    (tests/warm_cli.py), else (or ``fresh``: a new interpreter is the point) a plain subprocess."""
    env = env or harness_env()
    if not fresh:
        from tests.warm_cli import WarmCLI

        server = _WARM.get("server") or _WARM.setdefault("server", WarmCLI(harness_env()))
        if server.suits(env):
            return server.run(module, args, cwd=cwd, env=env, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(code: str, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c code args...`` in a fresh interpreter (what a module imports is only visible in one)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=harness_env(), capture_output=True,
                          text=True, timeout=timeout)


def unpaired(args) -> list[str]:
    """A test's harness arguments with what it does not check left out: ``bench.paired=false`` unless the test sets
    bench.paired itself, and the end-of-sweep report's figures unless it sets ``hydra.callbacks.report.plots``.

    A paired point runs mbs=1 passes beside each timed repeat (3 fwd+bwd passes more for one repeat), and a sweep's
    report draws a plan figure per point (about half a CPU-second each, 190 of them in the suite); only the tests of
    pairing and of the figures pay for them, by asking with bench.paired=true or hydra.callbacks.report.plots=true.
    """
    args = list(args)
    if "--cfg" in args:
        return args
    if not any(a.startswith("bench.paired=") for a in args):
        args.append("bench.paired=false")
    if not any(a.startswith("hydra.callbacks.report.plots=") for a in args):
        args.append("hydra.callbacks.report.plots=false")
    return args


def run_harness(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None,
                fresh: bool = False) -> subprocess.CompletedProcess:
    return run_cli("harness", *unpaired(args), cwd=cwd, timeout=timeout, env=env, fresh=fresh)


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def sweep_results(sweep_dir: Path) -> list[dict]:
    """results.json of every point of a multirun, in job order."""
    files = sorted(Path(sweep_dir).glob("*/results.json"), key=lambda p: int(p.parent.name.split("_")[0]))
    return [load_json(p) for p in files]


def session_processes(sid: int) -> list:
    """Live (non-zombie) processes of a session: what a run started with start_new_session left behind."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def left_behind(sid: int) -> list:
    """The processes of session ``sid``, exited ones not yet reaped (zombies) included, looked up once, with no
    wait: right after a harness run started in that session has exited this is empty, since the harness reaps
    everything it started before it exits (backends/runtime/children.py)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def rank_processes(pid: int) -> list:
    """The live ranks a process started: the children of its fork server (backends/runtime/forkserver.py)."""
    import psutil

    from backends.runtime.forkserver import is_fork_server

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and is_fork_server(" ".join(p.parent().cmdline())):
                out.append(p)
        except (psutil.Error, AttributeError):
            continue
    return out


def wait_session_empty(sid: int, timeout_s: float = 30.0) -> list:
    """The processes left in session ``sid`` once it empties or ``timeout_s`` passes. A ranks' fork server
    whose controller died while it was still importing torch leaves when its imports end: seconds, more on a
    loaded machine."""
    import time

    deadline = time.monotonic() + timeout_s
    left = session_processes(sid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = session_processes(sid)
    return left


def start_harness(*args: str, cwd: Path, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """python -m harness in its own session (so everything it starts can be found and checked)."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", "harness", *unpaired(args)], cwd=cwd, env=env or harness_env(),
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )


def compose_config(*overrides: str):
    """Hydra's composed config for ``overrides`` in-process (harness/conf/, as ``python -m harness`` composes it); a
    composition mistake is the UserError with the one line the CLI prints."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from backends.errors import UserError
    from harness.app.config import composition_error_line, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            return compose("config", overrides=list(overrides))
        except HydraException as exc:
            raise UserError(composition_error_line(exc)) from None


def config_error(*overrides: str, composed=None) -> str | None:
    """The one line the CLI refuses ``overrides`` with (composition, the harness's checks, then the workload as a
    point builds it first: harness/point/point.py, Point._run); None: valid. ``composed``: a config already composed."""
    from backends.errors import UserError
    from harness.app.config import resolve_config
    from harness.data.workload import check_one_size, load_workload

    try:
        spec = resolve_config(composed if composed is not None else compose_config(*overrides))
        check_one_size(spec.workload, overrides)
        load_workload(spec.workload, spec.model, check_vocabulary=not spec.target.url)
    except UserError as exc:
        return str(exc)
    return None


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def unwritable_dir(tmp_path):
    """A folder nobody can create files in (chmod; as root, which ignores modes, the immutable attribute)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False
    if os.access(folder, os.W_OK):
        immutable = (
            bool(shutil.which("chattr"))
            and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        )
        if not immutable:
            pytest.skip("cannot make a read-only folder here")
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> dict:
    """The offline dataset and tokenizer of ``python -m harness.demo_data``: chats, prompt/completion, text,
    tokenizer."""
    from harness.data.demo_data import write

    return write(tmp_path_factory.mktemp("demo_data"))


@pytest.fixture(scope="session")
def backend_runs(tmp_path_factory):
    """tests/backend_runs.py's standard commands, one run per (backend, dtype, compiled) for the whole session
    (under pytest -n, for all workers: kept in the folder their temporary folders share)."""
    from tests.backend_runs import BackendRuns

    base = tmp_path_factory.getbasetemp()
    return BackendRuns(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else None)


@pytest.fixture(scope="session")
def golden_sweep(tmp_path_factory) -> Path:
    """One small real sweep, read by every test that only inspects a sweep's outputs (the report, CSV, plots, W&B).

    Two budgets on the smoke workload, in-process PyTorch, 2 timed repeats, no baseline point, a real offline W&B
    run per point in the point's folder.
    """
    root = tmp_path_factory.mktemp("golden")
    sweep = root / "sweep"
    proc = run_harness(
        "-m", "mtpm=600,100000", "backend=pytorch", "workload=smoke", "bench.warmup=0", "bench.repeat=2",
        "bench.baseline=false", "hydra.callbacks.report.plots=true", f"hydra.sweep.dir={sweep}", cwd=root,
        env=harness_env(WANDB_MODE="offline"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep


def pytest_sessionfinish(session):
    if "server" in _WARM:
        _WARM.pop("server").close()
