"""NeMo Automodel's ``DynamicTokenBatchSampler`` (its pull request of 2026-08-10), written here from its published
algorithm.

Every rank plans the same global list: the indices shuffled with ``seed + epoch``, sorted longest first inside
windows of ``sort_window`` samples, then cut greedily while count × longest stays within the padded-token budget
(and the count within ``max_batch_size``). A sequence over the budget becomes a batch of its own (a warning, not a
refusal). Rank r takes batches r, r+W, ... of the first whole rounds; the peer drops the remainder (len % W batches)
so the ranks agree on a count; the harness runs them, a short rank a dummy step (recorded in ``differs``).
The shuffle is numpy's (the planner has no torch): the same algorithm, not torch.randperm's draw. Rows are padded.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from harness.peers.common import PeerPlan, budget_of

NAME = "automodel"
LAYOUT = "padded"
SOURCE = ("NVIDIA-NeMo/Automodel nemo_automodel/components/datasets/llm/dynamic_token_batch_sampler.py, as proposed "
          "in https://github.com/NVIDIA-NeMo/Automodel/pull/3473 (opened 2026-08-10)")


def token_budget_batches(order: Sequence[int], lengths: Sequence[int], budget: int,
                         max_batch_size: Optional[int] = None) -> list[list[int]]:
    """Greedy over ``order``: a new batch when count × longest would pass ``budget`` or the count ``max_batch_size``."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        top = max(longest, lengths[i])
        full = (len(current) + 1) * top > budget or (max_batch_size is not None and len(current) >= max_batch_size)
        if current and full:
            batches.append(current)
            current, longest = [i], lengths[i]
        else:
            current.append(i)
            longest = top
    if current:
        batches.append(current)
    return batches


def plan(lengths: Sequence[int], world_size: int, budget: Optional[int], max_batch_size: Optional[int] = None,
         sort_window: int = 2048, seed: int = 42, epoch: int = 0) -> PeerPlan:
    """Automodel's plan of ``lengths`` for ``world_size`` ranks with ``max_tokens_per_batch = budget``."""
    budget = budget_of(NAME, budget)
    order = np.random.RandomState(seed + epoch).permutation(len(lengths)).tolist()
    if sort_window > 1:
        windows = [sorted(order[s:s + sort_window], key=lengths.__getitem__, reverse=True)
                   for s in range(0, len(order), sort_window)]
        order = [i for w in windows for i in w]
    batches = token_budget_batches(order, lengths, budget, max_batch_size)
    whole = len(batches) // world_size * world_size
    grid = [list(batches[r:whole:world_size]) for r in range(world_size)]
    for r, batch in enumerate(batches[whole:]):
        grid[r].append(batch)
    knobs = {"max_tokens_per_batch": budget, "max_batch_size": max_batch_size, "sort_window": sort_window,
             "seed": seed, "epoch": epoch}
    differs = ["the shuffle is numpy's RandomState(seed + epoch), not torch.randperm's (same algorithm)"]
    if whole < len(batches):
        differs.append(f"the peer drops the last {len(batches) - whole} of {len(batches)} batches so every rank runs "
                       f"{whole // world_size}; the harness runs them")
    return PeerPlan(grid, knobs, "the same global list on every rank, batch i on rank i mod W", differs)
