"""The world size and rank a sampler plans for: given, or the initialised ``torch.distributed`` process group's (as
PyTorch's ``DistributedSampler`` takes them), never a silent single-rank default under a multi-process launch.

No torch import: a process group can only be initialised where ``torch.distributed`` is already imported.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import numpy as np

from balance_batch.errors import positive_int


def _group(process_group: Any) -> Optional[tuple[int, int]]:
    """(world size, rank) of ``process_group`` (None: the default group) when torch.distributed is initialised."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size(process_group), dist.get_rank(process_group)


def resolve_world(world_size: Any, rank: Any, process_group: Any = None, who: str = "TokenBudgetSampler"
                  ) -> tuple[int, int]:
    """(world_size, rank): each left out comes from the initialised process group (``process_group``, default the
    whole job); given, they must agree with it. With no group: (1, 0), unless the launcher says there are several
    processes (``WORLD_SIZE`` > 1, as torchrun sets it), where a silent (1, 0) would give every process the same data.
    """
    world_size = positive_int("world_size", world_size, none_ok=True, who=who)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, (int, np.integer))):
        raise ValueError(f"{who}: rank must be an integer, got {rank!r}")
    rank = None if rank is None else int(rank)
    group = _group(process_group)
    if group is None and process_group is not None:
        raise ValueError(f"{who}: process_group was given but torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group() first")
    if group is not None:
        size, me = group
        world_size = size if world_size is None else world_size
        rank = me if rank is None else rank
        if (world_size, rank) != (size, me):
            raise ValueError(f"{who}: world_size={world_size}, rank={rank} contradict the initialised process group "
                             f"(world size {size}, rank {me}); leave them out to take the group's, or pass "
                             "process_group= the (data-parallel) group they describe")
        return world_size, rank
    launched = os.environ.get("WORLD_SIZE", "1")
    if world_size is None and rank is None and launched.isdigit() and int(launched) > 1:
        raise ValueError(f"{who}: this process was launched as one of WORLD_SIZE={launched} (torchrun?) but "
                         "torch.distributed is not initialised, so every process would plan as rank 0 of 1: call "
                         "torch.distributed.init_process_group() before building it, or pass world_size= and rank=")
    world_size = 1 if world_size is None else world_size
    if rank is None:
        if world_size > 1:
            raise ValueError(f"{who}: rank= is needed with world_size={world_size} when no torch.distributed process "
                             "group is initialised (each process passes its own)")
        rank = 0
    if not 0 <= rank < world_size:
        raise ValueError(f"{who}: rank must be an integer in [0, world_size={world_size}), got {rank!r}")
    return world_size, rank
