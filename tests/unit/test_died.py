"""A point whose process died while "running": readers (reports, the sweep's status) say died, not running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from harness.point.results import reported_status
from reports.collect import collect

WRITER = textwrap.dedent("""
    import json, sys, time
    from omegaconf import OmegaConf
    from harness.point.results import base_document
    doc = base_document(OmegaConf.create({"backend": {"name": "fsdp2"}, "mtpm": 4096}), ["mtpm=4096"])
    open(sys.argv[1], "w").write(json.dumps(doc))
    print("written", flush=True)
    time.sleep(60)
""")


def test_a_running_point_whose_process_was_killed_reads_as_died(tmp_path):
    """Rank 0 SIGKILLed (or stopped, then killed by its watchdog) once left results.json "running" for good."""
    point = tmp_path / "0"
    point.mkdir()
    path = point / "results.json"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "written"
    doc = json.loads(path.read_text())
    assert doc["status"] == "running" and doc["process"]["pid"] == proc.pid
    assert reported_status(doc) == "running"  # alive: still running
    assert collect([tmp_path]).iloc[0]["status"] == "running"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert reported_status(doc) == "died"
    row = collect([tmp_path]).iloc[0]
    assert row["status"] == "died" and f"pid {proc.pid}" in row["error"]


def test_only_this_host_judges_and_a_reused_pid_is_not_alive():
    me = {"host": os.uname().nodename, "pid": os.getpid(), "started": 0.0}  # this pid, but started long after 0
    assert reported_status({"status": "running", "process": me}) == "died"
    assert reported_status({"status": "running", "process": {**me, "host": "another-machine"}}) == "running"
    assert reported_status({"status": "running"}) == "running"  # written before processes were recorded
    assert reported_status({"status": "ok", "process": me}) == "ok"

