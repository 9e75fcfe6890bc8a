"""Device samplers: CPU utilisation and resident memory (psutil), GPU utilisation and used memory (NVML).

The measurement protocol (harness/measuring/measure.py) starts one around each timed
repeat (``make_sampler``) and stops it after; the GPU sampler finds the run's
devices among NVML's by UUID (``match_nvml_devices``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional, Sequence

import psutil

from backends.backend import Backend
from backends.runtime.devices import usable_cpu_cores

# The protocol's logger: make_sampler's warning keeps the name its line always had.
log = logging.getLogger("harness.measure")


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
        from backends.runtime.memory import room_for_a_thread

        self._begin()
        self._stop.clear()
        self._thread = None
        if not room_for_a_thread():  # polled at start and stop only: utilisation stays exact, the peak is sampled less
            log.warning("%s: no room under this process's memory limit to start its thread; this pass's memory is "
                        "sampled at its start and end only", self.name)
            return
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


def local_devices(backend: Backend) -> int:
    """How many GPUs this node's ranks use: every rank's on one node, else the node's share (a launched job's
    ``local_ranks``), never more than the node has."""
    import torch

    ranks_here = getattr(backend, "local_ranks", None) or backend.world_size
    return max(1, min(ranks_here, torch.cuda.device_count() or ranks_here))


def make_sampler(backend: Backend, interval_s: float):
    """The sampler for the backend's device: NVML on GPUs (None when NVML is missing), psutil on CPUs."""
    if backend.device.type == "cuda":
        try:
            # the GPUs of this node's ranks: a job over several nodes has world_size ranks, not world_size GPUs here
            return GpuSampler(range(local_devices(backend)), interval_s)
        except Exception as exc:  # noqa: BLE001 - NVML missing: utilisation unknown, the benchmark still runs
            log.warning("GPU utilisation not sampled (%s)", exc)
            return None
    return CpuSampler([os.getpid(), *backend.pids()], interval_s)


__all__ = ["CpuSampler", "GpuSampler", "make_sampler", "match_nvml_devices"]
