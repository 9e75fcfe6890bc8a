"""The compiled cells' runs (tests/integration/test_compile.py), made ahead of their tests on the CPU the suite
leaves idle.

Under ``pytest -n 2`` the two workers keep the 2-core machine about 70% busy: while a test waits (a heartbeat going
stale, a deadline, a rendezvous, a process starting) its core idles. The compiled cells are the suite's slowest work
(inductor's code generation and C++ compiles, about 230 worker-seconds) and depend on nothing the other tests do,
so one process per session makes them at the lowest CPU priority (``nice 19``: the scheduler gives it a core only
when no test wants one) while the tests run, into the folder the workers share (tests/backend_runs.py's
``BackendRuns``, under its lock: a test that asks first makes the run itself and this process then skips it; a test
that asks while this process makes it waits for it). The tests that read them are ordered last among the
integration tests (conftest), so by then the runs are usually on disk.

Started by the first pytest-xdist worker whose selection holds a test that reads them (``start``); that worker waits
for it at the end of its session, or stops it when the session was interrupted. Without pytest-xdist nothing is
made ahead: the tests make their runs themselves, as before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

# The test file whose runs are made ahead (conftest imports this module before torch: nothing heavy at the top)
READER = "tests/integration/test_compile.py"
LOG = "prefetch.log"


def reads_prefetched(nodeid: str) -> bool:
    return nodeid.split("::", 1)[0] == READER


def start(shared_dir: Path, nodeids) -> subprocess.Popen | None:
    """The prefetching process, started once per session (the first worker to get here), when a selected test
    reads its runs; else None."""
    if not any(reads_prefetched(n) for n in nodeids):
        return None
    try:
        os.close(os.open(shared_dir / "prefetch.started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    with open(shared_dir / LOG, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.prefetch", str(shared_dir)],
                                cwd=Path(__file__).resolve().parents[1], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, interrupted: bool, timeout_s: float = 1200) -> None:
    """The starting worker's end: wait for the runs another worker may still be waiting for, unless the session was
    interrupted; then stop whatever is left (its ranks and compilers are in its session)."""
    if not interrupted:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def main(shared_dir: str) -> None:
    os.nice(19)  # inherited by its ranks and the compilers inductor starts
    from tests.backend_runs import COMPILED, COMPILED_SWEEP, BackendRuns

    runs = BackendRuns(Path(shared_dir))
    # the command-line cell first (the slowest), then the in-process cells
    for key in (COMPILED_SWEEP, *((backend, dtype, True) for backend, dtype in COMPILED)):
        if os.getppid() == 1:  # the worker that started it is gone
            return
        if key == COMPILED_SWEEP:
            runs.compiled_sweep(Path(shared_dir), fresh=True)
        else:
            runs[key]  # made (or found made) and written for the workers


if __name__ == "__main__":
    main(sys.argv[1])
