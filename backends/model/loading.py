"""Loading a model sharded: FSDP2 builds it on meta, shards it, then fills each rank's shards from rank 0's copy."""

from __future__ import annotations

import logging
import threading
import time
from itertools import count
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from backends.model.build import build_model, describe_model, load_method, loaded_weights
from backends.runtime import collectives
from backends.runtime.memory import peak_memory_bytes, reset_peak_memory
from backends.specs import ModelSpec

log = logging.getLogger(__name__)

LOAD_PROGRESS_EVERY_S = 5.0  # rank 0's broadcast progress lines
READ_PROGRESS_EVERY_S = 30.0  # rank 0's "still reading" lines during a long read
_GATE_POLL_S = 0.5
_GATE_PREFIX = "balance-batch/load/"
# One number per load_sharded call in this process, the same on every rank (they load in the same order):
# a launched job's later points reuse its store, and each load needs keys of its own.
_load_serial = count()


class Rank0ReadFailed(RuntimeError):
    """Rank 0 could not read the weights; the other ranks stop too, naming its error."""


class ReadGate:
    """Rank 0's read of the weights, announced through the job's TCPStore rather than waited for in a collective.

    Reading a large checkpoint (about 67 GB for Qwen3.5-35B-A3B) can take
    longer than the process group's time-out. Had the other ranks waited in
    their first broadcast, a slow filesystem would abort start-up after
    ``backend.dist_timeout_s``. They poll a store key instead: no time limit
    while rank 0 reads (a rank that dies is noticed by the controller, or in a
    launched job by the heartbeats, which end the others), and the broadcasts
    start only once every rank knows the weights are in rank 0's memory.
    ``store.check`` never blocks, so the store client's own time-out does not apply either.
    """

    def __init__(self, store, rank: int, serial: Optional[int] = None):
        if store is None:  # the store the default process group was made with
            store = dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(_GATE_PREFIX, store)
        self.rank = rank
        self.key = f"{next(_load_serial) if serial is None else serial}/rank0"

    def open(self) -> None:
        """Rank 0: the weights are read."""
        self.store.set(self.key, "ok")

    def fail(self, message: str) -> None:
        """Rank 0: the read failed; the waiting ranks raise ``Rank0ReadFailed`` with ``message``."""
        try:
            self.store.set(self.key, "failed: " + message)
        except Exception:  # noqa: BLE001 - rank 0's own error is the one reported
            pass

    def wait(self, poll_s: float = _GATE_POLL_S, log_every_s: float = READ_PROGRESS_EVERY_S) -> float:
        """A rank other than 0: wait for rank 0's read, however long it takes; the seconds waited."""
        start = last = time.monotonic()
        while not self.store.check([self.key]):
            time.sleep(poll_s)
            if time.monotonic() - last >= log_every_s:
                last = time.monotonic()
                log.debug("rank %d: waiting for rank 0 to read the weights (%.0f s)", self.rank, last - start)
        state = self.store.get(self.key).decode(errors="replace")
        if state != "ok":
            raise Rank0ReadFailed(f"rank 0 could not read the weights ({state.removeprefix('failed: ')})")
        return time.monotonic() - start


class _Heartbeat:
    """Logs ``message`` with the seconds so far every ``every_s`` until stopped (a long read shows it is alive)."""

    def __init__(self, message: str, every_s: float):
        self.message, self.every_s = message, every_s
        self.stop = threading.Event()
        self.start = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="read-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            log.info("%s (%.0f s)", self.message, time.monotonic() - self.start)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=1)
        return False


def read_source(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    """Rank 0's copy of the weights in host memory: the checkpoint with from_pretrained, or the tiny model from its
    seed."""
    return build_model(spec, device, False, place="cpu")


def load_sharded(
    spec: ModelSpec,
    device: torch.device,
    gradient_checkpointing: bool,
    shard: Callable[[torch.nn.Module], torch.nn.Module],
    rank: int,
    store=None,
    read: Callable[[ModelSpec, torch.device], torch.nn.Module] = read_source,
    progress_every_s: float = LOAD_PROGRESS_EVERY_S,
    timeout_s: Optional[float] = None,
) -> tuple[torch.nn.Module, Optional[dict], str]:
    """The sharded model on ``device``, what was built (rank 0; None elsewhere) and how it was loaded.

    Every rank builds the model on the meta device, so nothing is allocated.
    Rank 0 alone reads the weights into host memory with ``read`` (the
    checkpoint with from_pretrained, or the tiny model from its seed, exactly
    as an unsharded run builds it, LoRA adapters included) while the others
    wait on ``store`` (the job's TCPStore; see ``ReadGate``: the wait is not
    bounded by the collective time-out). Only then does every rank shard its
    meta model with ``shard`` and give its shards storage on ``device``, and
    rank 0 sends one tensor at a time, each rank keeping its own chunk. Host
    memory is one copy of the model on one rank instead of one per rank;
    device memory never holds the unsharded model. ``timeout_s`` (the process
    group's, ``backend.dist_timeout_s``) is only for naming it in an error.
    """
    gate = ReadGate(store, rank)
    model = build_model(spec, device, gradient_checkpointing, place="meta")
    built = describe_model(model, spec) if rank == 0 else None  # counted before sharding
    source = None
    if rank == 0:
        what = spec.path or f"the {spec.name} model"
        log.info("rank 0: reading %s into host memory (%s)", what, load_method(spec))
        t0 = time.perf_counter()
        try:
            with _Heartbeat(f"rank 0: still reading {what}", READ_PROGRESS_EVERY_S):
                source = read(spec, device)
        except BaseException as exc:
            gate.fail(f"{type(exc).__name__}: {exc}"[:500])
            raise
        gate.open()
        log.info("rank 0: read %s in %.1f s", what, time.perf_counter() - t0)
        built.update(loaded_weights(source))  # what the read left out: known once it is read, not from the meta build
    else:
        gate.wait()
    # Sharding and the broadcasts are collectives: they start once rank 0 holds the weights.
    model = shard(model)
    fill_from_rank0(model, source, device, progress_every_s=progress_every_s, timeout_s=timeout_s)
    del source
    return model, built, f"meta+rank0-{load_method(spec)}-broadcast"


class BroadcastProgress:
    """Rank 0's progress through the broadcasts: tensors and GB sent, GB/s, at most every ``every_s`` (and at the
    end)."""

    def __init__(self, total_tensors: int, total_bytes: int, every_s: float = LOAD_PROGRESS_EVERY_S,
                 emit: Callable[[str], None] = log.info):
        self.total_tensors, self.total_bytes, self.every_s, self.emit = total_tensors, total_bytes, every_s, emit
        self.tensors = self.bytes = 0
        self.start = self.last = time.perf_counter()

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        return (f"rank 0: broadcast {self.tensors}/{self.total_tensors} tensors, "
                f"{self.bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB in {elapsed:.1f} s "
                f"({self.bytes / 1e9 / elapsed:.2f} GB/s)")

    def sent(self, nbytes: int) -> None:
        self.tensors += 1
        self.bytes += nbytes
        now = time.perf_counter()
        if now - self.last >= self.every_s and self.tensors < self.total_tensors:
            self.last = now
            self.emit(self.line(now))

    def done(self) -> None:
        self.emit(self.line(time.perf_counter()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def fill_from_rank0(model: torch.nn.Module, source: Optional[torch.nn.Module], device: torch.device,
                    progress_every_s: float = LOAD_PROGRESS_EVERY_S, timeout_s: Optional[float] = None) -> None:
    """Give a sharded meta model storage on ``device`` and copy rank 0's ``source`` into it (None on other ranks).

    One tensor at a time: rank 0 broadcasts the full tensor and every rank
    copies its own chunk into its shard in place, so a rank never holds more
    than its shards plus one full tensor (what torch's full-state-dict loading
    with ``broadcast_from_rank0`` does too; written out here so that rank 0
    checks names, shapes and dtypes first and buffers go in the same pass).
    Buffers travel the same way, persistent or not: Qwen3.5's rotary ``inv_freq`` and
    ``original_inv_freq`` are non-persistent, and ``to_empty`` leaves them
    uninitialised, so they are copied from rank 0 and hold exactly what an
    unsharded build computes rather than a recomputation. Rank 0 logs its
    progress (tensors, GB, GB/s) every ``progress_every_s`` and a summary at
    the end. Each broadcast is still bounded by the process group's time-out
    (``timeout_s``, from ``backend.dist_timeout_s``); a broadcast that runs past
    it fails with an error naming the tensor and that key.
    """
    is_source = dist.get_rank() == 0
    if is_source and source is None:
        raise ValueError("rank 0 must pass the model to load from")
    model.to_empty(device=device)
    targets = [*model.named_parameters(), *model.named_buffers()]
    sources = dict([*source.named_parameters(), *source.named_buffers()]) if is_source else {}
    progress = None
    if is_source:
        # Rank 0 alone can compare; its error stops every rank (the controller ends them all).
        names = {name for name, _ in targets}
        if names != set(sources):
            raise RuntimeError("the meta build and the loaded model differ in names: "
                               f"{sorted(names ^ set(sources))[:5]}")
        differ = [f"{n}: {tuple(sources[n].shape)} {sources[n].dtype} vs {tuple(t.shape)} {t.dtype}"
                  for n, t in targets if sources[n].shape != t.shape or sources[n].dtype != t.dtype]
        if differ:
            raise RuntimeError(f"the meta build and the loaded model differ in shape or dtype: {differ[:3]}")
        progress = BroadcastProgress(len(targets), sum(_nbytes(sources[n]) for n, _ in targets), progress_every_s)
    with torch.no_grad():
        for name, target in targets:
            try:
                if isinstance(target, DTensor):
                    full = (sources[name].to(device) if is_source
                            else torch.empty(target.shape, dtype=target.dtype, device=device))
                    collectives.broadcast(full, 0, timeout_s)  # on CUDA: a time-out raised here, not a watchdog abort
                    target.to_local().copy_(_local_chunk(full, target))
                    del full
                else:
                    if is_source:
                        target.copy_(sources[name])
                    collectives.broadcast(target, 0, timeout_s)
            except RuntimeError as exc:
                if not _is_timeout(exc):
                    raise
                limit = f" after {timeout_s:g} s" if timeout_s is not None else ""
                raise TimeoutError(
                    f"loading: broadcasting {name} from rank 0 timed out{limit} (the process group's time-out, "
                    f"backend.dist_timeout_s; raise it for a slow interconnect): {str(exc).splitlines()[0][:200]}"
                ) from exc
            if progress is not None:
                progress.sent(_nbytes(sources[name]))
    if progress is not None:
        progress.done()


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _local_chunk(full: torch.Tensor, sharded: "DTensor") -> torch.Tensor:
    """This rank's part of ``full`` under the DTensor's placements (FSDP2: ``Shard(0)``, torch.chunk's split)."""
    from torch.distributed.tensor import Shard

    local = full
    for mesh_dim, placement in enumerate(sharded.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(local, sharded.device_mesh.size(mesh_dim), dim=placement.dim)
            index = sharded.device_mesh.get_local_rank(mesh_dim)
            local = chunks[index] if index < len(chunks) else local.narrow(placement.dim, 0, 0)
        elif not placement.is_replicate():
            raise NotImplementedError(f"loading into a {placement} placement")
    return local


class LoadMeter:
    """Load time and memory peaks of one rank, for results.json's ``load``."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        reset_peak_memory(torch.device("cpu"))
        if self.device.type == "cuda":
            reset_peak_memory(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":  # the load's copies to the device are queued: the clock waits for them
            torch.cuda.synchronize(self.device)
        self.elapsed_s = time.perf_counter() - self.start
        self.host_peak_bytes = peak_memory_bytes(torch.device("cpu"))
        self.device_peak_bytes = peak_memory_bytes(self.device) if self.device.type == "cuda" else None
        return False

    def as_dict(self) -> dict:
        return {"elapsed_s": self.elapsed_s, "host_peak_bytes": self.host_peak_bytes,
                "device_peak_bytes": self.device_peak_bytes}


def merge_load_records(method: str, per_rank: list[dict]) -> dict:
    """One ``load`` entry from every rank's record: the slowest rank's time, peaks per rank (device null on CPU)."""
    device = [r["device_peak_bytes"] for r in per_rank]
    return {
        "elapsed_s": max(r["elapsed_s"] for r in per_rank),
        "method": method,
        "host_peak_bytes": [r["host_peak_bytes"] for r in per_rank],
        "device_peak_bytes": None if all(d is None for d in device) else device,
    }
