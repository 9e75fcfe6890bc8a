"""Multi-process workers, written once: the controller in the harness process and the loop each rank runs.

The controller starts ``world_size`` processes, one rank each, and sends every
pass to all of them as one command dict, holding every length but only the
rank's own share of the examples. Each rank forms its micro-batches from the
global plan, runs them (the timed region), and the results are gathered to
rank 0, which replies. What differs between backends (wrapping the
model, agreeing on the step count, gradient sync) is a ``RankHooks`` subclass
in the backend's own module.
"""

from __future__ import annotations

import importlib
import logging
import logging.handlers
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from backends.base import (
    Backend,
    BackendSpec,
    PassResult,
    command_lengths,
    plan_command,
    resolve_device,
    split_precision,
    usable_cpu_cores,
)
from backends.errors import BackendError, UserError, first_line
from backends.memory import is_out_of_memory, limit_memory, oom_message, peak_memory, reset_peak_memory
from backends.microbatch import CostModel, Schedule, microbatch_tokens, plan_stats
from backends.launch import resolve_world_size
from backends.loading import LoadMeter, merge_load_records
from backends import kernels
from backends.registry import BY_NAME, LOCKSTEP_BACKENDS
from backends.model import ModelSpec, build_model, describe_model, describe_precision, load_method
from backends.step import ProgressLogger, outputs_to_host, run_steps, synchronize, total_loss_weight

log = logging.getLogger(__name__)

_STARTUP_POLL_S = 0.2


class RankHooks:
    """What a backend does differently on each rank. The defaults suit independent ranks."""

    def __init__(self, spec: BackendSpec, rank: int, world_size: int, device: torch.device):
        self.spec, self.rank, self.world_size, self.device = spec, rank, world_size, device
        self.store = None  # the job's TCPStore (start_rank sets it): waits that must not ride on a collective's time-out

    def setup(self) -> None:
        """After the process group exists, before the model is built."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def load_model(self, model_spec: ModelSpec) -> tuple[torch.nn.Module, Optional[dict], str]:
        """The wrapped model this rank trains, what was built (rank 0 says; None elsewhere) and how it was loaded.

        The default holds a full replica per rank: built straight on this rank's device, then wrapped.
        """
        model = build_model(model_spec, self.device, self.spec.gradient_checkpointing)
        # Rank 0 says what was built (counted before wrapping).
        built = describe_model(model, model_spec) if self.rank == 0 else None
        return self.wrap(model), built, load_method(model_spec)

    def align(self, local: Schedule) -> Schedule:
        """The schedule this rank runs; lock-step backends pad it to the ranks' common length."""
        return list(local)

    def start_pass(self, model: torch.nn.Module, pass_type: str) -> None:
        if pass_type == "forward_backward":
            model.zero_grad(set_to_none=True)

    def before_step(self, model: torch.nn.Module, step: int, is_last: bool) -> None:
        pass

    def finish_pass(self, model: torch.nn.Module, pass_type: str) -> None:
        pass

    def grad_norm(self, model: torch.nn.Module) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def reduce_dtype(self, model: torch.nn.Module) -> Optional[torch.dtype]:
        """The dtype gradients are summed across ranks in (results.json ``precision.reduce``); None: not reduced."""
        return None


def _all_reduce_float(value: float, op, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def _device_for_rank(base: torch.device, rank: int) -> torch.device:
    if base.type == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return base


def _import(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _die_with_parent() -> None:
    """Linux: the kernel sends this worker SIGKILL when its controller dies, so no rank is ever orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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
) -> None:
    """Entry point of one rank: join the group, build the model, then serve commands until told to stop."""
    _die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(1)
    # Ctrl-C reaches the whole process group: the controller handles it and stops the ranks in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _setup_worker_logging(log_queue)
    wlog = logging.getLogger(f"backends.{spec.name}")
    try:
        base = resolve_device(spec.device)
        if base.type == "cpu":
            torch.set_num_threads(max(1, usable_cpu_cores() // world_size))
        device = _device_for_rank(base, rank)
        limit_memory(spec.memory_limit_gb, device)
        store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=spec.dist_timeout_s))
        hooks, model, built, method, load = start_rank(spec, model_spec, hooks_path, rank, world_size, device, store)
        replies.put(("ready", rank, {"built": built, "method": method, "load": load}))
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, which names the rank
        replies.put(failure_report(exc, rank, spec, None))
        return

    while True:
        command = commands.get()
        if command is None:
            break
        failure = None
        try:
            reply = _run_command(command, model, hooks, rank, world_size, device, wlog)
            replies.put(("done", rank, reply))
            continue
        except BaseException as exc:  # noqa: BLE001
            failure = failure_report(exc, rank, spec, command, world_size)
        # Reported once the failed step's frames are released; the other ranks may now be
        # blocked in a collective, and the controller stops them all.
        replies.put(failure)
        break
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def start_rank(spec: BackendSpec, model_spec: ModelSpec, hooks_path: str, rank: int, world_size: int,
               device: torch.device, store) -> tuple[RankHooks, torch.nn.Module, Optional[dict], str, dict]:
    """One rank's start: its hooks, the process group (once per process), then the model as its backend loads it.

    Returns the hooks, the wrapped model, what was built (rank 0; None elsewhere),
    how it was loaded and this rank's load record (``LoadMeter.as_dict``).
    """
    hooks: RankHooks = _import(hooks_path)(spec, rank, world_size, device)
    hooks.store = store
    hooks.setup()
    if not dist.is_initialized():  # a launched job's later points reuse its group
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=spec.dist_timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    with LoadMeter(device) as meter:
        model, built, method = hooks.load_model(model_spec)
    if built is not None:  # the precision policy as it runs, once wrapped (FSDP2's mixed precision included)
        built["precision"] = describe_precision(model, hooks.reduce_dtype(model))
    return hooks, model, built, method, meter.as_dict()


def failure_report(exc: BaseException, rank: int, spec: Optional[BackendSpec], command: Optional[dict],
                   world_size: Optional[int] = None) -> tuple:
    """A rank's failure as its reply: ("oom" or "error", rank, (one-line message, traceback)).

    Called inside the ``except`` that caught ``exc``. Out of memory during a
    pass names the pass and the largest micro-batch this rank ran.
    """
    details = traceback.format_exc()
    if not is_out_of_memory(exc):
        return "error", rank, (f"{type(exc).__name__}: {exc}", details)
    limit_gb = spec.memory_limit_gb if spec is not None else None
    if command is None:
        return "oom", rank, (oom_message("start-up", f" on rank {rank}", 0, limit_gb, exc), details)
    if world_size is None:
        world_size = dist.get_world_size()
    _, local = _rank_share(command, rank, world_size, spec.name in LOCKSTEP_BACKENDS)
    lengths = command_lengths(command)
    largest = max((microbatch_tokens(b, lengths, command.get("layout", "padded")) for b in local), default=0)
    return "oom", rank, (oom_message(command["pass_type"], f" on rank {rank}", largest, limit_gb, exc), details)


def _rank_share(
    command: dict[str, Any], rank: int, world_size: int, lockstep: bool = False
) -> tuple[list[int], Schedule]:
    """This rank's examples and its micro-batches: its row of the global plan every rank computes alike.

    Lock-step plans keep their ``None`` (dummy) entries where the planner put
    them; ranks that run independently skip them.
    """
    local = plan_command(command, world_size, lockstep).schedules[rank]
    if not lockstep:
        local = [b for b in local if b is not None]
    mine = [i for b in local if b is not None for i in b]
    return mine, local


def rank_commands(command: dict[str, Any], world_size: int, lockstep: bool) -> list[dict[str, Any]]:
    """Each rank's copy of a command: every length, but only the examples of its own share, keyed by index.

    Pickling every example to every rank would cost world_size times the batch
    in host work per pass; the plan is computed here as the ranks compute it.
    """
    examples = command["examples"]
    plan = plan_command(command, world_size, lockstep)
    lengths = [len(e) for e in examples]
    return [
        {**command, "lengths": lengths, "examples": {i: examples[i] for b in sched if b is not None for i in b}}
        for sched in plan.schedules
    ]


def _run_command(
    command: dict[str, Any], model, hooks: RankHooks, rank: int, world_size: int, device: torch.device, wlog
) -> Optional[dict]:
    # ``examples``: all of them (a list), or this rank's share keyed by index (see rank_commands).
    examples = command["examples"]
    pass_type = command["pass_type"]
    lengths = command_lengths(command)
    lockstep = hooks.spec.name in LOCKSTEP_BACKENDS
    mine, local = _rank_share(command, rank, world_size, lockstep)
    schedule = hooks.align(local)
    # releases what earlier passes left cached (the first run of a pass type): host work, before the timed region
    reset_peak_memory(device, release=command.get("release_memory", True))
    # The whole batch's loss weight, summed over ranks once per pass: every rank divides by it.
    # The collective also lines the ranks up, so the timed region starts together on all of them.
    total_weight = _all_reduce_float(total_loss_weight(examples, mine), dist.ReduceOp.SUM, device)
    t0 = time.perf_counter()
    hooks.start_pass(model, pass_type)
    progress = None
    if rank == 0:
        mine_tokens = sum(lengths[i] for i in mine)
        progress = ProgressLogger(wlog.info, f"rank 0 {pass_type}", mine_tokens, command.get("progress_every_s", 10.0))
    pending = run_steps(
        model,
        examples,
        schedule,
        pass_type,
        total_weight,
        device,
        progress=progress,
        before_step=lambda step, is_last: hooks.before_step(model, step, is_last),
        layout=command.get("layout", "padded"),
        logprob_chunk_tokens=command.get("logprob_chunk_tokens", hooks.spec.logprob_chunk_tokens),
    )
    hooks.finish_pass(model, pass_type)
    grad_norm = hooks.grad_norm(model) if pass_type == "forward_backward" else None
    synchronize(device)
    step_s = time.perf_counter() - t0  # the timed region: what a training step does, on this rank
    mem = peak_memory(device)  # the steps' peak, before the host copies below
    ran = kernels.snapshot()
    # Host work after the timed region: log-probs to the host, gathered to rank 0.
    outputs = outputs_to_host(pending, examples)
    del pending
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (outputs, schedule, mem, step_s, ran))
    if rank != 0:
        return None
    merged: dict = {}
    for rank_outputs, *_ in gathered:
        merged.update(rank_outputs)
    schedules = [g[1] for g in gathered]
    per_rank = [g[2]["peak_bytes"] for g in gathered]
    peaks = [m for m in per_rank if m is not None]
    return {
        "outputs": [merged[i] for i in range(len(lengths))],
        "plan": plan_stats(
            schedules,
            lengths,
            layout=command.get("layout", "padded"),
            cost_model=CostModel.from_dict(command.get("cost_model")),
            max_tokens=command["max_tokens_per_microbatch"],
            micro_batch_size=command["micro_batch_size"],
            lockstep=lockstep,
            planner=command.get("planner", "greedy"),
        ).as_dict(),
        "grad_norm": grad_norm,
        "mem_peak_bytes": max(peaks) if peaks else None,
        "mem_peak_bytes_per_rank": per_rank,
        "mem_peak_allocated_bytes_per_rank": _known([g[2]["allocated_bytes"] for g in gathered]),
        "mem_peak_reserved_bytes_per_rank": _known([g[2]["reserved_bytes"] for g in gathered]),
        # The slowest rank's timed region is the pass's: lock-step ranks wait for it, independent ones finish with it.
        "step_s": max(g[3] for g in gathered),
        "kernels": kernels.merge(g[4] for g in gathered),
    }


def pass_result(reply: dict[str, Any]) -> PassResult:
    """Rank 0's gathered reply to a pass command, as the pass's result."""
    return PassResult(
        outputs=reply["outputs"],
        plan=reply["plan"],
        grad_norm=reply["grad_norm"],
        mem_peak_bytes=reply["mem_peak_bytes"],
        mem_peak_bytes_per_rank=reply["mem_peak_bytes_per_rank"],
        mem_peak_allocated_bytes_per_rank=reply["mem_peak_allocated_bytes_per_rank"],
        mem_peak_reserved_bytes_per_rank=reply["mem_peak_reserved_bytes_per_rank"],
        step_s=reply["step_s"],
        kernels=reply.get("kernels"),
    )


def _known(values: list[Optional[int]]) -> Optional[list[Optional[int]]]:
    """The per-rank list, or None when no rank knows the figure (CPU has no allocator peaks)."""
    return values if any(v is not None for v in values) else None


class _LogForwarder:
    """Replays workers' log records in this process, so they reach the console and the run's log file."""

    def __init__(self, log_queue):
        self.queue = log_queue
        self.thread = threading.Thread(target=self._run, name="worker-logs", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                record = self.queue.get()
            except (EOFError, OSError):
                return
            if record is None:
                return
            logging.getLogger(record.name).handle(record)

    def stop(self) -> None:
        try:
            self.queue.put(None)
        except (OSError, ValueError):
            pass
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


class DistributedBackend(Backend):
    """The controller: starts the ranks, sends each pass, collects rank 0's reply, stops everything on failure."""

    hooks_path = "backends.workers:RankHooks"

    def __init__(self, spec: BackendSpec, model: ModelSpec, hooks_path: Optional[str] = None):
        super().__init__(spec, model)
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
        ctx = mp.get_context("spawn")
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=spec.dist_timeout_s))
        self.replies = ctx.Queue()
        self.log_queue = ctx.Queue()
        self.logs = _LogForwarder(self.log_queue)
        self.command_queues = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = []
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
                ),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
        try:
            ready = self._collect("ready", timeout_s=None, what="start-up", progress_every_s=30.0)
            self.model_info, self.precision = split_precision(ready[0]["built"])
            self.load_info = merge_load_records(ready[0]["method"], [ready[r]["load"] for r in range(self.world_size)])
        except BaseException:
            self.close()
            raise
        log.info("%s: %d ranks ready on %s", spec.name, self.world_size, self.device.type)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def failure(self) -> Optional[str]:
        if self.failure_reason is not None:
            return self.failure_reason
        if self.closed:
            return f"{self.spec.name}: workers are stopped"
        dead = self._dead_rank(wait_s=0)  # a rank that died between passes is noticed here, not only mid-pass
        if dead is not None:
            return f"rank {dead} {_describe_exit(self.procs[dead].exitcode)}"
        return None

    def _collect(self, kind: str, timeout_s: Optional[float], what: str,
                 progress_every_s: Optional[float] = None) -> dict[int, Any]:
        """Wait for one reply per rank; any error or death ends the wait at once, naming the rank."""
        got: dict[int, Any] = {}
        start = last_progress = time.monotonic()
        while len(got) < self.world_size:
            if progress_every_s is not None and time.monotonic() - last_progress >= progress_every_s:
                last_progress = time.monotonic()
                log.info("%s: %d/%d ranks ready after %.0f s", what, len(got), self.world_size, last_progress - start)
            try:
                msg_kind, rank, payload = self.replies.get(timeout=_STARTUP_POLL_S)
            except queue.Empty:
                for rank, p in enumerate(self.procs):
                    if rank not in got and not p.is_alive():
                        self._abort(f"rank {rank} {_describe_exit(p.exitcode)} during {what}")
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    self._abort(f"{what} ran past bench.pass_timeout_s={timeout_s:g} s; every rank was stopped", status="timeout")
                continue
            if msg_kind in ("error", "oom"):
                self._fail(msg_kind, rank, payload, what)
            if msg_kind == kind:
                got[rank] = payload
        return got

    def _fail(self, kind: str, rank: int, payload, what: str) -> None:
        """Name the cause: a rank out of memory, else a rank that died (its peers then fail too), else the rank."""
        message, details = payload
        if kind != "oom":
            # A peer's OOM report or death may trail this rank's error by a moment.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    k, r, p = self.replies.get(timeout=0.05)
                except queue.Empty:
                    if self._dead_rank(0) not in (None, rank):
                        break
                    continue
                if k == "oom":
                    kind, rank, (message, details) = k, r, p
                    break
        if kind == "oom":
            self._abort(message, details=details, status="oom")
        dead = self._dead_rank(wait_s=0)
        if dead is not None and dead != rank:
            p = self.procs[dead]
            self._abort(
                f"rank {dead} {_describe_exit(p.exitcode)} during {what} "
                f"(rank {rank} then failed: {first_line(message, 160)})",
                details=details,
            )
        self._abort(f"rank {rank} failed during {what}: {first_line(message, 400)}", details=details)

    def _dead_rank(self, wait_s: float) -> Optional[int]:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs):
                if p.exitcode is not None:
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _abort(self, message: str, details: Optional[str] = None, status: str = "error") -> None:
        self.failure_reason = message
        self.close(graceful=False)
        raise BackendError(message, details=details, status=status)

    def _run_pass(self, command: dict[str, Any]) -> PassResult:
        if self.closed:
            raise BackendError(f"{self.spec.name}: workers are stopped")
        lockstep = self.spec.name in LOCKSTEP_BACKENDS
        for q, rank_command in zip(self.command_queues, rank_commands(command, self.world_size, lockstep)):
            q.put(rank_command)
        replies = self._collect("done", timeout_s=command.get("timeout_s"), what=command["pass_type"])
        return pass_result(replies[0])

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
        except Exception:  # noqa: BLE001
            pass
