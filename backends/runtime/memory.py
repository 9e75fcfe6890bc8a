"""Memory limits for experiments, and telling an out-of-memory failure from any other."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import resource
from dataclasses import dataclass
from typing import Any, Optional

import torch

from backends.errors import first_line

log = logging.getLogger(__name__)

_OOM_MARKERS = ("can't allocate memory", "cannot allocate memory", "out of memory")


# oneDNN (bf16 matmuls on CPU) says only this when its scratchpad or generated code cannot be mapped: under this
# process's RLIMIT_DATA that is the limit; with no limit it may be anything, and stays an error
_LIMITED_OOM_MARKERS = ("could not create a primitive",)


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's refusal (oneDNN's
    too, in a process under a memory limit)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    if any(m in text for m in _OOM_MARKERS):
        return True
    limited = resource.getrlimit(resource.RLIMIT_DATA)[0] != resource.RLIM_INFINITY
    return limited and any(m in text for m in _LIMITED_OOM_MARKERS)


_THREAD_START_MARKERS = ("can't start new thread", "resource temporarily unavailable")


def is_thread_start_failure(exc: BaseException) -> bool:
    """A thread that could not start (Python's, or a C++ std::thread's EAGAIN): under RLIMIT_DATA, its stack did
    not fit in what the limit left."""
    return isinstance(exc, (RuntimeError, OSError)) and any(m in str(exc).lower() for m in _THREAD_START_MARKERS)


@dataclass(frozen=True)
class MemoryLimit:
    """A memory cap ``limit_memory`` set, and the value that undoes it.

    ``kind`` is "cuda_fraction" (``value``/``previous``: the allocator's
    per-process fraction of ``device_index``) or "rlimit_data" (soft and hard
    RLIMIT_DATA).
    """

    kind: str
    value: Any
    previous: Any
    device_index: Optional[int] = None

    def undone(self) -> "MemoryLimit":
        """The limit that restores what was there before this one."""
        return MemoryLimit(self.kind, self.previous, self.value, self.device_index)


def plan_memory_limit(
    limit_gb: Optional[float], device_type: str, total_bytes: int, current: Any, device_index: Optional[int] = None
) -> Optional[MemoryLimit]:
    """What to set for a cap of ``limit_gb`` (pure): ``current`` is the fraction in force (CUDA) or (soft, hard)
    RLIMIT_DATA."""
    if limit_gb is None:
        return None
    limit = int(limit_gb * 1024**3)
    if device_type == "cuda":
        return MemoryLimit("cuda_fraction", min(1.0, limit / total_bytes), float(current), device_index)
    soft_before, hard = current
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    return MemoryLimit("rlimit_data", (soft, hard), (soft_before, hard))


def _apply(limit: MemoryLimit) -> None:
    if limit.kind == "cuda_fraction":
        torch.cuda.set_per_process_memory_fraction(limit.value, limit.device_index)
    else:
        resource.setrlimit(resource.RLIMIT_DATA, limit.value)


def limit_memory(limit_gb: Optional[float], device: torch.device) -> Optional[MemoryLimit]:
    """Cap this process's memory at ``limit_gb``: the per-process fraction on GPU, an OS limit on CPU.

    On CPU the limit is RLIMIT_DATA (heap and private anonymous mappings, where
    tensors live), so an allocation beyond it fails as on a full machine. Only
    the soft limit is lowered. The returned limit goes to ``restore_memory_limit``:
    on GPU it puts back the fraction in force before (1.0 unless someone capped
    it), so a capped point does not cap every later point of the process.
    """
    if limit_gb is None:
        return None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        planned = plan_memory_limit(limit_gb, "cuda", total, torch.cuda.get_per_process_memory_fraction(index), index)
    else:
        planned = plan_memory_limit(limit_gb, "cpu", 0, resource.getrlimit(resource.RLIMIT_DATA))
        keep_large_blocks_off_the_heap()
    assert planned is not None
    _apply(planned)
    return planned


def data_segment_bytes(pid: Any = "self") -> Optional[int]:
    """What RLIMIT_DATA counts of a process (its VmData), None where /proc does not say (not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


THREAD_ROOM_BYTES = 64 * 1024**2  # a thread's stack and its start-up, with room: below this nothing is started


def near_the_limit(held: Optional[int], limit_bytes: float) -> bool:
    """Whether a process holding ``held`` bytes of data segment is within THREAD_ROOM_BYTES of ``limit_bytes``: too
    close to count on starting a thread (False where /proc did not say what it holds)."""
    return held is not None and held + THREAD_ROOM_BYTES > limit_bytes


def room_for_a_thread() -> bool:
    """Whether this process can start a thread under its own RLIMIT_DATA (always, with no limit or no /proc). A
    thread whose start-up runs out of memory raises inside the new thread, and Thread.start() then waits forever
    for it to say it started: under bench.memory_limit_gb a pass that ends near the limit (glibc keeps its freed
    heap, which the limit counts) would hang the next thread's start. Freed heap is handed back first."""
    soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if soft == resource.RLIM_INFINITY:
        return True
    if not near_the_limit(data_segment_bytes(), soft):
        return True
    _malloc_trim()
    return not near_the_limit(data_segment_bytes(), soft)


@contextlib.contextmanager
def outside_the_data_limit():
    """RLIMIT_DATA's soft limit raised to its hard one while the block runs, then put back. For the harness's own
    bookkeeping (W&B's threads and the service process it spawns) in a process whose limit is the pytorch
    backend's bench.memory_limit_gb: the limit measures the workload, and near it (glibc keeps a pass's freed heap)
    W&B could not start a thread, so a point's run was silently missing. Never around a pass."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if soft == hard:
        yield
        return
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def restore_memory_limit(previous: Optional[MemoryLimit]) -> None:
    """Undo a ``limit_memory`` (None: nothing was set)."""
    if previous is not None:
        _apply(previous.undone())


@functools.cache
def _glibc():
    """glibc, for its allocator's calls (malloc_trim, mallopt); None where the C library is another."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def _malloc_trim() -> None:
    """glibc keeps freed heap pages; trimming hands them back, so the resident set (and VmHWM) drops."""
    if _glibc() is not None:
        _glibc().malloc_trim(0)


# glibc's own starting threshold: blocks this large or larger are mapped on their own and unmapped when freed
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def keep_large_blocks_off_the_heap() -> None:
    """Under RLIMIT_DATA (bench.memory_limit_gb on CPU): glibc's mmap threshold fixed at its starting value, so every
    block of 128 KiB or more (a tensor's storage) is a mapping of its own, handed back to the kernel when freed.

    glibc raises the threshold as mappings are freed (up to 32 MiB), after which a pass's tensors land on the heap;
    when it ends (out of memory included) what stays allocated above them pins the heap at its top, and the limit
    goes on counting the freed space below (malloc_trim hands the pages back, not the address space the limit
    counts). A budget that ran out of memory then left the process 0.7 GB over where it started under a 2 GB limit,
    and the smaller budget measured next ran out too. Fixing the threshold keeps it from rising. Process-wide and
    not undone (a later limit wants it too); not glibc: nothing to do. The price is speed (fresh mappings are zeroed
    page by page: passes about 1.45x slower, docs/auto.md), said once per process in the log."""
    if _glibc() is None:
        return
    _glibc().mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    _say_the_threshold_once()


@functools.cache
def _say_the_threshold_once() -> None:
    log.info("bench.memory_limit_gb on CPU: glibc's mmap threshold is fixed at 128 KiB, so freed tensors leave the "
             "limit; passes run slower than without a limit (about 1.45x, docs/auto.md): compare their throughput "
             "with other points under a limit")


def footprint(device: torch.device) -> dict[str, Optional[int]]:
    """What this process holds once its caches are handed back (``release_cached_memory``): ``bytes``, what a
    memory limit counts (CPU: the data segment, VmData, which RLIMIT_DATA limits; CUDA: what the caching allocator
    reserves, which the per-process fraction limits), and ``measure``, its name. None where it cannot be read."""
    release_cached_memory(device)
    if device.type == "cuda":
        return {"bytes": int(torch.cuda.memory_reserved(device)), "measure": "cuda_reserved"}
    return {"bytes": data_segment_bytes(), "measure": "vm_data"}


def release_cached_memory(device: torch.device) -> None:
    """Free what earlier work left cached: unreachable objects, the CUDA caching allocator's blocks, glibc's free
    heap."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    _malloc_trim()


def reset_peak_memory(device: torch.device, release: bool = True) -> None:
    """Start a new peak, after releasing what earlier passes left cached.

    Without the release a peak reset starts from what the allocator (CUDA's
    caching allocator, or glibc's heap on CPU) still holds, so a small budget
    measured after a large one in the same process reports the large one's memory.
    ``release=False`` (a timed repeat after the same pass's first run) keeps the
    cache, as a training loop does; the peak then starts from what this pass
    type itself left cached.
    On GPU the CUDA allocator's statistics are reset. On CPU, writing 5 to
    /proc/self/clear_refs resets VmHWM to the current resident size, so the peak
    of each pass is exact rather than sampled (Linux).
    """
    if release:
        release_cached_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # no such file (not Linux) or not allowed: peak_memory_bytes then reports the lifetime peak


def _vm_hwm_bytes() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """This process's memory peak since ``reset_peak_memory``: CUDA memory reserved, or resident set (VmHWM) on CPU."""
    return peak_memory(device)["peak_bytes"]


def peak_memory(device: torch.device) -> dict[str, Optional[int]]:
    """This process's peaks since ``reset_peak_memory``.

    ``peak_bytes``: as ``peak_memory_bytes``. ``allocated_bytes``: the most
    memory tensors held at once (CUDA). ``reserved_bytes``: the most the CUDA
    caching allocator held (tensors plus its cache). Neither counts the CUDA
    context or NCCL's buffers (NVML's used memory does); both are None on CPU.
    """
    if device.type == "cuda":
        reserved = int(torch.cuda.max_memory_reserved(device))
        return {"peak_bytes": reserved, "allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                "reserved_bytes": reserved}
    return {"peak_bytes": _vm_hwm_bytes(), "allocated_bytes": None, "reserved_bytes": None}


def oom_message(pass_type: str, where: str, largest_padded: int, limit_gb: Optional[float], exc: BaseException) -> str:
    first = first_line(str(exc), 200) or type(exc).__name__
    limit = f", bench.memory_limit_gb={limit_gb:g}" if limit_gb is not None else ""
    return (
        f"out of memory in {pass_type}{where} (largest micro-batch {largest_padded:,} padded tokens{limit}): "
        f"{first}"
    )


# ---------------------------------------------------------------------------- bench.memory_snapshot

SNAPSHOT_ENTRIES = 100_000  # allocation events kept (the newest): what led up to the failure
# Each allocation's Python stack only: C++ stacks on every allocation (torch's default, "all") cost far more per
# allocation, and dumping them symbolizes every frame while holding the interpreter lock, long enough for a rank's
# heartbeat to go stale on a large model. The Python stack names the layer and the line that allocated.
SNAPSHOT_STACKS = "python"


def history_options() -> dict:
    """What ``MemoryHistory`` asks of ``torch.cuda.memory._record_memory_history``."""
    return {"enabled": "all", "context": "all", "stacks": SNAPSHOT_STACKS, "max_entries": SNAPSHOT_ENTRIES}


def snapshot_path(snapshot_dir: str, pass_type: str, rank: int) -> str:
    """In the folder the harness names (harness/results.py's SNAPSHOT_DIR in the point's folder)."""
    import os

    return os.path.join(snapshot_dir, f"{pass_type}-rank{rank}.pickle")


class MemoryHistory:
    """Around one pass on CUDA (``PassCommand.memory_snapshot_dir``): the allocator's history recorded, and dumped
    as a snapshot (open it at https://pytorch.org/memory_viz) when the pass runs out of memory.

    A no-op without a folder. The harness asks for it on the warm-up runs only (bench.memory_snapshot), so the
    timed repeats never pay for the recording; a device other than CUDA is refused before anything starts.
    """

    def __init__(self, snapshot_dir: Optional[str], pass_type: str, rank: int, device: torch.device):
        self.on = snapshot_dir is not None
        if self.on and device.type != "cuda":
            raise RuntimeError(f"bench.memory_snapshot records the CUDA allocator, and this rank runs on {device.type}")
        self.path = snapshot_path(snapshot_dir, pass_type, rank) if self.on else None

    def __enter__(self) -> "MemoryHistory":
        if self.on:
            torch.cuda.memory._record_memory_history(**history_options())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.on:
            return
        try:
            if exc is not None and is_out_of_memory(exc):
                import os

                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                torch.cuda.memory._dump_snapshot(self.path)
                log.warning("out of memory: the allocator's snapshot is %s (open it at https://pytorch.org/memory_viz)",
                            self.path)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
