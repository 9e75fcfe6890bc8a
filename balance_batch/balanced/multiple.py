"""The balanced planner's padded micro-batches of a multiple of k sequences (fairseq's ``bsz_mult``): the lengths
sorted longest first are cut into the fewest such micro-batches, grouped W at a time by cost into steps, each step's
costliest to the rank with the least so far."""

from __future__ import annotations

from typing import Optional, Sequence

from balance_batch.cost import CostModel, microbatch_cost
from balance_batch.greedy import Schedule, cut_multiple_of


def multiple_of_schedules(lengths: Sequence[int], world_size: int, budget: int, max_seqs: Optional[int], k: int,
                          layout: str, cost_model: CostModel) -> list[Schedule]:
    """Per rank, micro-batches of a multiple of ``k`` sequences (``None`` where a step has fewer than W)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cost = {}
    mbs = cut_multiple_of(order, lengths, budget, max_seqs, k)
    for mb in mbs:
        cost[mb[0]] = microbatch_cost(mb, lengths, layout, cost_model)
    mbs.sort(key=lambda mb: (-cost[mb[0]], mb[0]))
    rows: list[Schedule] = [[] for _ in range(world_size)]
    load = [0.0] * world_size
    for s in range(0, len(mbs), world_size):
        free = sorted(range(world_size), key=lambda r: (load[r], r))
        step = mbs[s:s + world_size]
        for r, mb in zip(free, step):
            rows[r].append(mb)
            load[r] += cost[mb[0]]
        for r in free[len(step):]:
            rows[r].append(None)
    return rows
