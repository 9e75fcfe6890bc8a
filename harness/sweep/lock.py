"""One sweep at a time in a sweep folder: ``sweep.lock`` names the process that holds it.

Two sweeps started into one folder at once would otherwise number their points alike, write into each other's point
folders, share each other's measurements and each report the other's points. The sweeper takes the lock before it
places a point (harness/sweep/points.py), and the end-of-sweep callback hands it back after the report
(harness/app/callbacks.py); so does this process's exit, however the sweep ended short of that.

A lock whose process is gone (killed, crashed, its machine rebooted) is stale: the next sweep on the same host sees
that by its pid and start time (a pid reused by a later process does not count as the holder), says so in a warning
and takes the lock over. A lock held on another host cannot be judged from here: the refusal names the host and the
file to delete once that sweep no longer runs.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

from backends.errors import UserError

log = logging.getLogger("harness.points")

LOCK_FILE = "sweep.lock"
_HELD: set[Path] = set()  # the locks this process holds


def _record() -> dict:
    from backends.runtime.liveness import process_record

    return {**process_record(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _read(path: Path) -> Optional[dict]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _mine(holder: Optional[dict]) -> bool:
    from backends.runtime.liveness import process_record

    me = process_record()
    return isinstance(holder, dict) and all(holder.get(k) == me[k] for k in ("host", "pid", "started"))


def _place(path: Path, record: dict) -> bool:
    """Write the lock whole, then link it into place: False where a lock is there already (never a torn one)."""
    text = json.dumps(record, indent=1) + "\n"
    tmp = path.with_name(f".{LOCK_FILE}.{os.getpid()}")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: created exclusively instead (a reader may see it empty)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as out:
            out.write(text)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _refusal(sweep_dir: Path, path: Path, holder: Optional[dict]) -> UserError:
    import socket

    key = "hydra.sweep.dir"
    if holder is None:
        return UserError(f"{key}: {sweep_dir} holds {path}, which names no process; if no sweep runs there, delete "
                         f"it, or choose another {key}")
    who = f"pid {holder.get('pid')}, since {holder.get('since') or 'an unknown time'}"
    if holder.get("host") != socket.gethostname():
        return UserError(f"{key}: {sweep_dir} is in use by a sweep on host {holder.get('host')} ({who}); if that "
                         f"sweep no longer runs, delete {path}, or choose another {key}")
    return UserError(f"{key}: {sweep_dir} is in use by another sweep ({who}); two sweeps in one folder would write "
                     f"into each other's points: wait for it to end, or choose another {key}")


def acquire(sweep_dir: Path) -> Path:
    """Take ``sweep_dir``'s lock for this process (a UserError naming its holder while another live sweep has it)."""
    from backends.runtime.liveness import recorded_process_gone

    sweep_dir = Path(sweep_dir)
    path = sweep_dir / LOCK_FILE
    record = _record()
    for _ in range(3):
        if _place(path, record):
            break
        holder = _read(path)
        if _mine(holder):  # this process's own, from a sweep it ran before (tests run several in one process)
            break
        if holder is None or not recorded_process_gone(holder):
            raise _refusal(sweep_dir, path, holder)
        # stale: move it aside (atomic: of two sweeps taking it over at once, one moves it) and try again
        aside = path.with_name(f".{LOCK_FILE}.stale.{os.getpid()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        taken = _read(aside)
        if taken != holder:  # another sweep took it over between our read and the move: put its lock back
            try:
                os.link(aside, path)
            finally:
                aside.unlink(missing_ok=True)
            raise _refusal(sweep_dir, path, taken)
        aside.unlink(missing_ok=True)
        log.warning("%s: the sweep that held it (pid %s on %s, since %s) no longer runs; this sweep takes it over",
                    path, holder.get("pid"), holder.get("host"), holder.get("since"))
    else:
        raise _refusal(sweep_dir, path, _read(path))
    if not _HELD:
        atexit.register(release_all)
    _HELD.add(path)
    return path


def release(path: Path) -> None:
    """Hand back a lock this process holds (another process's is left alone)."""
    path = Path(path)
    _HELD.discard(path)
    if _mine(_read(path)):
        path.unlink(missing_ok=True)


def release_all() -> None:
    for path in list(_HELD):
        release(path)
