"""What every rank runs, spawned or launched: its backend's hooks, its start-up, and one pass of the global plan.

Each rank forms its micro-batches from the global plan every rank computes
alike, runs them (the timed region), and the results are gathered to rank 0.
What differs between backends (wrapping the model, agreeing on the step
count, gradient sync) is a ``RankHooks`` subclass in the backend's own module.
Who starts the ranks: backends/runtime/spawned.py (the harness spawns them) or
backends/runtime/launched.py (torchrun or Slurm did).
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from backends.messages import PassCommand, PassResult
from backends.model import compiling
from backends.model.build import build_model, describe_model, describe_precision, load_method
from backends.model.loading import LoadMeter
from backends.model.step import ProgressLogger, outputs_to_host, run_steps, synchronize, total_loss_weight
from backends.registry import import_path, is_lockstep
from backends.runtime.memory import MemoryHistory, peak_memory, reset_peak_memory
from backends.runtime.profiling import profiled
from backends.runtime.timeline import CollectiveWaits, StepClock, busy_clock, step_clock_name
from backends.specs import BackendSpec, ModelSpec
from balance_batch import CostModel
from balance_batch.integrations.transformers import kernels
from balance_batch.plan import Schedule
from balance_batch.stats import plan_stats


class RankHooks:
    """What a backend does differently on each rank. The defaults suit independent ranks."""

    def __init__(self, spec: BackendSpec, rank: int, world_size: int, device: torch.device):
        self.spec, self.rank, self.world_size, self.device = spec, rank, world_size, device
        # the job's TCPStore (start_rank sets it): waits that must not ride on a collective's time-out
        self.store = None

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

    def wait_points(self, model: torch.nn.Module) -> list:
        """Where a step waits for a collective: ``(object, method name)`` pairs timed apart from the step's busy time
        (backends/runtime/timeline.py ``CollectiveWaits``); none for a backend with no collective inside a step."""
        return []

    def reduce_dtype(self, model: torch.nn.Module) -> Optional[torch.dtype]:
        """The dtype gradients are summed across ranks in (results.json ``precision.reduce``); None: not reduced."""
        return None


def _all_reduce_float(value: float, op, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def start_rank(spec: BackendSpec, model_spec: ModelSpec, hooks_path: str, rank: int, world_size: int,
               device: torch.device, store) -> tuple[RankHooks, torch.nn.Module, Optional[dict], str, dict]:
    """One rank's start: its hooks, the process group (once per process), then the model as its backend loads it.

    Returns the hooks, the wrapped model, what was built (rank 0; None elsewhere),
    how it was loaded and this rank's load record (``LoadMeter.as_dict``).
    """
    hooks: RankHooks = import_path(hooks_path)(spec, rank, world_size, device)
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
    if spec.compile:  # on the wrapped model: FSDP2's and the checkpoint's hooks stay eager around each compiled layer
        compiling.compile_decoder_layers(model, spec.compile_eager_fallback)
    if built is not None:  # the precision policy as it runs, once wrapped (FSDP2's mixed precision included)
        built["precision"] = describe_precision(model, hooks.reduce_dtype(model))
        built["compile"] = compiling.describe(model) if spec.compile else None
    return hooks, model, built, method, meter.as_dict()


def rank_share(
    command: PassCommand, rank: int, world_size: int, lockstep: bool = False
) -> tuple[list[int], Schedule]:
    """This rank's examples and its micro-batches: its row of the global plan every rank computes alike.

    Lock-step plans keep their ``None`` (dummy) entries where the planner put
    them; ranks that run independently skip them.
    """
    local = command.plan(world_size, lockstep).schedules[rank]
    if not lockstep:
        local = [b for b in local if b is not None]
    mine = [i for b in local if b is not None for i in b]
    return mine, local


def rank_commands(command: PassCommand, world_size: int, lockstep: bool) -> list[PassCommand]:
    """Each rank's copy of a command: every length, but only the examples of its own share, keyed by index.

    Pickling every example to every rank would cost world_size times the batch
    in host work per pass; the plan is computed here as the ranks compute it.
    """
    examples = command.examples
    plan = command.plan(world_size, lockstep)
    lengths = [len(e) for e in examples]
    return [
        command.replace(lengths=lengths, examples={i: examples[i] for b in sched if b is not None for i in b})
        for sched in plan.schedules
    ]


def run_command(
    command: PassCommand, model, hooks: RankHooks, rank: int, world_size: int, device: torch.device, wlog
) -> Optional[PassResult]:
    """One rank's pass: its micro-batches of the global plan, timed; rank 0 returns the gathered result, the others
    None."""
    # ``examples``: all of them (a list), or this rank's share keyed by index (see rank_commands).
    examples = command.examples
    pass_type = command.pass_type
    lengths = command.all_lengths()
    lockstep = is_lockstep(hooks.spec.name)
    mine, local = rank_share(command, rank, world_size, lockstep)
    schedule = hooks.align(local)
    # releases what earlier passes left cached (the first run of a pass type): host work, before the timed region
    reset_peak_memory(device, release=command.release_memory)
    # The whole batch's loss weight, summed over ranks once per pass: every rank divides by it.
    # The collective also lines the ranks up, so the timed region starts together on all of them.
    total_weight = _all_reduce_float(total_loss_weight(examples, mine), dist.ReduceOp.SUM, device)
    with profiled(command.profile_dir, pass_type, rank, device, len(schedule), command.profile_steps,
                  command.profile_ranks, command.profile_memory) as profile, \
            compiling.PassMeter(model) as compiled, MemoryHistory(command.memory_snapshot_dir, pass_type, rank, device):
        pending, grad_norm, step_s, timeline = _timed_steps(command, model, hooks, rank, examples, schedule, mine,
                                                            lengths, total_weight, device, wlog, profile.step)
    mem = peak_memory(device)  # the steps' peak, before the host copies below
    ran = kernels.snapshot()
    # Host work after the timed region: log-probs to the host, gathered to rank 0.
    outputs = outputs_to_host(pending, examples)
    del pending
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (outputs, schedule, mem, step_s, ran, profile or None, compiled.record, timeline))
    return _gathered_result(command, gathered, rank, lengths, lockstep, grad_norm, device)


def _timed_steps(command, model, hooks, rank, examples, schedule, mine, lengths, total_weight, device, wlog,
                 on_step_end=None):
    """The timed region of one rank's pass: its steps, the gradient norm, the device synchronized.

    Returns the steps' pending outputs, the gradient norm, the region's seconds and this rank's timeline
    (``StepClock.finish``: when each step started and ended, and how long the rank was busy in it).
    """
    pass_type = command.pass_type
    points = hooks.wait_points(model)
    waits = CollectiveWaits(points, device) if points else None
    clock = StepClock(device, is_lockstep(hooks.spec.name), on_step_end, waits)
    t0 = time.perf_counter()
    clock.start()
    hooks.start_pass(model, pass_type)
    progress = None
    if rank == 0:
        mine_tokens = sum(lengths[i] for i in mine)
        progress = ProgressLogger(wlog.info, f"rank 0 {pass_type}", mine_tokens, command.progress_every_s)
    with waits if waits is not None else contextlib.nullcontext():
        pending = run_steps(
            model,
            examples,
            schedule,
            pass_type,
            total_weight,
            device,
            progress=progress,
            before_step=lambda step, is_last: hooks.before_step(model, step, is_last),
            layout=command.layout,
            logprob_chunk_tokens=command.chunk_tokens(hooks.spec.logprob_chunk_tokens),
            clock=clock,
        )
    # After the last step: the gradient sync (Megatron DDP's all-reduce, where a faster rank waits) and the norm.
    hooks.finish_pass(model, pass_type)
    grad_norm = hooks.grad_norm(model) if pass_type == "forward_backward" else None
    end = clock.end_event()
    synchronize(device)
    step_s = time.perf_counter() - t0  # the timed region: what a training step does, on this rank
    return pending, grad_norm, step_s, clock.finish(end)


def _gathered_result(command, gathered: list, rank: int, lengths, lockstep: bool, grad_norm,
                     device: torch.device) -> Optional[PassResult]:
    """Rank 0's PassResult from every rank's (outputs, schedule, memory, step time, kernels, profile, compile,
    timeline)."""
    if rank != 0:
        return None
    merged: dict = {}
    for rank_outputs, *_ in gathered:
        merged.update(rank_outputs)
    schedules = [g[1] for g in gathered]
    per_rank = [g[2]["peak_bytes"] for g in gathered]
    peaks = [m for m in per_rank if m is not None]
    return PassResult(
        outputs=[merged[i] for i in range(len(lengths))],
        plan=plan_stats(
            schedules,
            lengths,
            layout=command.layout,
            cost_model=CostModel.from_dict(command.cost_model),
            budget=command.max_tokens_per_microbatch,
            micro_batch_size=command.micro_batch_size,
            lockstep=lockstep,
            planner=command.planner,
            max_seqs=command.max_seqs_per_microbatch,  # the lower bound counts the cap, as the controller's plan does
        ).as_dict(),
        grad_norm=grad_norm,
        mem_peak_bytes=max(peaks) if peaks else None,
        mem_peak_bytes_per_rank=per_rank,
        mem_peak_allocated_bytes_per_rank=_known([g[2]["allocated_bytes"] for g in gathered]),
        mem_peak_reserved_bytes_per_rank=_known([g[2]["reserved_bytes"] for g in gathered]),
        # The slowest rank's timed region is the pass's: lock-step ranks wait for it, independent ones finish with it.
        step_s=max(g[3] for g in gathered),
        kernels=kernels.merge(g[4] for g in gathered),
        profile=[g[5] for g in gathered] if any(g[5] for g in gathered) else None,
        compile=compiling.merge(g[6] for g in gathered),
        timeline={"step_clock": step_clock_name(device), "busy_clock": busy_clock(device, lockstep),
                  "per_rank": [g[7] for g in gathered]},
    )


def _known(values: list[Optional[int]]) -> Optional[list[Optional[int]]]:
    """The per-rank list, or None when no rank knows the figure (CPU has no allocator peaks)."""
    return values if any(v is not None for v in values) else None
