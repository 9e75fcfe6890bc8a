"""Loading a model sharded: FSDP2 builds it on meta, shards it, then fills each rank's shards from rank 0's copy."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from backends.memory import peak_memory_bytes, reset_peak_memory
from backends.model import build_model, describe_model, load_method
from backends.specs import ModelSpec


def load_sharded(
    spec: ModelSpec,
    device: torch.device,
    gradient_checkpointing: bool,
    shard: Callable[[torch.nn.Module], torch.nn.Module],
    rank: int,
) -> tuple[torch.nn.Module, Optional[dict], str]:
    """The sharded model on ``device``, what was built (rank 0; None elsewhere) and how it was loaded.

    Rank 0 alone reads the weights into host memory (the checkpoint with
    from_pretrained, or the tiny model from its seed, exactly as an unsharded
    run builds it, LoRA adapters included); every rank builds the same model on
    the meta device, so nothing is allocated, shards it with ``shard``, and
    only then gives its shards storage on ``device``. Rank 0 then sends one
    tensor at a time and each rank keeps its own chunk. Host memory is one copy
    of the model on one rank instead of one per rank; device memory never holds
    the unsharded model.
    """
    source = build_model(spec, device, False, place="cpu") if rank == 0 else None
    model = build_model(spec, device, gradient_checkpointing, place="meta")
    built = describe_model(model, spec) if rank == 0 else None  # counted before sharding
    model = shard(model)
    fill_from_rank0(model, source, device)
    del source
    return model, built, f"meta+rank0-{load_method(spec)}-broadcast"


def fill_from_rank0(model: torch.nn.Module, source: Optional[torch.nn.Module], device: torch.device) -> None:
    """Give a sharded meta model storage on ``device`` and copy rank 0's ``source`` into it (None on other ranks).

    One tensor at a time: rank 0 broadcasts the full tensor and every rank
    copies its own chunk into its shard in place, so a rank never holds more
    than its shards plus one full tensor (what torch's full-state-dict loading
    with ``broadcast_from_rank0`` does too; written out here so that rank 0
    checks names, shapes and dtypes first and buffers go in the same pass).
    Buffers travel the same way, persistent or not: Qwen3.5's rotary ``inv_freq`` and
    ``original_inv_freq`` are non-persistent, and ``to_empty`` leaves them
    uninitialised, so they are copied from rank 0 and hold exactly what an
    unsharded build computes rather than a recomputation.
    """
    is_source = dist.get_rank() == 0
    if is_source and source is None:
        raise ValueError("rank 0 must pass the model to load from")
    model.to_empty(device=device)
    targets = [*model.named_parameters(), *model.named_buffers()]
    sources = dict([*source.named_parameters(), *source.named_buffers()]) if is_source else {}
    if is_source:
        # Rank 0 alone can compare; its error stops every rank (the controller ends them all).
        names = {name for name, _ in targets}
        if names != set(sources):
            raise RuntimeError(f"the meta build and the loaded model differ in names: {sorted(names ^ set(sources))[:5]}")
        differ = [f"{n}: {tuple(sources[n].shape)} {sources[n].dtype} vs {tuple(t.shape)} {t.dtype}"
                  for n, t in targets if sources[n].shape != t.shape or sources[n].dtype != t.dtype]
        if differ:
            raise RuntimeError(f"the meta build and the loaded model differ in shape or dtype: {differ[:3]}")
    with torch.no_grad():
        for name, target in targets:
            if isinstance(target, DTensor):
                full = (sources[name].to(device) if is_source
                        else torch.empty(target.shape, dtype=target.dtype, device=device))
                dist.broadcast(full, src=0)
                target.to_local().copy_(_local_chunk(full, target))
                del full
            else:
                if is_source:
                    target.copy_(sources[name])
                dist.broadcast(target, src=0)


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
