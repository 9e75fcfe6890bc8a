"""The measurement protocol: warm-up, timed repeats, throughput, device utilisation and peak memory."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import psutil

from backends.backend import Backend
from backends.messages import PASS_TYPES, Example, PassCommand, PassResult, make_command
from backends.runtime.devices import usable_cpu_cores

log = logging.getLogger(__name__)


def _process_tree(pids: Sequence[int]) -> list[psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs[p.pid] = p
            for c in p.children(recursive=True):
                procs[c.pid] = c
        except psutil.Error:
            continue
    return list(procs.values())


class _PeriodicSampler:
    """Polls in a background thread between ``start`` and ``stop``; subclasses say what to poll and report."""

    name = "sampler"

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _begin(self) -> None:
        pass

    def _poll(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _result(self) -> tuple[float, float]:  # pragma: no cover - interface
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._poll()

    def start(self) -> None:
        self._begin()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def device_mem_used_bytes(self) -> Optional[list[Optional[int]]]:
        """Device-level used memory per device since ``start`` (GPU samplers); None where there is none."""
        return None

    def stop(self) -> tuple[float, float]:
        """(utilisation %, peak memory % or NaN) since ``start``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self._result()


class CpuSampler(_PeriodicSampler):
    """CPU utilisation of the run's processes (exact, from CPU times) and their peak resident memory (sampled)."""

    name = "cpu-sampler"

    def __init__(self, pids: Sequence[int], interval_s: float = 0.1):
        super().__init__(interval_s)
        self.pids = list(pids)
        self.n_cpus = usable_cpu_cores()
        self.total_memory = psutil.virtual_memory().total
        self._cpu: dict[int, float] = {}
        self.peak_rss = 0

    def _poll(self) -> None:
        rss = 0
        for p in _process_tree(self.pids):
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    self._cpu[p.pid] = t.user + t.system
                    rss += p.memory_info().rss
            except psutil.Error:
                continue
        self.peak_rss = max(self.peak_rss, rss)

    def _begin(self) -> None:
        self._poll()
        self._start_cpu = sum(self._cpu.values())
        self._start_wall = time.perf_counter()
        self.peak_rss = 0
        self._poll()

    def _result(self) -> tuple[float, float]:
        self._poll()
        wall = time.perf_counter() - self._start_wall
        cpu = sum(self._cpu.values()) - self._start_cpu
        util = 100.0 * cpu / (wall * self.n_cpus) if wall > 0 else 0.0
        return min(util, 100.0), 100.0 * self.peak_rss / self.total_memory


def _uuid_key(uuid: str) -> str:
    """A UUID as NVML and CUDA both spell it: no "GPU-"/"MIG-" prefix, lower case."""
    u = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            return u[len(prefix):]
    return u


def match_nvml_devices(cuda_uuids: Sequence[str], nvml_uuids: Sequence[str]) -> list[Optional[int]]:
    """For each CUDA device (by its UUID), the position of the same device among NVML's (None: not found).

    NVML numbers devices as the driver does and CUDA numbers the visible ones,
    so an index is only the same device when CUDA_VISIBLE_DEVICES lists plain
    indices; with UUIDs or MIG instances in it only the UUID identifies the device.
    NVML spells them "GPU-…" and "MIG-…", CUDA without the prefix.
    """
    where = {_uuid_key(u): i for i, u in enumerate(nvml_uuids)}
    return [where.get(_uuid_key(u)) for u in cuda_uuids]


def _nvml_devices(nvml) -> list[tuple[str, Any]]:
    """(UUID, handle) of every NVML device: each GPU and, under MIG, each of its MIG instances."""
    found = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        found.append((_decode(nvml.nvmlDeviceGetUUID(h)), h))
        try:
            mig_on = nvml.nvmlDeviceGetMigMode(h)[0] == nvml.NVML_DEVICE_MIG_ENABLE
        except nvml.NVMLError:  # not MIG-capable
            mig_on = False
        if not mig_on:
            continue
        for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except nvml.NVMLError:  # an empty slot
                continue
            found.append((_decode(nvml.nvmlDeviceGetUUID(m)), m))
    return found


def _decode(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuSampler(_PeriodicSampler):
    """GPU utilisation and used memory (NVML, sampled) of the devices a run uses; allocator peaks come from the workers.

    Devices are found by UUID (see ``match_nvml_devices``). Used memory is the
    device's own figure (what nvidia-smi shows: every process's memory, CUDA
    contexts and NCCL buffers included). On a MIG instance NVML reports no
    utilisation; it is then left out (None when no device reports it).
    """

    name = "gpu-sampler"

    def __init__(self, device_indices: Sequence[int], interval_s: float = 0.1):
        super().__init__(interval_s)
        import pynvml
        import torch

        self.nvml = pynvml
        pynvml.nvmlInit()
        devices = _nvml_devices(pynvml)
        cuda_uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in device_indices]
        matched = match_nvml_devices(cuda_uuids, [u for u, _ in devices])
        missing = [i for i, m in zip(device_indices, matched) if m is None]
        if missing:
            raise RuntimeError(f"CUDA devices {missing} not found among NVML's devices by UUID")
        self.handles = [devices[m][1] for m in matched if m is not None]
        self._samples: list[float] = []
        self.mem_used_bytes: list[int] = [0] * len(self.handles)

    def _begin(self) -> None:
        self._samples = []
        self.mem_used_bytes = [0] * len(self.handles)
        self._poll_memory()

    def _poll_memory(self) -> None:
        for k, h in enumerate(self.handles):
            try:
                self.mem_used_bytes[k] = max(self.mem_used_bytes[k], int(self.nvml.nvmlDeviceGetMemoryInfo(h).used))
            except self.nvml.NVMLError:
                pass

    def _poll(self) -> None:
        self._poll_memory()
        u = []
        for h in self.handles:
            try:
                u.append(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except self.nvml.NVMLError:  # e.g. a MIG instance
                pass
        if u:
            self._samples.append(sum(u) / len(u))

    def _result(self) -> tuple[Optional[float], float]:
        self._poll_memory()
        util = sum(self._samples) / len(self._samples) if self._samples else None
        return util, float("nan")  # memory %: filled in from the pass result

    def device_mem_used_bytes(self) -> Optional[list[Optional[int]]]:
        """Per device, the most memory NVML saw in use since ``start``."""
        return [m or None for m in self.mem_used_bytes]


def make_sampler(backend: Backend, interval_s: float):
    if backend.device.type == "cuda":
        try:
            return GpuSampler(range(backend.world_size), interval_s)
        except Exception as exc:  # NVML missing: utilisation unknown, the benchmark still runs
            log.warning("GPU utilisation not sampled (%s)", exc)
            return None
    return CpuSampler([os.getpid(), *backend.pids()], interval_s)


@dataclass
class PassRecord:
    """One pass type's measurements, as written to results.json."""

    elapsed_s: list[float]
    tok_per_s: float
    util_pct: Optional[float]
    mem_pct: Optional[float]
    real_tokens: int
    grad_norm: Optional[float] = None
    # Per rank, the largest over the timed repeats (see PassResult.mem_peak_bytes_per_rank); None where unknown.
    mem_peak_bytes: Optional[list[Optional[int]]] = None
    # Per rank, the CUDA allocator's peaks over the timed repeats: tensors (allocated) and tensors plus the
    # allocator's cache (reserved); None on CPU.
    mem_peak_allocated_bytes: Optional[list[Optional[int]]] = None
    mem_peak_reserved_bytes: Optional[list[Optional[int]]] = None
    # Per device the run uses, the most NVML saw in use (nvidia-smi's figure); None without NVML or on CPU.
    device_mem_used_bytes: Optional[list[Optional[int]]] = None
    # Per repeat: the caller's wall time of the whole pass, and the part of it outside the timed
    # region (elapsed_s): sending the examples, planning, copying outputs to the host, gathering them.
    pass_wall_s: Optional[list[float]] = None
    host_s: Optional[list[float]] = None
    # What ran in the last timed repeat: {op: {implementation: calls}} over all ranks (backends/model/kernels.py).
    kernels: Optional[dict] = None

    def as_dict(self) -> dict:
        return {
            "elapsed_s": self.elapsed_s,
            "tok_per_s": self.tok_per_s,
            "util_pct": self.util_pct,
            "mem_pct": self.mem_pct,
            "mem_peak_bytes": self.mem_peak_bytes,
            "mem_peak_allocated_bytes": self.mem_peak_allocated_bytes,
            "mem_peak_reserved_bytes": self.mem_peak_reserved_bytes,
            "device_mem_used_bytes": self.device_mem_used_bytes,
            "pass_wall_s": self.pass_wall_s,
            "host_s": self.host_s,
            "real_tokens": self.real_tokens,
            "grad_norm": self.grad_norm,
            "kernels": self.kernels,
        }


def measure_pass(
    backend: Backend,
    examples: Sequence[Example],
    pass_type: str,
    warmup: int,
    repeat: int,
    command_for: Callable[[str], PassCommand],
    sample_interval_s: float = 0.1,
    label: str = "",
    on_repeat: Optional[Callable[[str, int, float, float, Optional[float]], None]] = None,
) -> tuple[PassRecord, PassResult]:
    """Warm-up runs, then ``repeat`` timed runs of one pass type; returns the record and the last result."""
    result: Optional[PassResult] = None
    real_tokens = sum(len(e) for e in examples)
    runs = 0

    def command() -> PassCommand:
        # Cached memory is released once, before this pass type's first run (so the peak is this pass's, not
        # what an earlier point or pass left); later runs keep it, as the steps of a training loop do: releasing
        # before every timed repeat would time the allocator's (and the kernel's) cold start each time.
        nonlocal runs
        runs += 1
        return command_for(pass_type).replace(release_memory=runs == 1)

    for i in range(warmup):
        t0 = time.perf_counter()
        result = backend.run_pass(command())
        log.info("%s%s warm-up %d/%d: %.2f s", label, pass_type, i + 1, warmup, time.perf_counter() - t0)
    elapsed, walls, hosts, utils, mems = [], [], [], [], []
    rank_peaks: Optional[list[Optional[int]]] = None
    allocated: Optional[list[Optional[int]]] = None
    reserved: Optional[list[Optional[int]]] = None
    device_used: Optional[list[Optional[int]]] = None
    sampler = make_sampler(backend, sample_interval_s)
    for i in range(repeat):
        if sampler is not None:
            sampler.start()
        t0 = time.perf_counter()
        result = backend.run_pass(command())
        wall = time.perf_counter() - t0
        util, mem_pct = sampler.stop() if sampler is not None else (None, None)
        # The timed region the backend measured (the steps only); else the whole call.
        dt = result.step_s if result.step_s is not None else wall
        if sampler is not None:
            device_used = _max_per_rank(device_used, sampler.device_mem_used_bytes())
        allocated = _max_per_rank(allocated, result.mem_peak_allocated_bytes_per_rank)
        reserved = _max_per_rank(reserved, result.mem_peak_reserved_bytes_per_rank)
        walls.append(wall)
        hosts.append(max(0.0, wall - dt))
        if result.mem_peak_bytes is not None and backend.device.type == "cuda":
            mem_pct = 100.0 * result.mem_peak_bytes / backend.device_memory_bytes()
        rank_peaks = _max_per_rank(rank_peaks, result.mem_peak_bytes_per_rank)
        elapsed.append(dt)
        utils.append(util)
        mems.append(mem_pct)
        if on_repeat is not None:
            on_repeat(pass_type, i, dt, real_tokens / dt, util)
        log.info(
            "%s%s repeat %d/%d: %.2f s, %s tok/s%s",
            label,
            pass_type,
            i + 1,
            repeat,
            dt,
            f"{real_tokens / dt:,.0f}",
            f", util {util:.0f}%" if util is not None else "",
        )
    assert result is not None
    mean = sum(elapsed) / len(elapsed)
    known = [u for u in utils if u is not None]
    known_mem = [m for m in mems if m is not None]
    record = PassRecord(
        elapsed_s=elapsed,
        tok_per_s=real_tokens / mean,
        util_pct=(sum(known) / len(known)) if known else None,
        mem_pct=max(known_mem) if known_mem else None,
        real_tokens=real_tokens,
        grad_norm=result.grad_norm,
        mem_peak_bytes=rank_peaks,
        mem_peak_allocated_bytes=allocated,
        mem_peak_reserved_bytes=reserved,
        device_mem_used_bytes=device_used,
        pass_wall_s=walls,
        host_s=hosts,
        kernels=result.kernels,
    )
    return record, result


def _max_per_rank(
    so_far: Optional[list[Optional[int]]], new: Optional[list[Optional[int]]]
) -> Optional[list[Optional[int]]]:
    if not new:
        return so_far
    if not so_far or len(so_far) != len(new):
        return list(new)
    return [b if a is None else a if b is None else max(a, b) for a, b in zip(so_far, new)]


def default_command_for(
    examples: Sequence[Example], mtpm: Optional[int], mbs: int, **options
) -> Callable[[str], PassCommand]:
    """Commands with a fixed budget; ``options`` are make_command's (layout, planner, progress interval, time-out)."""
    return lambda pass_type: make_command(pass_type, examples, mtpm, mbs, **options)


__all__ = ["PASS_TYPES", "PassRecord", "measure_pass", "default_command_for", "CpuSampler", "GpuSampler",
           "match_nvml_devices"]
