"""What every backend offers the harness: a command dict in, per-example outputs in request order out."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from backends.errors import UserError
from backends.examples import Example, ExampleOutput
from backends.planning import LAYOUTS, PLANNERS, CostModel, Plan, plan_batch
from backends.planning.plan import check_choice
from backends.specs import BackendSpec, ModelSpec
from backends.step import PASS_TYPES


def make_command(
    pass_type: str,
    examples: Sequence[Example],
    max_tokens_per_microbatch: Optional[int],
    micro_batch_size: int,
    layout: str = "padded",
    planner: str = "greedy",
    cost_model: Optional[dict] = None,
) -> dict[str, Any]:
    """The command dict a backend (and its workers) executes for one pass.

    ``cost_model`` is ``CostModel.as_dict()`` (None: cost = computed tokens);
    every rank plans the same global plan from it, so it travels with the command.
    Optional key: ``logprob_chunk_tokens`` overrides ``backend.logprob_chunk_tokens``
    for this pass (None = full logits), e.g. to compare the two paths on one backend.
    """
    if pass_type not in PASS_TYPES:
        raise ValueError(f"pass type must be one of {PASS_TYPES}, got {pass_type!r}")
    check_choice("layout", layout, LAYOUTS)
    check_choice("planner", planner, PLANNERS)
    return {
        "pass_type": pass_type,
        "examples": list(examples),
        "max_tokens_per_microbatch": max_tokens_per_microbatch,
        "micro_batch_size": micro_batch_size,
        "layout": layout,
        "planner": planner,
        "cost_model": cost_model,
    }


def command_lengths(command: dict[str, Any]) -> list[int]:
    """Every example's length: sent as ``lengths`` with a rank's share (backends/workers.py), else read off the examples."""
    if command.get("lengths") is not None:
        return list(command["lengths"])
    return [len(e) for e in command["examples"]]


def usable_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def plan_command(command: dict[str, Any], world_size: int, lockstep: bool) -> Plan:
    """The global plan of a command: every rank (and the controller) computes the same one from the same inputs."""
    return plan_batch(
        command_lengths(command),
        world_size,
        command["max_tokens_per_microbatch"],
        command["micro_batch_size"],
        align=lockstep,
        layout=command.get("layout", "padded"),
        planner=command.get("planner", "greedy"),
        cost_model=CostModel.from_dict(command.get("cost_model")),
    )


@dataclass
class PassResult:
    """One pass: outputs in request order, the plan that ran, and what it cost."""

    outputs: list[ExampleOutput]
    plan: dict
    grad_norm: Optional[float] = None
    mem_peak_bytes: Optional[int] = None  # the largest of mem_peak_bytes_per_rank
    # Each rank's memory peak during the pass: CUDA memory reserved on GPU, resident set (VmHWM) on CPU.
    mem_peak_bytes_per_rank: Optional[list[Optional[int]]] = None
    # Each rank's CUDA allocator peaks (tensors; tensors plus the allocator's cache); None on CPU.
    mem_peak_allocated_bytes_per_rank: Optional[list[Optional[int]]] = None
    mem_peak_reserved_bytes_per_rank: Optional[list[Optional[int]]] = None
    # The timed region (first step to the last one's end, device synchronized; the slowest rank's);
    # None where the backend does not time it, and the caller's wall time stands.
    step_s: Optional[float] = None
    # What ran: {op: {implementation: calls}} summed over ranks (backends/kernels.py); None where unknown.
    kernels: Optional[dict] = None


def split_precision(built: Optional[dict]) -> tuple[Optional[dict], Optional[dict]]:
    """Rank 0's start-up record as (what was built, the precision policy): the ranks send both in one dict."""
    if built is None:
        return None, None
    return {k: v for k, v in built.items() if k != "precision"}, built.get("precision")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("backend.device: 'cuda' requested but no CUDA device is visible (valid here: auto, cpu)")
    if name not in ("cpu", "cuda"):
        raise UserError(f"backend.device: '{name}' is not a device (valid: auto, cpu, cuda)")
    return torch.device(name)


def device_description(device: torch.device, count: int) -> dict:
    """Type, name and count of the devices a run uses, for results.json."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(0)
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        import platform

        import psutil

        name = _cpu_model_name() or platform.processor() or "cpu"
        total = psutil.virtual_memory().total
        return {"type": "cpu", "name": name, "count": count, "cores": usable_cpu_cores(), "memory_bytes": int(total)}
    return {"type": device.type, "name": name, "count": count, "memory_bytes": int(total)}


def _cpu_model_name() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


class Backend:
    """Base class: subclasses implement ``_run_pass`` and ``close``.

    ``run_pass`` is where a live control file (see backends/control.py) is
    read: its values replace the command's batching knobs, so a change takes
    effect at the next pass on every backend.
    """

    name = "base"
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    control = None  # a backends.control.ControlFile, or None
    model_info: Optional[dict] = None  # what was built (backends.model.describe_model), once started
    # How the weights were loaded and what it cost (backends.loading.merge_load_records), once started.
    load_info: Optional[dict] = None
    # The precision policy as it runs (backends.model.describe_precision): params, adapters, compute, reduce, grads.
    precision: Optional[dict] = None

    def __init__(self, spec: BackendSpec, model: ModelSpec):
        self.spec = spec
        self.model_spec = model

    def attach_control(self, control) -> None:
        self.control = control

    def run_pass(self, command: dict[str, Any]) -> PassResult:
        if self.control is not None:
            command = {**command, **self.control.read().as_dict()}
        result = self._run_pass(command)
        result.plan = {
            **result.plan,
            "max_tokens_per_microbatch": command["max_tokens_per_microbatch"],
            "micro_batch_size": command["micro_batch_size"],
        }
        return result

    def _run_pass(self, command: dict[str, Any]) -> PassResult:  # pragma: no cover - interface
        raise NotImplementedError

    def describe_device(self) -> dict:
        return device_description(self.device, self.world_size)

    def device_memory_bytes(self) -> int:
        """Memory of one device (GPU) or of the machine (CPU)."""
        return int(self.describe_device()["memory_bytes"])

    def pids(self) -> list[int]:
        """Processes doing the work (besides this one), for CPU utilisation and memory sampling."""
        return []

    def failure(self) -> Optional[str]:
        """Why this backend can run no more passes (a dead worker, stopped workers); None while it can."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
