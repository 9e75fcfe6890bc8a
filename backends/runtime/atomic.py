"""Replacing a file so that a reader sees the old content or the new, never half of it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional


def write_text_atomic(path: os.PathLike, text: str, mode: Optional[int] = None, durable: bool = False) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``.

    ``mode`` sets the permissions before any content is written (0o600: owner
    only); ``durable`` also fsyncs, so the content survives a machine crash.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
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
