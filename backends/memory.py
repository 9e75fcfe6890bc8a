"""Memory limits for experiments, and telling an out-of-memory failure from any other."""

from __future__ import annotations

import logging
import resource
from typing import Optional

import torch

from backends.errors import first_line

log = logging.getLogger(__name__)

_OOM_MARKERS = ("can't allocate memory", "cannot allocate memory", "out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's refusal."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MARKERS)


def limit_memory(limit_gb: Optional[float], device: torch.device) -> Optional[tuple[int, int]]:
    """Cap this process's memory at ``limit_gb``: the per-process fraction on GPU, an OS limit on CPU.

    On CPU the limit is RLIMIT_DATA (heap and private anonymous mappings, where
    tensors live), so an allocation beyond it fails as on a full machine. Only
    the soft limit is lowered; the returned previous limits restore it.
    """
    if limit_gb is None:
        return None
    limit = int(limit_gb * 1024**3)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        return None
    previous = resource.getrlimit(resource.RLIMIT_DATA)
    hard = previous[1]
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    return previous


def restore_memory_limit(previous: Optional[tuple[int, int]]) -> None:
    if previous is not None:
        resource.setrlimit(resource.RLIMIT_DATA, previous)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's statistics, or this process's resident-set high-water mark.

    On Linux, writing 5 to /proc/self/clear_refs resets VmHWM to the current
    resident size, so the peak of each pass is exact rather than sampled.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # no such file (not Linux) or not allowed: peak_memory_bytes then reports the lifetime peak


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """This process's memory peak since ``reset_peak_memory``: CUDA memory reserved, or resident set (VmHWM) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def oom_message(pass_type: str, where: str, largest_padded: int, limit_gb: Optional[float], exc: BaseException) -> str:
    first = first_line(str(exc), 200) or type(exc).__name__
    limit = f", bench.memory_limit_gb={limit_gb:g}" if limit_gb is not None else ""
    return (
        f"out of memory in {pass_type}{where} (largest micro-batch {largest_padded:,} padded tokens{limit}): "
        f"{first}"
    )
