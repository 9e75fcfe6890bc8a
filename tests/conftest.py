"""Shared helpers: run the real CLI in a subprocess, read what it wrote.

Two tiers: tests/unit (in-process, `make test-fast`) and tests/integration (real processes:
the CLI, servers, torchrun, spawned ranks; and the in-process tests that run dozens of full model passes,
test_batching_invariance and the committed-gradient oracle). Each test is marked with its tier's name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's tier (``-m unit`` / ``-m integration`` select one)."""
    for item in items:
        rel = Path(item.path).resolve().relative_to(REPO / "tests")
        if rel.parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, rel.parts[0]))


def harness_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    env.setdefault("WANDB_MODE", "disabled")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cli(module: str, *args: str, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env or harness_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(code: str, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c code args...`` in a fresh interpreter (what a module imports is only visible in one)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=harness_env(), capture_output=True,
                          text=True, timeout=timeout)


def run_harness(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("harness", *args, cwd=cwd, timeout=timeout, env=env)


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


def wait_session_empty(sid: int, timeout_s: float = 10.0) -> list:
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
        [sys.executable, "-m", "harness", *args], cwd=cwd, env=env or harness_env(),
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )


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
        immutable = bool(shutil.which("chattr")) and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("cannot make a read-only folder here")
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> dict:
    """The offline dataset and tokenizer of ``python -m harness.demo_data``: chats, prompt/completion, text, tokenizer."""
    from harness.demo_data import write

    return write(tmp_path_factory.mktemp("demo_data"))
