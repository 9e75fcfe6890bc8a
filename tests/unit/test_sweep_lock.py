"""harness/sweep/lock.py: one sweep at a time in a sweep folder, a crashed sweep's lock taken over by its pid."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import psutil
import pytest

from backends.errors import UserError
from harness.sweep.lock import LOCK_FILE, acquire, release


def _held_by(pid: int, host: str | None = None) -> dict:
    import socket

    return {"host": host or socket.gethostname(), "pid": pid, "started": psutil.Process(pid).create_time(),
            "since": "2026-12-04T10:00:00+0000"}


def test_a_sweep_folder_held_by_a_live_sweep_is_refused_naming_it_never_advising_resume(tmp_path):
    lock = tmp_path / LOCK_FILE
    holder = _held_by(os.getppid())  # a live process other than this one: the other sweep
    lock.write_text(json.dumps(holder))
    with pytest.raises(UserError) as refused:
        acquire(tmp_path)
    line = str(refused.value)
    assert line.startswith(f"hydra.sweep.dir: {tmp_path} is in use by another sweep (pid {os.getppid()}, since ")
    assert "resume" not in line and "\n" not in line
    assert json.loads(lock.read_text()) == holder  # left as it was
    lock.write_text(json.dumps(_held_by(os.getppid(), host="node-7")))  # another host: cannot be judged from here
    with pytest.raises(UserError, match=f"on host node-7 .*delete {lock}"):
        acquire(tmp_path)


def test_a_crashed_sweeps_lock_is_taken_over_with_a_warning_and_handed_back_after(tmp_path, caplog):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    record = _held_by(gone.pid)
    gone.wait()  # its process has ended: the lock it left is stale
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="harness.points"):
        path = acquire(tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert any(f"pid {gone.pid}" in r.getMessage() and "no longer runs" in r.getMessage() for r in caplog.records)
    assert acquire(tmp_path) == path  # this process again (several sweeps in one process): its own lock
    release(path)
    assert not path.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
