"""Micro-batch planning over sequence lengths: pure Python, no torch.

The planner decides which examples go to which rank and which micro-batch, and
what that costs in padded tokens. Backends execute its schedules; the harness
reports its statistics; a dry run prints them without building a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Sized

# A schedule is one rank's ordered list of micro-batches. A micro-batch is a
# list of example indices into the whole request; ``None`` is a dummy entry
# that only exists so all ranks call the model the same number of times.
MicroBatch = list[int]
Schedule = list[Optional[MicroBatch]]


def sort_by_length(lengths: Sequence[int]) -> list[int]:
    """Indices ordered longest first (ties by index, so the order is stable).

    Longest first puts the largest micro-batch at the start of a pass, so a
    budget that does not fit fails on the first step rather than the last.
    """
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _greedy_token_budget(order: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[MicroBatch]:
    batches: list[MicroBatch] = []
    current: MicroBatch = []
    current_max = 0
    for idx in order:
        n = lengths[idx]
        if current and (len(current) + 1) * max(current_max, n) > max_tokens:
            batches.append(current)
            current, current_max = [], 0
        current.append(idx)
        current_max = max(current_max, n)
    if current:
        batches.append(current)
    return batches


def make_token_balanced_microbatches(
    sorted_indices: Sequence[int], all_input_ids: Sequence[Sized], max_tokens: int
) -> list[MicroBatch]:
    """Greedy token-budget micro-batches over ``sorted_indices``, in that order.

    A new micro-batch starts when the current one is non-empty and adding the
    next sequence would make ``count * longest`` exceed ``max_tokens``. A
    sequence longer than ``max_tokens`` is never dropped: it sits alone.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}")
    lengths = [len(seq) for seq in all_input_ids]
    return _greedy_token_budget(sorted_indices, lengths, max_tokens)


def make_fixed_size_microbatches(sorted_indices: Sequence[int], micro_batch_size: int) -> list[MicroBatch]:
    """Consecutive slices of ``micro_batch_size`` examples (the last may be shorter)."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size}")
    order = list(sorted_indices)
    return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


def deal_to_ranks(sorted_indices: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal the length-sorted indices to ranks like cards: rank r gets positions r, r+W, ...

    Each rank then holds a similar mix of long and short sequences, and keeps
    the sorted order, so its own micro-batches stay tight.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    order = list(sorted_indices)
    return [order[r::world_size] for r in range(world_size)]


def align_schedules(schedules: Sequence[Sequence[MicroBatch]]) -> list[Schedule]:
    """Pad every rank's schedule with ``None`` up to the longest one."""
    longest = max((len(s) for s in schedules), default=0)
    return [list(s) + [None] * (longest - len(s)) for s in schedules]


def microbatches_for_rank(
    rank_indices: Sequence[int],
    lengths: Sequence[int],
    max_tokens: Optional[int],
    micro_batch_size: int,
) -> list[MicroBatch]:
    """One rank's micro-batches: token budget when ``max_tokens`` is set, else fixed size."""
    if max_tokens is None:
        return make_fixed_size_microbatches(rank_indices, micro_batch_size)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}")
    return _greedy_token_budget(rank_indices, lengths, max_tokens)


def padded_tokens(batch: Optional[MicroBatch], lengths: Sequence[int]) -> int:
    """What a micro-batch costs once padded: size x longest (0 for a dummy entry)."""
    if not batch:
        return 0
    return len(batch) * max(lengths[i] for i in batch)


@dataclass
class PlanStats:
    """What a plan costs. Lists are per rank."""

    real_tokens: int
    padded_tokens: int
    pad_efficiency: float
    n_microbatches: list[int]
    n_dummy: list[int]
    real_tokens_per_rank: list[int]
    padded_tokens_per_rank: list[int]
    max_microbatch_padded_tokens: int
    max_microbatch_size: int

    def as_dict(self) -> dict:
        return {
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "pad_efficiency": self.pad_efficiency,
            "n_microbatches": list(self.n_microbatches),
            "n_dummy": list(self.n_dummy),
            "real_tokens_per_rank": list(self.real_tokens_per_rank),
            "padded_tokens_per_rank": list(self.padded_tokens_per_rank),
            "max_microbatch_padded_tokens": self.max_microbatch_padded_tokens,
            "max_microbatch_size": self.max_microbatch_size,
        }


def plan_stats(schedules: Sequence[Schedule], lengths: Sequence[int]) -> PlanStats:
    """Statistics of per-rank schedules (``None`` entries count as dummies)."""
    real_per_rank, padded_per_rank, n_mb, n_dummy = [], [], [], []
    max_padded, max_size = 0, 0
    for schedule in schedules:
        real = padded = mb = dummy = 0
        for batch in schedule:
            if batch is None:
                dummy += 1
                continue
            mb += 1
            real += sum(lengths[i] for i in batch)
            cost = padded_tokens(batch, lengths)
            padded += cost
            max_padded = max(max_padded, cost)
            max_size = max(max_size, len(batch))
        real_per_rank.append(real)
        padded_per_rank.append(padded)
        n_mb.append(mb)
        n_dummy.append(dummy)
    real_total, padded_total = sum(real_per_rank), sum(padded_per_rank)
    return PlanStats(
        real_tokens=real_total,
        padded_tokens=padded_total,
        pad_efficiency=(real_total / padded_total) if padded_total else 1.0,
        n_microbatches=n_mb,
        n_dummy=n_dummy,
        real_tokens_per_rank=real_per_rank,
        padded_tokens_per_rank=padded_per_rank,
        max_microbatch_padded_tokens=max_padded,
        max_microbatch_size=max_size,
    )


@dataclass
class Plan:
    """Per-rank schedules for one pass and what they cost."""

    schedules: list[Schedule]
    stats: PlanStats = field(repr=False)
    max_tokens_per_microbatch: Optional[int] = None
    micro_batch_size: int = 1


def plan_batch(
    lengths: Sequence[int],
    world_size: int = 1,
    max_tokens_per_microbatch: Optional[int] = None,
    micro_batch_size: int = 1,
    align: bool = False,
) -> Plan:
    """Sort, deal to ranks, form micro-batches, and (for lock-step backends) align.

    ``align=True`` is for backends whose ranks must call the model the same
    number of times (FSDP): shorter schedules are padded with ``None``. The
    FSDP backend agrees on the count with a collective; computing it here from
    the same inputs gives the same answer, which is what a dry run reports.
    """
    order = sort_by_length(lengths)
    per_rank = [
        microbatches_for_rank(indices, lengths, max_tokens_per_microbatch, micro_batch_size)
        for indices in deal_to_ranks(order, world_size)
    ]
    schedules: list[Schedule] = align_schedules(per_rank) if align else [list(s) for s in per_rank]
    return Plan(
        schedules=schedules,
        stats=plan_stats(schedules, lengths),
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        micro_batch_size=micro_batch_size,
    )
