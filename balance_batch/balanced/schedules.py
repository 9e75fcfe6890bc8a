"""The balanced planner itself: per rank, the micro-batch of every step, from the packed or padded micro-batches, their
steps and their ranks (see the package's docstring for the steps)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from balance_batch.balanced.packed import _packed_groups
from balance_batch.balanced.padded import _padded_attempt, _padded_plan, fewest_padded_microbatches
from balance_batch.balanced.ranks import _assign_ranks
from balance_batch.balanced.steps import _Grid
from balance_batch.cost import CostModel
from balance_batch.greedy import Schedule, sort_by_length

# Bounds on refinement work (candidate evaluations), so huge inputs still plan in seconds.
_WORK_PER_ITEM = 400
_MIN_WORK = 400_000
_MAX_WORK = 400_000


def _sequence_order(lengths: Sequence[int], costs: Sequence[float], a: float, b: float) -> list[int]:
    """Costliest first, ties longest then by index. With a, b >= 0 cost grows with length: a sort by length in C."""
    if a >= 0 and b >= 0:
        return sort_by_length(lengths)
    return sorted(range(len(lengths)), key=lambda i: (-costs[i], -lengths[i], i))


def balanced_schedules(
    lengths: Sequence[int], world_size: int, budget: int, layout: str, cost_model: CostModel,
    max_seqs: Optional[int] = None, work: Optional[int] = None,
) -> list[Schedule]:
    """Per rank, S micro-batches (``None`` for an empty slot): see the package's docstring.

    ``max_seqs`` caps the sequences of a micro-batch (None: no cap). ``work`` bounds the refinement (steps 4-5) in
    candidate evaluations; None: the bounds above; 0: none (what a sampler planning every optimizer step uses).
    """
    n, W, budget = len(lengths), world_size, budget
    if n == 0:
        return [[] for _ in range(W)]
    seq_cost = {x: cost_model.sequence(x) for x in set(lengths)}
    costs = list(map(seq_cost.__getitem__, lengths))
    if work is None:
        work = min(_MAX_WORK, max(_MIN_WORK, _WORK_PER_ITEM * n))
    order = _sequence_order(lengths, costs, cost_model.a, cost_model.b)
    if layout == "packed":
        bins, n_steps = _packed_groups(order, lengths, costs, budget, W, cost_model, max_seqs, seq_cost)
        grid = _Grid(bins, n_steps, W)
        if W > 1:  # one rank has nothing to even out: its steps are its micro-batches, costliest first
            work = grid.improve(work // 2) + work // 2
        slots, _ = _assign_ranks(grid, work)
    else:
        fewest = fewest_padded_microbatches(lengths, budget, max_seqs)
        n_steps = math.ceil(len(fewest) / W)
        if W == 1:  # one rank has nothing to balance: the fewest micro-batches, filled greedily, pad least
            bins, grid, slots, _ = _padded_attempt(lengths, costs, budget, W, cost_model, n_steps, fewest, work,
                                                   max_seqs)
        else:
            bins, grid, slots = _padded_plan(lengths, costs, budget, W, cost_model, n_steps, len(fewest), work,
                                             max_seqs)
    maxima = [grid.step_max(s) for s in range(grid.S)]
    step_order = sorted(range(grid.S), key=maxima.__getitem__, reverse=True)  # costliest first, ties by step
    items = bins.items  # handed over as they are: the bins are not used after this
    if W == 1:
        return [[items[slots[s][0]] or None for s in step_order if items[slots[s][0]]]]
    schedules: list[Schedule] = [[] for _ in range(W)]
    for s in step_order:
        row = [items[j] for j in slots[s]]
        if not any(row):
            continue  # a step with nothing to run (more steps than micro-batches need) is left out
        for r in range(W):
            schedules[r].append(row[r] or None)
    return schedules
