"""The ranks of a job torchrun or Slurm started (backends/runtime/job.py): rank 0's backend, and the loop every other
rank runs."""

from __future__ import annotations

import gc
import logging
import queue
import signal
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from backends.backend import Backend, split_precision
from backends.errors import BackendError, first_line
from backends.messages import PassCommand, PassResult
from backends.model.loading import merge_load_records
from backends.runtime.devices import resolve_device, use_threads_per_rank
from backends.runtime.failures import Failure, blame, failure_report
from backends.runtime.job import LaunchedJob, launched_job
from backends.runtime.launcher import check_world_size
from backends.runtime.liveness import HEARTBEAT_EVERY_S, STALE_AFTER_S
from backends.runtime.memory import limit_memory, restore_memory_limit
from backends.runtime.ranks import run_command, start_rank

log = logging.getLogger(__name__)

_POLL_S = 0.2


class _Rank:
    """One rank's device, hooks and wrapped model for the current point."""

    def __init__(self, job: LaunchedJob, spec, model_spec, hooks_path: str):
        self.job, self.spec = job, spec
        base = resolve_device(spec.device)
        if base.type == "cuda":
            # One process per GPU: the launcher's local rank picks it (Slurm and torchrun number them per node).
            torch.cuda.set_device(job.env.local_rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = base
        self.memory_limit = limit_memory(spec.memory_limit_gb, self.device)
        self.hooks, self.model, built, method, load = start_rank(
            spec, model_spec, hooks_path, job.rank, job.world_size, self.device, job.process_group_store())
        # Every rank's load record reaches rank 0 (one collective, as in the spawned path's start-up replies).
        records: list = [None] * job.world_size
        dist.all_gather_object(records, load)
        self.built = built if job.rank == 0 else None
        self.load = merge_load_records(method, records)
        self.wlog = logging.getLogger(f"backends.{spec.name}")

    def run(self, command: PassCommand) -> Optional[PassResult]:
        return run_command(command, self.model, self.hooks, self.job.rank, self.job.world_size, self.device, self.wlog)

    def close(self) -> None:
        self.model = None
        restore_memory_limit(self.memory_limit)
        gc.collect()


def follow(job: LaunchedJob) -> int:
    """A non-zero rank: serve rank 0's commands until it says exit; on a failure, post it and exit."""
    logging.basicConfig(level=logging.INFO, format=f"[rank {job.rank}] %(asctime)s %(name)s: %(message)s", force=True)
    # Ctrl-C reaches every process in the terminal's group: rank 0 handles it and ends the job.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank: Optional[_Rank] = None
    spec = command = examples = None
    while True:
        kind, payload = job.receive()
        if kind == "exit":
            break
        try:
            if kind == "start":
                spec, command = payload["spec"], None
                if spec.device == "cpu" or not torch.cuda.is_available():
                    use_threads_per_rank(_local_ranks())
                rank = _Rank(job, spec, payload["model"], payload["hooks"])
            elif kind == "examples":
                examples = payload
            elif kind == "pass":
                command = payload.replace(examples=examples)
                rank.run(command)
            elif kind == "close":
                if rank is not None:
                    rank.close()
                rank = None
        except BaseException as exc:  # noqa: BLE001 - posted for rank 0, which names this rank
            failed_kind, _, (message, details) = failure_report(exc, job.rank, spec, command)
            job.post_failure(failed_kind, message, details)
            job.exit_now(f"rank {job.rank}: {first_line(message, 400)}")
    job.finish()
    return 0


def _local_ranks() -> int:
    """The job's ranks on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per node)."""
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1)


class LaunchedBackend(Backend):
    """Rank 0's backend under a launcher: each command goes to the other ranks; rank 0 runs its share in a thread.

    The thread keeps this (main) thread free to watch the other ranks'
    heartbeats while rank 0 computes or waits in a collective.
    """

    def __init__(self, spec, model, hooks_path: str):
        super().__init__(spec, model)
        job = launched_job()
        assert job is not None and job.rank == 0
        if job.failed is not None:
            raise BackendError(f"the launched job has already ended: {job.failed}")
        self.job = job
        self.name = spec.name
        self.device = resolve_device(spec.device)
        self.world_size = check_world_size(spec.name, spec.world_size, job.env)
        self.local_ranks = min(_local_ranks(), self.world_size)  # the ranks (and GPUs) on rank 0's node
        self.closed = False
        self.failure_reason: Optional[str] = None
        self.seen_failure: Optional[str] = None  # rank 0's own failure while its peers are checked
        self.sent_examples = None  # the examples the other ranks hold
        self.hooks_path = hooks_path
        self.commands: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        if self.device.type == "cpu":
            self.threads_per_rank = use_threads_per_rank(_local_ranks())
        log.info("%s: rank 0 of %d ranks on %d node(s), started by %s", spec.name, self.world_size,
                 job.env.nnodes, job.env.launcher)
        job.send("start", {"spec": spec, "model": model, "hooks": hooks_path})
        self.thread = threading.Thread(target=self._serve, name="rank0", daemon=True)
        self.thread.start()
        built, self.load_info = self._wait("start-up", spec.startup_timeout_s, "backend.startup_timeout_s")
        self.model_info, self.precision = split_precision(built)
        log.info("%s: rank 0 ready (the other ranks are checked at each pass)", spec.name)

    def _serve(self) -> None:
        command = None
        try:
            rank = _Rank(self.job, self.spec, self.model_spec, self.hooks_path)
            self.replies.put(("done", (rank.built, rank.load)))
            while True:
                command = self.commands.get()
                if command is None:
                    rank.close()
                    return
                self.replies.put(("done", rank.run(command)))
        except BaseException as exc:  # noqa: BLE001 - the main thread names the cause
            kind, _, payload = failure_report(exc, 0, self.spec, command)
            self.replies.put((kind, payload))

    def _wait(self, what: str, timeout_s: Optional[float], timeout_key: str = "bench.pass_timeout_s") -> Any:
        """Rank 0's reply; a rank that posts a failure or stops beating ends the wait, naming it."""
        try:
            return self._wait_for_reply(what, timeout_s, timeout_key)
        except KeyboardInterrupt:
            # The launcher stops every rank (SIGTERM) when a rank or a node fails; often before the
            # heartbeats can name it. Record what rank 0 saw; a plain interrupt stays an interrupt.
            seen = self.seen_failure or self._drained_failure()
            cause = self._peer_cause()
            if cause is None and seen is None:
                self.closed = True  # rank 0's thread may be mid-pass: the other ranks leave now, not after it
                self.job.abort("interrupted")
                raise
            if cause is not None:
                message = f"{cause.message} during {what}"
            else:
                message = (f"{self.job.env.launcher} stopped the job during {what} after rank 0's collective failed "
                           f"(another rank died; the launcher's log names it): {first_line(seen, 200)}")
            self._abort(message, status="error")

    def _drained_failure(self) -> Optional[str]:
        try:
            kind, payload = self.replies.get_nowait()
        except queue.Empty:
            return None
        return payload[0] if kind != "done" else None

    def _wait_for_reply(self, what: str, timeout_s: Optional[float], timeout_key: str) -> Any:
        start = last_check = time.monotonic()
        while True:
            try:
                kind, payload = self.replies.get(timeout=_POLL_S)
            except queue.Empty:
                if time.monotonic() - last_check >= HEARTBEAT_EVERY_S:
                    last_check = time.monotonic()
                    self._check_peers(what)
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    self._abort(f"{what} ran past {timeout_key}={timeout_s:g} s; every rank was stopped",
                                status="timeout")
                continue
            if kind == "done":
                return payload
            self._own_failure(kind, payload, what)

    def _peer_cause(self) -> Optional[Failure]:
        """Another rank's posted failure or death, None when none is known."""
        if self.job.store_lost is not None:
            return Failure(self.job.store_lost)
        try:
            posted = self.job.peer_failure()
            dead = self.job.dead_peer() if posted is None else None
        except Exception as exc:  # noqa: BLE001 - the store itself is gone
            self.job.store_lost = f"lost the job's store ({type(exc).__name__}): the launcher ended the job"
            return Failure(self.job.store_lost)
        if posted is not None:
            kind, message, details = posted
            return Failure(message, details, "oom" if kind == "oom" else "error")
        return Failure(dead) if dead is not None else None

    def _check_peers(self, what: str) -> None:
        cause = self._peer_cause()
        if cause is not None:
            self._abort(cause.message if cause.status == "oom" else f"{cause.message} during {what}",
                        details=cause.details, status=cause.status)

    def _own_failure(self, kind: str, payload, what: str) -> None:
        message, details = payload
        self.seen_failure = message
        # Rank 0 failing in a collective is mostly a peer's death: give its heartbeat time to tell.
        failure = blame(kind, 0, message, details, what, self._peer_cause,
                        wait_s=STALE_AFTER_S + 2 * HEARTBEAT_EVERY_S, poll_s=HEARTBEAT_EVERY_S)
        self._abort(failure.message, details=failure.details, status=failure.status)

    def _abort(self, message: str, details: Optional[str] = None, status: str = "error") -> None:
        self.failure_reason = message
        self.closed = True
        self.job.abort(message)
        raise BackendError(message, details=details, status=status)

    def _run_pass(self, command: PassCommand) -> PassResult:
        if self.closed:
            raise BackendError(f"{self.name}: the launched job's ranks are stopped")
        # The examples travel once per point (the passes of a point share them), the rest with every pass.
        if command.examples is not self.sent_examples:
            self.job.send("examples", command.examples)
            self.sent_examples = command.examples
        seq = self.job.send("pass", command.replace(examples=None))
        self.commands.put(command)
        result = self._wait(command.pass_type, command.timeout_s)
        self.job.forget(seq)  # every rank took part in the pass, so each has read all before it
        return result

    def failure(self) -> Optional[str]:
        if self.failure_reason is not None:
            return self.failure_reason
        if self.closed:
            return f"{self.name}: the launched job's ranks are stopped"
        cause = self._peer_cause()
        return cause.message if cause is not None else None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.job.send("close")
        self.commands.put(None)
        self.thread.join(timeout=60)
