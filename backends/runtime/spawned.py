"""Ranks the harness spawns itself: the controller in the harness process and the loop each spawned rank runs.

The controller starts ``world_size`` processes, one rank each, and sends every
pass to all of them as one PassCommand holding every length but only the
rank's own share of the examples (backends/runtime/ranks.py runs it); rank 0
replies with the gathered PassResult. Under torchrun or Slurm the ranks exist
already: backends/runtime/launched.py.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from backends.backend import Backend, split_precision
from backends.errors import BackendError, UserError
from backends.messages import PassCommand, PassResult
from backends.model.loading import merge_load_records
from backends.registry import BY_NAME, is_lockstep
from backends.runtime.devices import resolve_device, usable_cpu_cores, use_threads_per_rank
from backends.runtime.failures import Failure, blame, collective_timeout, failure_report
from backends.runtime.forkserver import apply_environment, rank_context, release_fork_server
from backends.runtime.job import resolve_world_size
from backends.runtime.liveness import HEARTBEAT_EVERY_S, Heartbeats, die_with_parent, start_heartbeat, stopped_line
from backends.runtime.memory import data_segment_bytes, limit_memory, near_the_limit
from backends.runtime.ranks import rank_commands, run_command, start_rank
from backends.specs import BackendSpec, ModelSpec

log = logging.getLogger(__name__)

_STARTUP_POLL_S = 0.2


def _device_for_rank(base: torch.device, rank: int) -> torch.device:
    if base.type == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return base


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _setup_worker_logging(log_queue) -> None:
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(log_queue)]
    root.setLevel(logging.INFO)


def worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    hooks_path: str,
    spec: BackendSpec,
    model_spec: ModelSpec,
    commands,
    replies,
    log_queue,
    parent_pid: int,
    environ: dict[str, str],
    startup_log: Optional[str] = None,
) -> None:
    """Entry point of one rank: join the group, build the model, then serve commands until told to stop."""
    # The rank's parent is the fork server, which exits when the controller does once the rank has let go of it
    # (release_fork_server); a parent gone before the death signal was armed, or a controller gone already, ends
    # the rank here.
    release_fork_server()
    forked_by = os.getppid()
    die_with_parent()
    if os.getppid() != forked_by or not _alive(parent_pid):
        os._exit(1)
    apply_environment(environ)
    # Ctrl-C reaches the whole process group: the controller handles it and stops the ranks in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _setup_worker_logging(log_queue)
    wlog = logging.getLogger(f"backends.{spec.name}")
    saved_stderr = _capture_stderr(startup_log)
    try:
        base = resolve_device(spec.device)
        if base.type == "cpu":  # every rank of this backend runs on this host
            use_threads_per_rank(world_size)
        device = _device_for_rank(base, rank)
        # The reply queue's feeder thread starts with its first message, and the heartbeat's thread (with its own
        # client of the store: a rank blocked on the other is still beating): both before the memory limit, so a
        # rank that cannot start threads under the limit can still say why, and a stopped one is told from it.
        replies.put(("starting", rank, None))
        start_heartbeat(dist.TCPStore("127.0.0.1", store_port, None, is_master=False,
                                      timeout=timedelta(seconds=spec.dist_timeout_s)), rank)
        limit_memory(spec.memory_limit_gb, device)
        store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=spec.dist_timeout_s))
        hooks, model, built, method, load = start_rank(spec, model_spec, hooks_path, rank, world_size, device, store)
        _restore_stderr(saved_stderr, startup_log)  # before "ready": the controller then removes the file
        replies.put(("ready", rank, {"built": built, "method": method, "load": load,
                                     "threads": torch.get_num_threads()}))
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, which names the rank
        replies.put(failure_report(exc, rank, spec, None))
        return

    while True:
        command = commands.get()
        if command is None:
            break
        failure = None
        try:
            reply = run_command(command, model, hooks, rank, world_size, device, wlog)
            replies.put(("done", rank, reply))
            continue
        except BaseException as exc:  # noqa: BLE001 - any failure of a step is reported to the controller
            failure = failure_report(exc, rank, spec, command, world_size)
        # Reported once the failed step's frames are released; the other ranks may now be
        # blocked in a collective, and the controller stops them all.
        replies.put(failure)
        break
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def _capture_stderr(path: Optional[str]) -> Optional[int]:
    """Start-up's native output (the C library's "cannot allocate memory for thread-local data: ABORT", C++'s
    "terminate called ...") into ``path``: a start-up that fails is one line on the console, that text in the
    point's error.txt. The rank's Python logging goes through the log queue, not here. Returns the saved stderr."""
    if path is None:
        return None
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


def _restore_stderr(saved: Optional[int], path: Optional[str]) -> None:
    """A start-up that succeeded: stderr back, and what start-up wrote there (warnings) shown after all."""
    if saved is None:
        return
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    try:
        with open(path, "rb") as f:
            text = f.read()
        if text:
            os.write(2, text)
    except OSError:
        pass


class _LogForwarder:
    """Replays workers' log records in this process, so they reach the console and the run's log file.

    Stopped by an event, not by a sentinel put on the queue: this process only reads the queue, and its first put
    would start the queue's feeder thread, which Python 3.12 refuses from an atexit handler (the hot backend closes
    there: "can't create new thread at interpreter shutdown"). After stop() it replays what is still queued, then
    ends once the queue stays empty for a poll."""

    POLL_S = 0.1

    def __init__(self, log_queue):
        self.queue = log_queue
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="worker-logs", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                record = self.queue.get(timeout=self.POLL_S)
            except queue.Empty:
                if self.stopping.is_set():
                    return
                continue
            except (EOFError, OSError, ValueError):
                return
            if record is None:
                return
            logging.getLogger(record.name).handle(record)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=2)


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _seconds(elapsed: float) -> str:
    """An elapsed time as a deadline's message says it: tenths below 10 s (a 0.5 s deadline is not "after 1 s")."""
    return f"{elapsed:.1f} s" if elapsed < 10 else f"{elapsed:.0f} s"


def _startup_log(name: str, rank: int) -> str:
    fd, path = tempfile.mkstemp(prefix=f"{name}-rank{rank}-start-up-", suffix=".log")
    os.close(fd)
    return path


class DistributedBackend(Backend):
    """The controller: starts the ranks, sends each pass, collects rank 0's reply, stops everything on failure."""

    hooks_path = "backends.runtime.ranks:RankHooks"

    def __init__(self, spec: BackendSpec, model: ModelSpec, hooks_path: Optional[str] = None):
        super().__init__(spec, model)
        started = time.monotonic()  # backend.startup_timeout_s counts from here: starting the fork server included
        self.device = resolve_device(spec.device)
        self.world_size = resolve_world_size(spec.name, spec.world_size, self.device.type)
        if self.device.type == "cuda" and self.world_size > torch.cuda.device_count():
            raise UserError(
                f"world_size: {self.world_size} ranks need {self.world_size} GPUs, "
                f"{torch.cuda.device_count()} visible (valid: 1..{torch.cuda.device_count()} or null)"
            )
        if self.device.type == "cpu":
            cores = usable_cpu_cores()
            if self.world_size > cores:
                log.warning(
                    "world_size=%d ranks on %d CPU cores: the ranks share the cores (one thread each), so start-up "
                    "and every pass are slow; world_size=%d or fewer avoids it",
                    self.world_size, cores, cores,
                )
        log.info("%s: starting %d ranks on %s (loading the model)", spec.name, self.world_size, self.device.type)
        # a registered backend's ranks run the hooks its registry row names
        default = BY_NAME[self.name].rank_hooks if self.name in BY_NAME else self.hooks_path
        self.hooks_path = hooks_path or spec.hooks or default
        self.closed = False
        self.failure_reason: Optional[str] = None  # why the workers were stopped, after a failure
        ctx = rank_context(self.name)
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=spec.dist_timeout_s))
        self.heartbeats = Heartbeats(self.store)  # each rank's beat (backends/runtime/liveness.py)
        self.replies = ctx.Queue()
        self.log_queue = ctx.Queue()
        self.logs = _LogForwarder(self.log_queue)
        self.command_queues = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = []
        self.startup_logs = [_startup_log(spec.name, rank) for rank in range(self.world_size)]
        for rank in range(self.world_size):
            p = ctx.Process(
                target=worker_main,
                name=f"{spec.name}-rank{rank}",
                args=(
                    rank,
                    self.world_size,
                    self.store.port,
                    self.hooks_path,
                    spec,
                    model,
                    self.command_queues[rank],
                    self.replies,
                    self.log_queue,
                    os.getpid(),
                    dict(os.environ),
                    self.startup_logs[rank],
                ),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
        try:
            ready = self._collect("ready", timeout_s=spec.startup_timeout_s, what="start-up", progress_every_s=30.0,
                                  timeout_key="backend.startup_timeout_s", start=started)
            self.model_info, self.precision = split_precision(ready[0]["built"])
            self.load_info = merge_load_records(ready[0]["method"], [ready[r]["load"] for r in range(self.world_size)])
            self.threads_per_rank = ready[0]["threads"]  # what the ranks run with (every rank sets the same)
        except BackendError as exc:
            self.close()
            exc.details = "\n".join(filter(None, [exc.details, self._startup_output()])) or None
            raise
        except BaseException:
            self.close()
            raise
        finally:
            self._remove_startup_logs()
        log.info("%s: %d ranks ready on %s", spec.name, self.world_size, self.device.type)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _startup_output(self) -> Optional[str]:
        """What the ranks wrote to stderr during a start-up that failed (for error.txt), or None."""
        parts = []
        for rank, path in enumerate(self.startup_logs):
            try:
                with open(path, errors="replace") as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text:
                parts.append(f"rank {rank} stderr during start-up:\n{text}")
        return "\n".join(parts) or None

    def _remove_startup_logs(self) -> None:
        for path in self.startup_logs:
            try:
                os.unlink(path)
            except OSError:
                pass

    def failure(self) -> Optional[str]:
        if self.failure_reason is not None:
            return self.failure_reason
        if self.closed:
            return f"{self.spec.name}: workers are stopped"
        dead = self._dead_rank(wait_s=0)  # a rank that died between passes is noticed here, not only mid-pass
        if dead is not None:
            return f"rank {dead} {_describe_exit(self.procs[dead].exitcode)}"
        return None

    def _collect(self, kind: str, timeout_s: Optional[float], what: str, progress_every_s: Optional[float] = None,
                 timeout_key: str = "bench.pass_timeout_s", start: Optional[float] = None) -> dict[int, Any]:
        """Wait for one reply per rank; any error, death or stopped heartbeat ends the wait, naming the rank.

        ``start``: when the deadline's clock started (start-up: before the ranks were spawned), else now.
        """
        got: dict[int, Any] = {}
        start = time.monotonic() if start is None else start
        last_progress = last_beat_check = time.monotonic()
        while len(got) < self.world_size:
            if progress_every_s is not None and time.monotonic() - last_progress >= progress_every_s:
                last_progress = time.monotonic()
                log.info("%s: %d/%d ranks ready after %.0f s", what, len(got), self.world_size, last_progress - start)
            try:
                msg_kind, rank, payload = self.replies.get(timeout=_STARTUP_POLL_S)
            except queue.Empty:
                for rank, p in enumerate(self.procs):
                    if rank not in got and not p.is_alive():
                        self._abort_timed_out_collective(what)
                        self._abort(*self._under_limit(f"rank {rank} {_describe_exit(p.exitcode)} during {what}",
                                                       what, "error"))
                if time.monotonic() - last_beat_check >= HEARTBEAT_EVERY_S:
                    last_beat_check = time.monotonic()
                    stopped = self._stopped_rank()
                    if stopped is not None:
                        self._abort(f"{stopped_line(stopped)} during {what}; every rank was stopped")
                elapsed = time.monotonic() - start
                if timeout_s is not None and elapsed > timeout_s:
                    starved = [r for r, p in enumerate(self.procs) if r not in got and self._at_limit(p.pid)]
                    message = (f"{what}: {len(got)}/{self.world_size} ranks ready after {_seconds(elapsed)}, past "
                               f"{timeout_key}={timeout_s:g}")
                    if starved:
                        self._abort(*self._under_limit(f"{message}, rank {starved[0]} at its limit; every rank was "
                                                       "stopped", what, "timeout"))
                    self._abort(f"{message}; every rank was stopped", status="timeout")
                continue
            if msg_kind in ("error", "oom"):
                self._fail(msg_kind, rank, payload, what)
            if msg_kind == kind:
                got[rank] = payload
        return got

    def _stopped_rank(self) -> Optional[int]:
        """A rank that has beaten and whose heartbeat has since stood still for STALE_AFTER_S (SIGSTOPped, or hung
        with the interpreter locked), None while all beat. A rank not yet beating is start-up's deadline's."""
        try:
            for rank in range(self.world_size):
                if self.heartbeats.count(rank) > 0 and self.heartbeats.stale(rank):
                    return rank
        except Exception:  # noqa: BLE001 - this process's own store: gone only while it closes
            return None
        return None

    def _abort_timed_out_collective(self, what: str) -> None:
        """A rank NCCL's watchdog ended (a collective past backend.dist_timeout_s, loading's broadcasts among them) is
        named in one line, status timeout; start-up only, where the ranks' stderr is kept."""
        if what != "start-up":
            return
        for rank, path in enumerate(self.startup_logs):
            try:
                with open(path, errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            line = collective_timeout(text, rank, what, self.spec.dist_timeout_s)
            if line is not None:
                self._abort(line, details=self._startup_output(), status="timeout")

    def _at_limit(self, pid: Optional[int]) -> bool:
        """Whether a rank's data segment (what RLIMIT_DATA counts) is within THREAD_ROOM_BYTES of
        bench.memory_limit_gb: too close to be sure of starting another thread (its stack alone is 8 MiB)."""
        if self.spec.memory_limit_gb is None or pid is None or self.device.type != "cpu":
            return False
        return near_the_limit(data_segment_bytes(pid), self.spec.memory_limit_gb * 1024**3)

    def _under_limit(self, message: str, what: str, status: str) -> tuple[str, None, str]:
        """A start-up that died with no report of its own, or hung at its limit, as ``_abort``'s arguments: under
        ``bench.memory_limit_gb`` that is the limit (a rank that cannot start a thread under it aborts in the C
        library, or waits in the process group's set-up forever), so the status is ``oom``."""
        if what != "start-up" or self.spec.memory_limit_gb is None:
            return message, None, status
        return ((f"out of memory in start-up: bench.memory_limit_gb={self.spec.memory_limit_gb:g} leaves a rank too "
                 f"little to start its threads and load the model ({message})"), None, "oom")

    def _fail(self, kind: str, rank: int, payload, what: str) -> None:
        """Stop every rank and raise the failure ``blame`` names (a rank out of memory, else a dead one, else
        ``rank``)."""
        message, details = payload

        def find_peer() -> Optional[Failure]:
            try:
                k, r, p = self.replies.get(timeout=0.05)
                if k == "oom":
                    return Failure(p[0], p[1], "oom")
            except queue.Empty:
                pass
            # a rank that exited with code 0 left its command loop after reporting a failure of its own (the same
            # mismatch, or a collective this rank broke): it did not die first, so it is not the one to blame
            dead = self._dead_rank(0, exclude=rank, crashed_only=True)
            return Failure(f"rank {dead} {_describe_exit(self.procs[dead].exitcode)}") if dead is not None else None

        failure = blame(kind, rank, message, details, what, find_peer, wait_s=1.0, poll_s=0)
        self._abort(failure.message, details=failure.details, status=failure.status)

    def _dead_rank(self, wait_s: float, exclude: Optional[int] = None, crashed_only: bool = False) -> Optional[int]:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs):
                if p.exitcode is not None and rank != exclude and not (crashed_only and p.exitcode == 0):
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _abort(self, message: str, details: Optional[str] = None, status: str = "error") -> None:
        self.failure_reason = message
        self.close(graceful=False)
        raise BackendError(message, details=details, status=status)

    def _run_pass(self, command: PassCommand) -> PassResult:
        if self.closed:
            raise BackendError(f"{self.spec.name}: workers are stopped")
        for q, rank_command in zip(
            self.command_queues, rank_commands(command, self.world_size, is_lockstep(self.name))
        ):
            q.put(rank_command)
        replies = self._collect("done", timeout_s=command.timeout_s, what=command.pass_type)
        return replies[0]

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            for q in self.command_queues:
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 20
            for p in self.procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        self.logs.stop()
        for q in [*self.command_queues, self.replies, self.log_queue]:
            q.close()
            q.cancel_join_thread()

    def __del__(self):  # a controller dropped without close() still stops its ranks
        try:
            self.close(graceful=False)
        except Exception:  # noqa: BLE001 - nothing can be reported from __del__
            pass
