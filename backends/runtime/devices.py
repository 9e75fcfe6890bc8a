"""Devices and cores: which device a backend name means, what results.json says of it, the cores this process may
use."""

from __future__ import annotations

import os
from typing import Optional

import torch

from backends.errors import UserError


def usable_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def threads_per_rank(ranks_on_host: int) -> int:
    """The compute threads each rank of a CPU run gets, one rule for every backend (in-process, spawned, launched).

    OMP_NUM_THREADS where set (a positive integer): the user's, or a launcher's (torchrun sets 1), as torch itself
    reads it in one process. Else the usable cores shared evenly by the ranks on this host, at least one: more
    threads than cores, as torch's per-process default gives every rank, makes each parallel step wait for a thread
    without a core (the in-process PyTorch backend at 81 tok/s fwd+bwd on a loaded machine, 7,672 with one thread).
    """
    given = omp_num_threads()
    if given is not None:
        return given
    return max(1, usable_cpu_cores() // max(1, ranks_on_host))


def omp_num_threads() -> Optional[int]:
    """OMP_NUM_THREADS as a thread count, None when unset; a UserError when it is set to anything but a positive
    integer ("abc", "0": torch would fall back to its own count, and the user's setting would be ignored)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not given:
        return None
    if not (given.isascii() and given.isdigit() and int(given) > 0):
        raise UserError(f"OMP_NUM_THREADS: {given!r} is not a positive integer (valid: threads per rank, 1 or more, "
                        f"{usable_cpu_cores()} cores here; or unset it: the cores shared evenly by the ranks)")
    return int(given)


def use_threads_per_rank(ranks_on_host: int) -> int:
    """Set this process's torch threads by ``threads_per_rank``; returns the count torch then runs (recorded)."""
    torch.set_num_threads(threads_per_rank(ranks_on_host))
    return torch.get_num_threads()


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
