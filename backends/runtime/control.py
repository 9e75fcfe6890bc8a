"""Live control of the batching knobs: a small file (in /dev/shm by default) a backend re-reads before every pass.

The writer replaces the file atomically (write a temporary file, then rename),
owner-only, so a reader sees the old or the new content, never half of it.
Unreadable or corrupt content keeps the last good values and logs one warning;
so does a budget of "unset" where the planner needs one (``budget_required``:
a balanced server, or a peer's that plans by a budget), which the admin API refuses too.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from backends.runtime.atomic import write_text_atomic

log = logging.getLogger(__name__)

UNSET = "unset"


def default_control_path(prefix: str = "balance-batch") -> Path:
    """A path no other server on this machine uses: /dev/shm when it exists, else the temp folder."""
    base = (
        Path("/dev/shm")
        if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK)
        else Path(tempfile.gettempdir())
    )
    return base / f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}.ctl"


@dataclass(frozen=True)
class BatchingSettings:
    max_tokens_per_microbatch: Optional[int]
    micro_batch_size: int

    def as_dict(self) -> dict:
        return {"max_tokens_per_microbatch": self.max_tokens_per_microbatch, "micro_batch_size": self.micro_batch_size}


def _check_value(name: str, value, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer{' or null' if allow_none else ''}, got {value!r}")


def _parse(text: str, budget_required: bool = False, planner: str = "balanced") -> BatchingSettings:
    data = json.loads(text)
    mtpm = data["max_tokens_per_microbatch"]
    mtpm = None if mtpm == UNSET else mtpm
    mbs = data["micro_batch_size"]
    if mtpm is None and budget_required:
        raise ValueError(f"max_tokens_per_microbatch: {UNSET!r} is not allowed with planner={planner}, which plans by "
                         "a token budget")
    _check_value("max_tokens_per_microbatch", mtpm, allow_none=True)
    _check_value("micro_batch_size", mbs, allow_none=False)
    return BatchingSettings(mtpm, mbs)


class ControlFile:
    """The current ``max_tokens_per_microbatch`` ("unset" = fixed slices) and ``micro_batch_size``."""

    def __init__(self, path: Optional[os.PathLike] = None, initial: Optional[BatchingSettings] = None,
                 budget_required: bool = False, planner: str = "balanced"):
        self.path = Path(path) if path is not None else default_control_path()
        self.budget_required = budget_required  # "unset" is bad content (the planner needs a budget)
        self.planner = planner  # the planner that needs it, for the messages
        self._last_good = initial or BatchingSettings(None, 1)
        self._warned_for: Optional[str] = None
        if initial is not None or not self.path.exists():
            self._write(self._last_good)

    def _write(self, settings: BatchingSettings) -> None:
        data = {
            "max_tokens_per_microbatch": UNSET
            if settings.max_tokens_per_microbatch is None
            else settings.max_tokens_per_microbatch,
            "micro_batch_size": settings.micro_batch_size,
        }
        write_text_atomic(self.path, json.dumps(data), mode=0o600)
        self._last_good = settings

    def read(self) -> BatchingSettings:
        """The values in the file; on unreadable or corrupt content, the last good ones (one warning per bad
        content)."""
        try:
            text = self.path.read_text()
            settings = _parse(text, self.budget_required, self.planner)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            marker = f"{type(exc).__name__}: {exc}"
            if marker != self._warned_for:
                self._warned_for = marker
                log.warning(
                    "control file %s unreadable or corrupt (%s); keeping max_tokens_per_microbatch=%s, "
                    "micro_batch_size=%s",
                    self.path, marker, self._last_good.max_tokens_per_microbatch, self._last_good.micro_batch_size,
                )
            return self._last_good
        self._warned_for = None
        self._last_good = settings
        return settings

    def set_max_tokens_per_microbatch(self, value: Optional[int]) -> BatchingSettings:
        _check_value("max_tokens_per_microbatch", value, allow_none=not self.budget_required)
        current = self.read()
        self._write(BatchingSettings(value, current.micro_batch_size))
        return self._last_good

    def set_micro_batch_size(self, value: int) -> BatchingSettings:
        _check_value("micro_batch_size", value, allow_none=False)
        current = self.read()
        self._write(BatchingSettings(current.max_tokens_per_microbatch, value))
        return self._last_good

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
