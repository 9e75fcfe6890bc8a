"""Errors the harness reports as one line, without a traceback."""

from typing import Optional

from balance_batch.errors import UserError

__all__ = ["BackendError", "UserError", "first_line"]


class BackendError(RuntimeError):
    """A pass failed inside a backend (a worker raised, died or hung); the message names the rank.

    ``details`` keeps the worker's traceback for the run's log; ``status`` is
    what results.json records (``error``, or ``timeout`` for a pass that took too long).
    """

    def __init__(self, message: str, details: Optional[str] = None, status: str = "error"):
        super().__init__(message)
        self.details = details
        self.status = status


def first_line(text: str, limit: int) -> str:
    """The first non-empty line of ``text``, cut to ``limit`` characters: what fits a one-line error."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
