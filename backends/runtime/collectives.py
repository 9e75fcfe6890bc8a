"""A collective whose time-out is an error the rank reports, not NCCL's watchdog ending the process.

On a GPU a collective returns to the host before it completes; one that runs past the process group's time-out is
caught by NCCL's watchdog thread, which aborts the process: no Python exception, so no line naming the time-out (the
rank's stderr says it, and backends/runtime/failures.py ``collective_timeout`` reads it where it is kept). Waiting on
the host for the collective, up to a share of that time-out, raises first, on every launcher.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

# Of the process group's time-out, how long the host waits before it names the time-out itself: the rest is the
# rank's margin to report it before the watchdog ends the process.
HOST_SHARE = 0.9


class CollectiveTimeout(RuntimeError):
    """A collective not completed within ``HOST_SHARE`` of the process group's time-out (its message says 'timed
    out')."""


def broadcast(tensor: torch.Tensor, src: int, timeout_s: Optional[float]) -> None:
    """``dist.broadcast``; on CUDA waited for on the host (polling, the interpreter lock released between polls) for
    at most ``HOST_SHARE`` of ``timeout_s``, then ``CollectiveTimeout``. Elsewhere (gloo raises its own time-out) or
    without a time-out, the plain call."""
    if tensor.device.type != "cuda" or timeout_s is None:
        dist.broadcast(tensor, src=src)
        return
    work = dist.broadcast(tensor, src=src, async_op=True)
    wait_until(work, HOST_SHARE * timeout_s, "broadcast")


def wait_until(work, limit_s: float, what: str, first_poll_s: float = 2e-4, longest_poll_s: float = 0.05) -> None:
    """Wait for ``work`` (a ``dist.Work``) on the host for at most ``limit_s``; polls start short (most collectives
    finish in milliseconds) and grow to ``longest_poll_s``."""
    deadline = time.monotonic() + limit_s
    poll = first_poll_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"{what} timed out: not completed after {limit_s:.0f} s")
        time.sleep(poll)
        poll = min(2 * poll, longest_poll_s)
    work.wait()  # raises the collective's own error, if it had one
