"""How a failure is named, written once: a rank's report of its own failure, and ``blame``, which one the user sees.

The rule: a rank out of memory first; else a peer that died or posted a
failure (a peer's death makes the others fail in their next collective);
else the rank's own error. Spawned ranks (backends/runtime/spawned.py) and a
launched job's rank 0 (backends/runtime/launched.py) both apply it.
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from backends.errors import first_line
from backends.messages import PassCommand
from backends.registry import is_lockstep
from backends.runtime.memory import is_out_of_memory, is_thread_start_failure, oom_message
from backends.runtime.ranks import rank_share
from backends.specs import BackendSpec
from balance_batch.cost import microbatch_tokens


@dataclass(frozen=True)
class Failure:
    """A failure as the point records it: the one line, the traceback, and results.json's status."""

    message: str
    details: Optional[str] = None
    status: str = "error"  # error, oom or timeout


def failure_report(exc: BaseException, rank: int, spec: Optional[BackendSpec], command: Optional[PassCommand],
                   world_size: Optional[int] = None) -> tuple:
    """A rank's failure as its reply: ("oom" or "error", rank, (one-line message, traceback)).

    Called inside the ``except`` that caught ``exc``. Out of memory during a
    pass names the pass and the largest micro-batch this rank ran.
    """
    details = traceback.format_exc()
    limit_gb = spec.memory_limit_gb if spec is not None else None
    # A thread that cannot start at start-up under a memory limit is the limit, not a fault of the rank.
    starved = command is None and limit_gb is not None and is_thread_start_failure(exc)
    if not (is_out_of_memory(exc) or starved):
        return "error", rank, (f"{type(exc).__name__}: {exc}", details)
    if command is None:
        limit = f" (bench.memory_limit_gb={limit_gb:g})" if limit_gb is not None else ""
        cause = "could not start a thread: " if starved else ""
        return "oom", rank, ((f"out of memory in start-up on rank {rank}{limit}: {cause}"
                              f"{first_line(str(exc), 200) or type(exc).__name__}"), details)
    if world_size is None:
        world_size = dist.get_world_size()
    _, local = rank_share(command, rank, world_size, is_lockstep(spec.name))
    lengths = command.all_lengths()
    largest = max((microbatch_tokens(b, lengths, command.layout) for b in local), default=0)
    return "oom", rank, (oom_message(command.pass_type, f" on rank {rank}", largest, limit_gb, exc), details)


def blame(kind: str, rank: int, message: str, details: Optional[str], what: str,
          find_peer: Callable[[], Optional[Failure]], wait_s: float, poll_s: float = 0.05) -> Failure:
    """The failure to report when ``rank`` failed with (``kind``, ``message``) during ``what``.

    Out of memory is reported at once. Any other error is mostly a peer's death
    seen from a collective, and the peer's own report (or its death) may trail
    this rank's by a moment: ``find_peer`` is asked until ``wait_s`` has passed.
    """
    if kind == "oom":
        return Failure(message, details, "oom")
    deadline = time.monotonic() + wait_s
    while True:
        peer = find_peer()
        if peer is not None:
            if peer.status == "oom":
                return peer
            return Failure(f"{peer.message} during {what} (rank {rank} then failed: {first_line(message, 160)})",
                           peer.details or details, peer.status)
        if time.monotonic() >= deadline:
            return Failure(f"rank {rank} failed during {what}: {first_line(message, 400)}", details)
        time.sleep(poll_s)


# NCCL's watchdog on a collective past the process group's time-out, in the rank's stderr before it aborts the
# process (no Python exception is raised: a GPU collective returns before it completes), e.g.
# "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=1, NumelOut=1,
# Timeout(ms)=600000) ran for 600042 milliseconds before timing out."
_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout:?\s*(?:WorkNCCL\((?P<work>[^)]*\)?[^)]*)\))?"
                       r"(?:\s*ran for (?P<ran_ms>\d+) milliseconds)?")


def collective_timeout(stderr: Optional[str], rank: int, what: str, dist_timeout_s: float) -> Optional[str]:
    """The one line for a rank NCCL's watchdog ended because a collective ran past ``backend.dist_timeout_s``
    (found in what the rank wrote to stderr), or None when its stderr says nothing of the kind."""
    found = _WATCHDOG.search(stderr or "")
    if found is None:
        return None
    work = found.group("work") or ""
    op = re.search(r"OpType=(\w+)", work)
    seq = re.search(r"SeqNum=(\d+)", work)
    ran = f" after {int(found.group('ran_ms')) / 1000:.0f} s" if found.group("ran_ms") else ""
    which = f"a {op.group(1).lower()}" if op else "a collective"
    number = f" (collective {seq.group(1)})" if seq else ""
    return (f"rank {rank}: {which}{number} timed out{ran} during {what}, and NCCL's watchdog ended the process: "
            f"backend.dist_timeout_s={dist_timeout_s:g} is the process group's time-out; raise it for a slow "
            "interconnect or a slow read on rank 0")
