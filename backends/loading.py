"""Loading a model sharded: FSDP2 builds it on meta, shards it, then fills each rank's shards from rank 0's copy."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

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

    Parameters and persistent buffers go through torch's full-state-dict
    loading with broadcast from rank 0, which distributes each full tensor to
    the ranks' shards. Buffers that are not in a state dict (Qwen3.5's rotary
    ``inv_freq`` and ``original_inv_freq`` are non-persistent) would be left
    uninitialised by ``to_empty``: they are copied from rank 0 too, so they hold
    exactly what an unsharded build computes rather than a recomputation.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    is_source = dist.get_rank() == 0
    if is_source and source is None:
        raise ValueError("rank 0 must pass the model to load from")
    model.to_empty(device=device)
    full = source.state_dict() if is_source else {}
    if is_source:  # the broadcast would cast silently: a dtype the meta build got differently is a bug to see
        local = model.state_dict()
        differ = [f"{k}: {v.dtype} vs {local[k].dtype}" for k, v in full.items() if k in local and v.dtype != local[k].dtype]
        if differ:
            raise RuntimeError(f"the meta build and rank 0's loaded model differ in dtype: {differ[:3]}")
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )
    del full
    source_buffers = dict(source.named_buffers()) if is_source else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if is_source:
                buffer.copy_(source_buffers[name])
            dist.broadcast(buffer, src=0)


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
