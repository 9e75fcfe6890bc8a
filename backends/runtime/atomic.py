"""Replacing a file so that a reader sees the old content or the new, never half of it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional


def write_text_atomic(path: os.PathLike, text: str, mode: Optional[int] = None, durable: bool = False) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``.

    ``mode`` sets the permissions before any content is written (0o600: owner
    only); without it the file gets what ``open`` would give it (0o666 less the
    umask), not the temporary file's 0o600. ``durable`` also fsyncs, so the
    content survives a machine crash.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, _default_mode() if mode is None else mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _default_mode() -> int:
    """0o666 less this process's umask: the mode a plain ``open(path, "w")`` creates a file with."""
    try:
        with open("/proc/self/status") as f:  # Linux: read the umask without changing it (threads share it)
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask
