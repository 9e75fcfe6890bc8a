"""Steps 3-4 of the balanced planner: micro-batches grouped into lock-step steps by cost (``_Grid``), then sequences
moved or swapped out of each step's costliest micro-batch while the sum of step maxima drops."""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple, Optional

import numpy as np

from balance_batch.balanced.bins import _Bins
from balance_batch.balanced.options import _Best, _chunks, _layout, _move, _pairs_within, _Table


class _Top(NamedTuple):
    """What a step's maximum depends on: its three costliest micro-batches (equal costs counted apart)."""

    cost: float  # the costliest micro-batch's cost: the step's maximum
    bin: int  # which one (the lowest id among equals)
    second: float  # the next costliest cost (0.0 for a step of one)
    runner: int  # a micro-batch other than ``bin`` that costs ``second`` (-1 for a step of one)
    third: float  # the third costliest cost (0.0 for a step of fewer than three)


class _Grid:
    """Micro-batches placed in S steps of W slots; the quantity to lower is the sum of step maxima.

    ``tops[s]`` is kept for every step as micro-batches change (``move``) and
    regroup, so a step's maximum, and what it becomes when two of its
    micro-batches change, is read in O(1), not recomputed over its W.
    """

    def __init__(self, bins: _Bins, n_steps: int, world: int):
        self.bins, self.S, self.W = bins, n_steps, world
        while len(bins.items) < n_steps * world:
            bins.add_bin([])
        self.step_of = [0] * len(bins.items)
        self.members: list[list[int]] = [[] for _ in range(n_steps)]
        self.tops: list[_Top] = []
        self._table: Optional[_Table] = None
        self.regroup()

    def regroup(self) -> None:
        """Sorted by cost, W at a time: for fixed micro-batches no grouping has a smaller sum of maxima."""
        b = self.bins
        # costliest first, ties by first sequence (empty last): two stable sorts with keys in C
        first = [items[0] if items else math.inf for items in b.items]
        order = sorted(sorted(range(len(b.items)), key=first.__getitem__), key=b.cost.__getitem__, reverse=True)
        for s in range(self.S):
            self.members[s] = order[s * self.W : (s + 1) * self.W]
            for j in self.members[s]:
                self.step_of[j] = s
        self.tops = [self.top(s) for s in range(self.S)]

    @property
    def table(self) -> _Table:
        """The micro-batches' rows for the searches (built on first use: a plan without refinement needs none)."""
        if self._table is None:
            self._table = _Table(self.bins)
        return self._table

    def move(self, i: int, src: int, dst: int) -> None:
        """Sequence i from micro-batch src to dst, the tops of their steps (and their table rows) kept."""
        self.bins.move(i, src, dst)
        if self._table is not None:
            self._table.stale(src)
            self._table.stale(dst)
        for s in {self.step_of[src], self.step_of[dst]}:
            self.tops[s] = self.top(s)

    def step_max(self, s: int) -> float:
        return self.tops[s].cost

    def total(self) -> float:
        return sum(top.cost for top in self.tops)

    def top(self, s: int) -> _Top:
        """Step s's three costliest micro-batches, computed (O(W))."""
        cost = self.bins.cost
        members = self.members[s]
        if len(members) == 1:
            return _Top(cost[members[0]], members[0], 0.0, -1, 0.0)
        costs = [cost[j] for j in members]
        mx = max(costs)
        j = min(j for j, c in zip(members, costs) if c == mx)
        first, runner, *third = heapq.nlargest(3, range(len(members)), key=costs.__getitem__)
        if members[runner] == j:  # j ties with the costliest listed first: the runner-up is that one
            runner = first
        return _Top(mx, j, costs[runner], members[runner], costs[third[0]] if third else 0.0)

    def improve(self, work: int) -> int:
        """Move or swap sequences out of each step's costliest micro-batch while the sum of step maxima drops.

        Candidates are every micro-batch when there are few, else those of
        nearby steps (sorted grouping has already put similar ones there).
        """
        b, W, S = self.bins, self.W, self.S
        eps = 1e-9 * max(1.0, max(b.cost, default=1.0))
        window = S if S * W <= 1024 else 2
        while work > 0:
            work -= S  # a round's bookkeeping (tops of every step, regrouping) is work too: large plans stay linear
            mean = sum(b.cost) / W
            if self.total() <= (1 + 1e-6) * mean:
                break  # every step is level: nothing left to gain
            improved = False
            excess = [self.tops[s].cost * W - sum(b.cost[j] for j in self.members[s]) for s in range(S)]
            for s in sorted(range(S), key=lambda s: (-excess[s], s)):
                if work <= 0:
                    break
                top = self.tops[s]
                if top.cost - top.second <= eps or not b.items[top.bin]:
                    continue  # a tie (or a dummy): no single change lowers this step
                best, work = self._best_change(s, range(max(0, s - window), min(S, s + window + 1)), eps, work)
                if best is not None:
                    i, i2, k = best
                    self.move(i, top.bin, k)
                    if i2 is not None:
                        self.move(i2, k, top.bin)
                    improved = True
            before = self.total()
            self.regroup()
            if self.total() < before - eps:
                improved = True
            if not improved:
                break
        return work

    def _best_change(self, s: int, steps: range, eps: float,
                     work: int) -> tuple[Optional[tuple[int, Optional[int], int]], int]:
        """The move of a sequence i out of step s's costliest micro-batch j into a micro-batch k of ``steps``, or its
        swap with a cheaper sequence i2 of k, that lowers the sum of step maxima most (by more than ``eps``).

        Returns ((i, i2 or None, k) or None, the work left). O(1) per option:
        j is the only costliest of s (``improve`` skips ties), so what else of
        s may set its maximum is its runner-up, or its third when k is the
        runner-up.
        """
        top, table = self.tops[s], self.table
        seqs = np.array(self.bins.candidates(top.bin), dtype=np.int64)
        ks = np.array([k for t in steps for k in self.members[t] if k != top.bin], dtype=np.int64)
        real = table.real(ks[None])
        per_pair = int(real.sum())
        n = _pairs_within(len(seqs), per_pair, work)
        at = np.array([self.step_of[k] for k in ks.tolist()], dtype=np.int64)
        mx = np.array([self.tops[t].cost for t in steps])[at - steps.start]  # k's step's maximum
        within = at == s
        rest = np.where(ks == top.runner, top.third, top.second)  # what else may set s's maximum
        table.fill(np.array([top.bin]))
        best = _Best(eps)  # the largest drop of the sum of maxima, above eps
        for pairs in _chunks(n, per_pair):
            _, pair, tgt, col = _layout(real, [len(pairs)])
            o = table.options(np.full(len(pair), top.bin), seqs[pair + pairs.start], ks[tgt], col)
            delta = np.where(
                within[tgt],
                np.maximum(np.maximum(o.cost_j, o.cost_k), rest[tgt]) - top.cost,
                np.maximum(o.cost_j, top.second) - top.cost + np.maximum(o.cost_k, mx[tgt]) - mx[tgt],
            )
            # a move needs room in k; a swap also room in j, and a sequence from k cheaper than i
            allowed = o.fit_k & ((col == 0) | ((table.c[o.back] < table.c[o.i]) & o.fit_j))
            best.offer(np.where(allowed, -delta, -np.inf), o)
        return None if best.found is None else _move(*best.found), work - n * per_pair
