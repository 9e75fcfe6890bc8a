"""Steps 1-2 of the balanced planner, padded: contiguous runs of the sorted lengths (``_Runs``), the fewest of them,
and the step count and cut whose plan evens out the ranks."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from balance_batch.balanced.bins import _Bins
from balance_batch.balanced.ranks import _assign_ranks
from balance_batch.balanced.steps import _Grid
from balance_batch.cost import CostModel
from balance_batch.greedy import _greedy_token_budget, deal_to_ranks, length_order, sort_by_length

_PADDED_IMBALANCE = 1.005  # padded: a per-rank cost max/mean above this is worth a step more
_PADDED_RETRIES = 8  # padded: at most this many steps more than the fewest, each a whole planning pass
_PADDED_FEW_STEPS = 64  # padded: only plans of at most this many steps try other cuts and more steps
_PADDED_SEARCH = 8  # padded: the retries together use at most this many times one plan's refinement work


def fewest_padded_microbatches(lengths: Sequence[int], budget: int, max_seqs: Optional[int] = None) -> list[list[int]]:
    """Greedy ``count * longest <= budget`` (and ``count <= max_seqs``) over the globally sorted lengths: the fewest
    padded micro-batches.

    Optimal: some optimal plan holds the longest sequences together in one
    micro-batch (swapping a shorter one in never raises another's longest).
    """
    runs = _Runs(lengths, [0.0] * len(lengths), budget, max_seqs).cut(math.inf, len(lengths))
    return runs.groups()


class _Runs:
    """Contiguous runs of the lengths sorted longest first, each within the budget, the cap on sequences and a cost cap.

    A run's longest is its first sequence, so the runs that start among equal
    lengths all have the same size: runs are counted per distinct length,
    O(distinct lengths) per cut, not O(runs).
    """

    def __init__(self, lengths: Sequence[int], costs: Sequence[float], budget: int, max_seqs: Optional[int]):
        self.order, ordered = length_order(lengths)
        self.n, self.budget, self.max_seqs = len(self.order), budget, max_seqs or len(self.order)
        # blocks of equal length in the sorted order: [end position, length, cost of one]
        starts = [0, *(np.flatnonzero(np.diff(ordered)) + 1).tolist()] if self.n else []
        ends = starts[1:] + [self.n]
        self.blocks: list[list] = [[end, int(ordered[a]), costs[self.order[a]]] for a, end in zip(starts, ends)]
        self.spans: list[tuple[int, int, int]] = []  # of the last cut: (first position, run size, runs)

    def size(self, length: int, cost: float, cap: float) -> int:
        k = min(self.budget // length, self.max_seqs)
        if cap < math.inf and cost > 0:
            k = min(k, int(cap // cost))
        return max(1, k)

    def cut(self, cap: float, limit: int) -> Optional["_Runs"]:
        """Runs with ``count * cost(longest) <= cap``; None as soon as more than ``limit`` are needed."""
        spans: list[tuple[int, int, int]] = []
        p, count, b = 0, 0, 0
        while p < self.n:
            while self.blocks[b][0] <= p:
                b += 1
            end, length, cost = self.blocks[b]
            k = self.size(length, cost, cap)
            runs = -(-(end - p) // k)
            count += runs
            if count > limit:
                return None
            spans.append((p, k, runs))
            p = min(self.n, p + runs * k)
        self.spans = spans
        return self

    def costliest(self, costs: Sequence[float]) -> float:
        """The costliest run's ``count * cost(first)`` of the last cut."""
        best = 0.0
        for p, k, runs in self.spans:
            last = p + (runs - 1) * k
            best = max(
                best, min(k, self.n - last) * costs[self.order[last]], k * costs[self.order[p]] if runs > 1 else 0.0
            )
        return best

    def groups(self) -> list[list[int]]:
        order, out = self.order, []
        for p, k, runs in self.spans:
            for q in range(p, min(self.n, p + runs * k), k):
                out.append(order[q : min(self.n, q + k)])
        return out


def _padded_groups(lengths: Sequence[int], costs: Sequence[float], budget: int, n_bins: int,
                   max_seqs: Optional[int] = None) -> list[list[int]]:
    """At most ``n_bins`` contiguous runs of the sorted lengths with the smallest costliest run (bisection on the
    cap)."""
    runs = _Runs(lengths, costs, budget, max_seqs)
    lo = max(costs)  # no run can cost less than the costliest sequence alone
    # The budget alone (no cap) gives the fewest runs, no more than n_bins; its costliest run bounds the cap.
    assert runs.cut(math.inf, n_bins) is not None
    best = list(runs.spans)
    hi = max(lo, runs.costliest(costs))
    for _ in range(60):
        if hi - lo <= 1e-4 * hi:
            break
        mid = (lo + hi) / 2
        if runs.cut(mid, n_bins) is None:
            lo = mid
        else:
            hi, best = mid, list(runs.spans)
    runs.spans = best
    return runs.groups()


def _padded_attempt(lengths: Sequence[int], costs: Sequence[float], budget: int, W: int, cost_model: CostModel,
                    n_steps: int, groups: Sequence[Sequence[int]], work: int,
                    max_seqs: Optional[int] = None) -> tuple[_Bins, _Grid, list[list[int]], int]:
    """Steps 3-5 of the package's docstring for padded micro-batches ``groups`` over ``n_steps`` steps; the last item is
    the work used."""
    bins = _Bins(lengths, costs, budget, "padded", cost_model, max_seqs)
    for g in groups:
        bins.add_bin(g, presorted=True)
    grid = _Grid(bins, n_steps, W)
    left = grid.improve(work // 2) + work // 2
    slots, left = _assign_ranks(grid, left)
    return bins, grid, slots, work - left


def _padded_plan(lengths: Sequence[int], costs: Sequence[float], budget: int, W: int, cost_model: CostModel,
                 n_steps: int, n_fewest: int, work: int,
                 max_seqs: Optional[int] = None) -> tuple[_Bins, _Grid, list[list[int]]]:
    """Padded over several ranks: the fewest steps whose plan has ranks within ``_PADDED_IMBALANCE`` of each other.

    With a few micro-batches per rank (``_PADDED_FEW_STEPS`` steps or fewer),
    padded ones are too coarse to even out the ranks. Other counts of micro-batches cut the sorted lengths elsewhere,
    and more steps make them finer. So when S x W micro-batches over the fewest
    steps S leave the ranks uneven, every other count that fills those steps is
    tried (the most even within the target wins, ties: the shorter critical
    path), then one step more, and so on up to the original greedy planner's step count (no
    plan may take more). If none is within the target, the most even plan wins.
    The search stops once its attempts have used ``_PADDED_SEARCH`` times one
    plan's refinement work (each attempt also counting its n sequences), so
    many ranks over few steps, or many sequences, still plan in seconds.
    """
    greedy_steps = max(
        len(_greedy_token_budget(d, lengths, budget, max_seqs)) for d in deal_to_ranks(sort_by_length(lengths), W)
    )
    last = min(max(n_steps, greedy_steps), n_steps + _PADDED_RETRIES)
    if n_steps > _PADDED_FEW_STEPS:
        last = n_steps  # many micro-batches per rank are fine enough: what is left uneven, another cut will not fix
    best, best_key, spent = None, None, 0
    for steps in range(n_steps, last + 1):
        # S x W first (what suits the critical path best as a rule), then fewer, down to one over the last step
        counts = [steps * W, *range(steps * W - 1, max(n_fewest, (steps - 1) * W + 1) - 1, -1)]
        if n_steps > _PADDED_FEW_STEPS:
            counts = counts[:1]
        for n_bins in counts:
            if spent > _PADDED_SEARCH * work:
                break
            *attempt, used = _padded_attempt(lengths, costs, budget, W, cost_model, steps,
                                             _padded_groups(lengths, costs, budget, n_bins, max_seqs), work, max_seqs)
            spent += used + len(lengths)  # an attempt's cutting, dealing and statistics are O(n) work too
            _, grid, slots = attempt
            totals = [sum(grid.bins.cost[slots[s][r]] for s in range(grid.S)) for r in range(W)]
            mean = sum(totals) / W
            imbalance = max(totals) / mean if mean > 0 else 1.0
            # within the target, only the critical path counts; outside it, evenness first
            key = (0.0 if imbalance <= _PADDED_IMBALANCE else imbalance, grid.total())
            if best_key is None or key < best_key:
                best, best_key = attempt, key
            if n_bins == steps * W and imbalance <= _PADDED_IMBALANCE:
                break  # the usual case: the first cut is even enough
        if best_key[0] == 0.0 or spent > _PADDED_SEARCH * work:
            break
    return tuple(best)
