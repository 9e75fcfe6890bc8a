"""Liveness, written once: a process that dies with its parent, and heartbeat counters that tell a stopped rank.

Each rank, spawned or launched, adds 1 to its ``hb/<rank>`` counter in its
job's store every ``HEARTBEAT_EVERY_S``; a reader declares a rank whose counter
has not moved for ``STALE_AFTER_S`` hung or stopped (SIGSTOPped, stuck with the
interpreter locked). The spawned ranks' controller, a launched job's rank 0 (its
peer checks), the other ranks' watch of rank 0 and every launched rank's
watchdog process read the counters through ``Heartbeats``.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def _seconds_from_env(name: str, default: float) -> float:
    """A liveness period a test (or a cluster with long pauses) may set in the environment; the default else."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}: must be a positive number of seconds, got {text!r}")
    return value


# A rank whose heartbeat has not moved for this long is declared dead (well under a minute). The suite sets it
# shorter (tests/conftest.py's harness_env): the same code path, without waiting 15 s for every death it stages.
HEARTBEAT_EVERY_S = 1.0
STALE_AFTER_S = _seconds_from_env("BALANCE_BATCH_STALE_AFTER_S", 15.0)


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent dies, so no rank or watchdog is left behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Heartbeats:
    """Reads ranks' heartbeat counters from one store and remembers when each last moved."""

    def __init__(self, store):
        self.store = store
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last moved)

    def count(self, rank: int) -> int:
        return int(self.store.add(f"hb/{rank}", 0))

    def stale(self, rank: int) -> bool:
        """True once ``rank``'s counter has stood still for ``STALE_AFTER_S`` (the first read only starts the clock)."""
        count, now = self.count(rank), time.monotonic()
        last = self._seen.get(rank)
        if last is None or last[0] != count:
            self._seen[rank] = (count, now)
            return False
        return now - last[1] > STALE_AFTER_S


def stopped_line(rank: int) -> str:
    """How a rank whose heartbeat stopped is named, the same for spawned and launched ranks."""
    return f"rank {rank} stopped answering (killed or hung: no heartbeat for {STALE_AFTER_S:g} s)"


def start_heartbeat(store, rank: int) -> threading.Thread:
    """A daemon thread that adds 1 to ``hb/<rank>`` in ``store`` every ``HEARTBEAT_EVERY_S`` while this process runs
    (a spawned rank; a launched job's beat also watches rank 0: backends/runtime/job.py). A store that stops answering
    ends the beat: the controller then sees the rank as stopped, and stops every rank."""

    def beat() -> None:
        try:
            while True:
                store.add(f"hb/{rank}", 1)
                time.sleep(HEARTBEAT_EVERY_S)
        except Exception:  # noqa: BLE001 - the controller is gone or going: nothing to tell it
            return

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread


def process_record() -> dict:
    """This process, as results.json records the one writing it: host, pid and when it started (epoch seconds)."""
    import os
    import socket

    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}


def recorded_process_gone(record) -> bool:
    """True when ``record`` (``process_record``'s) names a process on this host that no longer runs.

    A pid reused by a later process does not count as alive; a record from
    another host, or none, cannot be judged here: False.
    """
    import socket

    import psutil

    if not isinstance(record, dict) or record.get("host") != socket.gethostname():
        return False
    try:
        pid, started = int(record["pid"]), float(record["started"])
    except (KeyError, TypeError, ValueError):
        return False
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
