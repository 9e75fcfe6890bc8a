"""Step 5 of the balanced planner: which rank runs which micro-batch of each step, the per-rank totals as even as the
steps allow (swaps within steps, then sequences moved between ranks, never past a step's maximum)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from balance_batch.balanced.bins import _CANDIDATES
from balance_batch.balanced.options import _CHUNK, _Best, _layout, _move, _Options, _pairs_within
from balance_batch.balanced.steps import _Grid

_MIN_CALL = 50_000  # evaluations one search for a transfer between two ranks may always use
_OVERRUN = 200_000  # the last round of transfers may finish its searches this far past the budget


def _assign_ranks(grid: _Grid, work: int) -> tuple[list[list[int]], int]:
    """Per step, which rank runs which micro-batch: rank totals as even as the steps allow.

    Returns ``slots[s][r]`` = micro-batch id, and the work left. Swapping micro-batches within a
    step never changes the step's maximum, so this cannot lengthen the critical path.
    """
    if grid.W == 1:
        return [list(grid.members[s]) for s in range(grid.S)], work
    slots, totals = _deal(grid)
    tol = 1e-5 * sum(totals) / grid.W  # closer than this is level
    work, level = _swap_within_steps(grid, slots, totals, tol, work)
    if level:
        return slots, work
    return slots, _transfer_sequences(grid, slots, totals, tol, work)


def _deal(grid: _Grid) -> tuple[list[list[int]], list[float]]:
    """Steps in order of their spread, each step's costliest micro-batch to the least loaded rank: (slots, totals)."""
    b, W, S = grid.bins, grid.W, grid.S
    totals = [0.0] * W
    slots: list[list[int]] = [[-1] * W for _ in range(S)]

    def spread(s: int) -> float:
        costs = [b.cost[j] for j in grid.members[s]]
        return max(costs) - min(costs)

    for s in sorted(range(S), key=lambda s: (-spread(s), s)):
        ranks = sorted(range(W), key=totals.__getitem__)  # stable: ties by rank
        for r, j in zip(ranks, sorted(sorted(grid.members[s]), key=b.cost.__getitem__, reverse=True)):
            slots[s][r] = j
            totals[r] += b.cost[j]
    return slots, totals


def _swap_within_steps(grid: _Grid, slots: list[list[int]], totals: list[float], tol: float,
                       work: int) -> tuple[int, bool]:
    """Swaps within steps between the busiest rank and another one: (work left, whether the ranks are level)."""
    cost, W, S = grid.bins.cost, grid.W, grid.S
    while work > 0:
        hi = max(range(W), key=lambda r: (totals[r], -r))
        if totals[hi] - min(totals) <= tol:
            return work, True
        gain_best, best = tol, None
        for lo in range(W):
            gap = totals[hi] - totals[lo]
            if gap <= tol:
                continue
            work -= S
            for s in range(S):
                d = cost[slots[s][hi]] - cost[slots[s][lo]]
                if 0 < d < gap:
                    gain = min(d, gap - d)  # the pair's larger total drops by this much
                    if gain > gain_best:
                        gain_best, best = gain, (s, lo, d)
        if best is None:
            break
        s, lo, d = best
        slots[s][hi], slots[s][lo] = slots[s][lo], slots[s][hi]
        totals[hi] -= d
        totals[lo] += d
    return work, False


def _transfer_sequences(grid: _Grid, slots: list[list[int]], totals: list[float], tol: float, work: int) -> int:
    """Sequences moved (or swapped) from the busiest rank to another, never past a step's maximum: the work left."""
    maxima = [grid.step_max(s) for s in range(grid.S)]
    while work > 0:
        hi = max(range(grid.W), key=lambda r: (totals[r], -r))
        best, work = _best_transfer(grid, slots, maxima, totals, hi, tol, work)
        if best is None:
            break
        lo, i, i2, s, t, d_hi, d_lo = best
        j, k = slots[s][hi], slots[t][lo]
        grid.move(i, j, k)
        if i2 is not None:
            grid.move(i2, k, j)
        totals[hi] += d_hi
        totals[lo] += d_lo
        for u in {s, t}:
            maxima[u] = grid.step_max(u)
    return work


def _best_transfer(grid: _Grid, slots: list[list[int]], maxima: list[float], totals: list[float], hi: int,
                   tol: float, work: int) -> tuple[Optional[tuple], int]:
    """The move (or swap) of a sequence from rank ``hi`` to another rank that lowers the larger of their totals most
    (by more than ``tol``), the least loaded ranks searched first.

    Returns ((lo, i, i2 or None, step of i, step of the target, change of hi, change of lo) or None, the work left).
    No micro-batch grows past its step's maximum or the budget. Each rank's
    search stops after about max(work left, ``_MIN_CALL``) evaluations, and
    no rank is searched once the work is ``_OVERRUN`` past the budget. Where
    all pairs of steps would cost more than that, the likeliest ones come
    first (with many steps, only they are looked at); else every rank's
    search has the same pairs over every step, and ranks are evaluated
    together (``_Search``).
    """
    b, S = grid.bins, grid.S
    # one floor for every rank: the first rank whose best (above 0) beats tol holds the first best above tol
    search = _Search(grid, slots, maxima, totals, hi, tol)
    wide = min(_CANDIDATES, 1 + len(b.items[slots[0][hi]])) ** 2  # as the search always estimated it
    for lo in sorted(range(grid.W), key=lambda r: (totals[r], r)):
        if totals[hi] - totals[lo] <= tol or work <= -_OVERRUN:
            break
        budget = max(work, _MIN_CALL)
        if S > 256 or S * S * wide > budget:  # look first (with many steps, only) where a transfer is likeliest to help
            keep = 16 if S > 256 else S
            sources = sorted(range(S), key=lambda s: (b.cost[slots[s][lo]] - b.cost[slots[s][hi]], s))[:keep]
            targets = sorted(range(S), key=lambda t: (b.cost[slots[t][lo]] - maxima[t], t))[:keep]
            work -= search.alone(lo, sources, targets, budget)
        else:
            work -= search.together(lo, budget)
    search.flush()
    if search.best.found is None:
        return None, work
    (o, s, t, lo), at = search.best.found
    i, i2, _ = _move(o, at)
    cost = grid.table.cost
    d_hi, d_lo = float(o.cost_j[at] - cost[o.j[at]]), float(o.cost_k[at] - cost[o.k[at]])
    return (int(lo[at]), i, i2, int(s[at]), int(t[at]), d_hi, d_lo), work


class _Search:
    """The options of transfers from rank ``hi`` to other ranks, evaluated a group of ranks at a time, the best kept.

    A group's ranks share their pairs (j, i) and the steps of their targets:
    every rank searched with every step (``together``, evaluated once enough
    options have gathered), or one rank with the steps most likely to help
    (``alone``, evaluated at once).
    """

    def __init__(self, grid: _Grid, slots: list[list[int]], maxima: list[float], totals: list[float], hi: int,
                 tol: float):
        self.grid, self.table, self.slots, self.hi = grid, grid.table, slots, hi
        self.cap, self.totals = np.array(maxima), np.array(totals)
        self.grid_slots = np.array(slots, dtype=np.int64).reshape(grid.S, grid.W)
        self.best = _Best(tol)
        self.every_step: Optional[tuple[np.ndarray, ...]] = None  # hi's pairs over every step, once needed
        self.per_rank: Optional[np.ndarray] = None  # what a pair over every step costs, per rank
        self.group: list[tuple[int, int]] = []  # ranks gathered for ``together``, and the pairs each takes
        self.size = 0

    def together(self, lo: int, budget: int) -> int:
        """Rank lo over every step, gathered: the evaluations its search counts for."""
        if self.every_step is None:
            self.every_step = self.pairs(range(self.grid.S))
            self.per_rank = self.table.real(self.grid_slots).sum(axis=(0, 2))
        per_pair = int(self.per_rank[lo])
        n = _pairs_within(len(self.every_step[0]), per_pair, budget)
        self.group.append((lo, n))
        self.size += n * per_pair
        if self.size >= _CHUNK:
            self.flush()
        return n * per_pair

    def alone(self, lo: int, sources: list[int], targets: list[int], budget: int) -> int:
        """Rank lo, pairs from steps ``sources`` over steps ``targets``, evaluated: the evaluations it counts for."""
        self.flush()  # the ranks before it first
        pairs = self.pairs(sources)
        steps = np.array(targets, dtype=np.int64)
        ks = self.grid_slots[steps, lo][None]
        per_pair = int(self.table.real(ks).sum())
        n = _pairs_within(len(pairs[0]), per_pair, budget)
        self.evaluate(pairs, np.array([lo]), ks, steps, [n])
        return n * per_pair

    def flush(self) -> None:
        """The ranks gathered by ``together``, evaluated."""
        if self.group:
            los = np.array([lo for lo, _ in self.group], dtype=np.int64)
            steps = np.arange(self.grid.S)
            self.evaluate(self.every_step, los, self.grid_slots[:, los].T, steps, [n for _, n in self.group])
            self.group, self.size = [], 0

    def pairs(self, sources) -> tuple[np.ndarray, ...]:
        """(j, i, step of j) of every sequence i of rank hi's micro-batches j in steps ``sources`` worth moving."""
        js, seqs, steps = [], [], []
        for s in sources:
            j = self.slots[s][self.hi]
            for i in self.grid.bins.candidates(j):
                js.append(j)
                seqs.append(i)
                steps.append(s)
        self.table.fill(np.array(js, dtype=np.int64))
        return tuple(np.array(x, dtype=np.int64) for x in (js, seqs, steps))

    def evaluate(self, pairs: tuple[np.ndarray, ...], los: np.ndarray, ks: np.ndarray, steps: np.ndarray,
                 n_pairs: list[int]) -> None:
        """Ranks ``los``: the first ``n_pairs[g]`` of ``pairs`` over targets ``ks[g]`` (micro-batches of steps
        ``steps``), offered to ``best``."""
        js, seqs, sources = pairs
        group, pair, target, column = _layout(self.table.real(ks), n_pairs)
        o: _Options = self.table.options(js[pair], seqs[pair], ks[group, target], column)
        s, t, lo = sources[pair], steps[target], los[group]
        allowed = o.fit_k & (o.cost_k <= self.cap[t]) & o.fit_j & (o.cost_j <= self.cap[s])
        d_hi, d_lo = o.cost_j - self.table.cost[o.j], o.cost_k - self.table.cost[o.k]
        high = self.totals[self.hi]
        gains = high - np.maximum(high + d_hi, self.totals[lo] + d_lo)
        self.best.offer(np.where(allowed, gains, -np.inf), (o, s, t, lo))
