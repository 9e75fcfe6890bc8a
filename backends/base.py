"""What every backend offers the harness: a command dict in, per-example outputs in request order out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from backends.errors import UserError
from backends.examples import Example, ExampleOutput
from backends.model import ModelSpec
from backends.step import PASS_TYPES


@dataclass
class BackendSpec:
    """A backend config (see conf/backend/); the harness fills it from the top-level knobs."""

    name: str = "pytorch"
    max_tokens_per_microbatch: Optional[int] = None
    micro_batch_size: int = 1
    gradient_checkpointing: bool = False
    world_size: Optional[int] = None  # None = one per visible GPU, else 2 CPU ranks (1 for pytorch)
    device: str = "auto"  # auto, cpu or cuda
    dist_timeout_s: float = 600.0  # torch.distributed collective time-out


def make_command(
    pass_type: str,
    examples: Sequence[Example],
    max_tokens_per_microbatch: Optional[int],
    micro_batch_size: int,
) -> dict[str, Any]:
    """The command dict a backend (and its workers) executes for one pass."""
    if pass_type not in PASS_TYPES:
        raise ValueError(f"pass type must be one of {PASS_TYPES}, got {pass_type!r}")
    return {
        "pass_type": pass_type,
        "examples": list(examples),
        "max_tokens_per_microbatch": max_tokens_per_microbatch,
        "micro_batch_size": micro_batch_size,
    }


@dataclass
class PassResult:
    """One pass: outputs in request order, the plan that ran, and what it cost."""

    outputs: list[ExampleOutput]
    plan: dict
    grad_norm: Optional[float] = None
    mem_peak_bytes: Optional[int] = None  # device memory peak over ranks (GPU); None on CPU


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
    """Base class: subclasses implement ``run_pass`` and ``close``."""

    name = "base"

    def __init__(self, spec: BackendSpec, model: ModelSpec):
        self.spec = spec
        self.model_spec = model

    world_size: int = 1
    device: torch.device = torch.device("cpu")

    def run_pass(self, command: dict[str, Any]) -> PassResult:  # pragma: no cover - interface
        raise NotImplementedError

    def device_memory_bytes(self) -> int:
        """Memory of one device (GPU) or of the machine (CPU)."""
        return int(device_description(self.device, 1)["memory_bytes"])

    def pids(self) -> list[int]:
        """Processes doing the work (besides this one), for CPU utilisation and memory sampling."""
        return []

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
