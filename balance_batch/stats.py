"""What a plan costs: tokens, padding, lock-step steps against their lower bound, modeled cost per rank."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from balance_batch.cost import CostModel
from balance_batch.greedy import MicroBatch, Schedule


def lower_bound_bins(lengths: Sequence[int], budget: Optional[int], micro_batch_size: int = 1,
                     max_seqs: Optional[int] = None) -> int:
    """The fewest micro-batches any plan can have.

    With a budget B: every sequence longer than B sits alone, and the rest
    need at least (their sum / B) micro-batches; no two of those longer than
    B/2 can share one; and none holds more sequences than the shortest ones
    that fit in B together, nor more than ``max_seqs``. Without a budget:
    ``micro_batch_size`` sequences each (no more than ``max_seqs``).
    """
    if not len(lengths):
        return 0
    if budget is None:
        return math.ceil(len(lengths) / min(micro_batch_size, max_seqs or micro_batch_size))
    arr = np.asarray(lengths, dtype=np.int64)
    rest = arr[arr <= budget]
    n_over = len(arr) - len(rest)
    if not len(rest) or int(rest.max()) <= 8 * len(rest) + 65_536:  # a count per token value: O(n) memory and time
        return lower_bound_from_histogram(np.bincount(rest), budget, n_over, max_seqs)
    # longer ones: the distinct lengths by a sort, so time and memory follow n, not the longest length
    distinct, counts = np.unique(rest, return_counts=True)
    return _lower_bound_distinct(distinct, counts, budget, n_over, max_seqs)


def lower_bound_from_histogram(hist: np.ndarray, budget: int, n_over: int = 0, max_seqs: Optional[int] = None
                               ) -> int:
    """``lower_bound_bins`` with a budget, from ``hist`` (how many sequences have each length, all within
    ``max_tokens``) and ``n_over`` sequences longer than it: the work is per distinct length, not per sequence."""
    lengths = np.flatnonzero(hist)
    return _lower_bound_distinct(lengths, hist[lengths], budget, n_over, max_seqs)


def _lower_bound_distinct(lengths: np.ndarray, counts: np.ndarray, budget: int, n_over: int,
                          max_seqs: Optional[int]) -> int:
    """``lower_bound_bins`` from the distinct ``lengths`` within ``max_tokens`` (ascending) and how many sequences
    have each (``counts``), with ``n_over`` sequences longer than the budget."""
    if not len(lengths):
        return n_over
    counts = counts.astype(np.int64)
    tokens = lengths * counts
    # the most sequences one micro-batch can hold: the shortest ones, while their sum fits
    before = np.cumsum(tokens) - tokens  # tokens of all shorter sequences
    take = np.minimum(counts, np.maximum(0, (budget - before) // lengths))
    first_partial = int(np.searchsorted(take < counts, True))  # from the first length that no longer fits whole
    most = max(1, int(take[: first_partial + 1].sum()))
    if max_seqs:
        most = min(most, max_seqs)
    halves = int(counts[2 * lengths > budget].sum())
    return n_over + max(-(-int(tokens.sum()) // budget), halves, -(-int(counts.sum()) // most))


def lower_bound_steps(
    lengths: Sequence[int], world_size: int, budget: Optional[int], micro_batch_size: int = 1,
    max_seqs: Optional[int] = None,
) -> int:
    """The fewest lock-step steps any plan can have: the fewest micro-batches spread over ``world_size`` ranks."""
    return math.ceil(lower_bound_bins(lengths, budget, micro_batch_size, max_seqs) / world_size)


def critical_path_lower_bound(
    lengths: Sequence[int], world_size: int, budget: int, cost_model: Optional[CostModel] = None
) -> float:
    """No packed lock-step plan has a shorter critical path (sum of step maxima / mean per-rank cost).

    Sequences longer than the budget sit alone and cost more than any
    micro-batch within it (cost is convex), so the k-th costliest step costs
    at least the (k·W)-th costliest of them (the k-1 costlier steps hold at
    most (k-1)·W). The remaining steps cost at least their mean share of
    what is left, where the free slots of those first steps hold at most
    cost(budget) each. Tight when over-long sequences dominate the budget.
    """
    cost_model = cost_model or CostModel.tokens()
    costs = [cost_model.sequence(n) for n in lengths]
    total = sum(costs)
    if total <= 0:
        return 1.0
    lone = sorted((c for n, c in zip(lengths, costs) if n > budget), reverse=True)
    leaders = lone[::world_size]  # the costliest over-long sequence of each of the first steps
    free_slots = len(leaders) * world_size - len(lone)
    rest = max(0.0, total - sum(lone) - free_slots * cost_model.sequence(budget))
    return (sum(leaders) + rest / world_size) / (total / world_size)


@dataclass
class PlanStats:
    """What a plan costs. Lists are per rank.

    For the packed layout "padded" tokens are the tokens computed, which are the
    real tokens: pad efficiency is 1.
    """

    real_tokens: int
    padded_tokens: int
    pad_efficiency: float
    n_microbatches: list[int]
    n_dummy: list[int]
    real_tokens_per_rank: list[int]
    padded_tokens_per_rank: list[int]
    max_microbatch_padded_tokens: int
    max_microbatch_size: int
    layout: str = "padded"
    planner: str = "greedy"
    steps: int = 0  # the longest schedule, dummies included (lock-step: every rank's)
    lower_bound_steps: int = 0
    over_budget: int = 0  # micro-batches above the budget (only a lone sequence longer than it may be)
    cost_per_rank: list[float] = field(default_factory=list)
    cost_imbalance: float = 1.0  # max / mean modeled cost per rank
    critical_path: float = 1.0  # lock-step: sum over steps of the costliest rank's micro-batch / mean; else = imbalance
    cost_model: dict = field(default_factory=lambda: CostModel.tokens().as_dict())
    # per rank, the modeled share of the pass it waits: 1 - its cost / the pass's (Σ step maxima lock-step, else
    # the busiest rank's); the measured one is passes.<type>.idle_fraction (harness/balance.py)
    idle_fraction: list[float] = field(default_factory=list)

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
            "layout": self.layout,
            "planner": self.planner,
            "steps": self.steps,
            "lower_bound_steps": self.lower_bound_steps,
            "over_budget": self.over_budget,
            "cost_per_rank": list(self.cost_per_rank),
            "cost_imbalance": self.cost_imbalance,
            "critical_path": self.critical_path,
            "cost_model": dict(self.cost_model),
            "idle_fraction": list(self.idle_fraction),
        }


def plan_stats(
    schedules: Sequence[Schedule],
    lengths: Sequence[int],
    layout: str = "padded",
    cost_model: Optional[CostModel] = None,
    budget: Optional[int] = None,
    micro_batch_size: int = 1,
    lockstep: bool = False,
    planner: str = "greedy",
    max_seqs: Optional[int] = None,
) -> PlanStats:
    """Statistics of per-rank schedules (``None`` entries count as dummies).

    ``lockstep`` says step s of every rank runs together (FSDP2): the critical
    path is then the sum over steps of the costliest rank's micro-batch; ranks
    that run independently wait only for the busiest rank (max / mean).
    Vectorised over the sequences (each distinct length's cost computed once).
    """
    cost_model = cost_model or CostModel.tokens()
    ranks = _rank_totals(schedules, lengths, layout == "packed", cost_model, budget)
    real_total, padded_total = sum(ranks.real), sum(ranks.padded)
    world = max(1, len(schedules))
    imbalance, critical, idle = _waiting(ranks.step_costs, ranks.cost, world, lockstep)
    return PlanStats(
        real_tokens=real_total,
        padded_tokens=padded_total,
        pad_efficiency=(real_total / padded_total) if padded_total else 1.0,
        n_microbatches=ranks.microbatches,
        n_dummy=ranks.dummies,
        real_tokens_per_rank=ranks.real,
        padded_tokens_per_rank=ranks.padded,
        max_microbatch_padded_tokens=ranks.max_padded,
        max_microbatch_size=ranks.max_size,
        layout=layout,
        planner=planner,
        steps=ranks.step_costs.shape[1],
        lower_bound_steps=lower_bound_steps(lengths, world, budget, micro_batch_size, max_seqs),
        over_budget=ranks.over_budget,
        cost_per_rank=ranks.cost,
        cost_imbalance=imbalance,
        critical_path=critical,
        cost_model=cost_model.as_dict(),
        idle_fraction=idle,
    )


@dataclass
class _RankTotals:
    """Per rank: real and computed tokens, micro-batches, dummies and modeled cost; the rank x step cost table (0 for
    a dummy); and over all ranks the largest micro-batch and how many micro-batches exceed the budget."""

    step_costs: np.ndarray
    real: list[int] = field(default_factory=list)
    padded: list[int] = field(default_factory=list)
    microbatches: list[int] = field(default_factory=list)
    dummies: list[int] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    max_padded: int = 0
    max_size: int = 0
    over_budget: int = 0


def _rank_totals(schedules: Sequence[Schedule], lengths: Sequence[int], packed: bool, cost_model: CostModel,
                 budget: Optional[int]) -> _RankTotals:
    """Each rank's schedule summed up (``_RankTotals``), each distinct length's cost computed once."""
    L = np.asarray(lengths, dtype=np.int64)
    uniq, inv = np.unique(L, return_inverse=True)
    ucost = np.array([cost_model.sequence(int(n)) for n in uniq], dtype=np.float64)
    totals = _RankTotals(step_costs=np.zeros((len(schedules), max((len(s) for s in schedules), default=0))))
    for r, schedule in enumerate(schedules):
        at = [k for k, batch in enumerate(schedule) if batch]
        totals.microbatches.append(sum(1 for batch in schedule if batch is not None))
        totals.dummies.append(len(schedule) - totals.microbatches[-1])
        if not at:
            totals.real.append(0)
            totals.padded.append(0)
            totals.cost.append(0.0)
            continue
        sizes, real, tokens, costs = _microbatch_values([schedule[k] for k in at], L, uniq, inv, ucost, packed,
                                                        cost_model)
        totals.step_costs[r, at] = costs
        totals.real.append(int(real.sum()))
        totals.padded.append(int(tokens.sum()))
        totals.cost.append(float(costs.sum()))
        totals.max_padded = max(totals.max_padded, int(tokens.max()))
        totals.max_size = max(totals.max_size, int(sizes.max()))
        if budget is not None:
            totals.over_budget += int(np.count_nonzero(tokens > budget))
    return totals


def _microbatch_values(batches: Sequence[MicroBatch], L: np.ndarray, uniq: np.ndarray, inv: np.ndarray,
                       ucost: np.ndarray, packed: bool, cost_model: CostModel):
    """Per micro-batch of one rank (none empty): sizes, real tokens, computed tokens and modeled cost, as arrays.

    ``uniq``/``inv``/``ucost``: the distinct lengths, each sequence's index among them, and each one's cost.
    """
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    flat = np.fromiter(itertools.chain.from_iterable(batches), dtype=np.int64, count=int(sizes.sum()))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    lens = L[flat]
    real = np.add.reduceat(lens, starts)
    if packed:
        tokens, costs = real, np.add.reduceat(ucost[inv[flat]], starts)
    else:
        longest = np.maximum.reduceat(lens, starts)
        tokens, costs = sizes * longest, sizes * ucost[np.searchsorted(uniq, longest)]
    if cost_model.fixed:
        costs = costs + cost_model.fixed  # a calibrated model's cost of any micro-batch (0 for FLOPs)
    return sizes, real, tokens, costs


def _waiting(step_costs: np.ndarray, cost_per_rank: list[float], world: int,
             lockstep: bool) -> tuple[float, float, list[float]]:
    """(cost imbalance, critical path, per-rank idle fraction) of per-rank costs and the rank x step cost table."""
    mean_cost = sum(cost_per_rank) / world
    imbalance = max(cost_per_rank) / mean_cost if mean_cost > 0 else 1.0
    if lockstep and mean_cost > 0:
        makespan = float(step_costs.max(axis=0).sum())
        critical = makespan / mean_cost
    else:
        makespan = max(cost_per_rank, default=0.0)
        critical = imbalance
    idle = [round(1.0 - c / makespan, 4) if makespan > 0 else 0.0 for c in cost_per_rank]
    return imbalance, critical, idle
