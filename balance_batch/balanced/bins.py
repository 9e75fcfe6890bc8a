"""The balanced planner's micro-batches under construction (``_Bins``): what each holds, its tokens and modeled cost,
and which of its sequences are worth moving (what a move or swap would make of them: ``options``)."""

from __future__ import annotations

import bisect
import math
from typing import Optional, Sequence

from balance_batch.cost import CostModel

_CANDIDATES = 24  # sequences of one micro-batch considered for a move or swap


class _Bins:
    """Micro-batches under construction: items (longest first), computed tokens and modeled cost of each.

    ``costs[i]`` is the cost model's cost of ``lengths[i]`` (a padded micro-batch costs its count times its longest's).
    """

    def __init__(self, lengths: Sequence[int], costs: Sequence[float], budget: int, layout: str, cost_model: CostModel,
                 max_seqs: Optional[int] = None):
        self.L, self.c, self.budget, self.packed, self.cm = lengths, costs, budget, layout == "packed", cost_model
        self.cap = max_seqs or math.inf  # sequences per micro-batch
        self.items: list[list[int]] = []
        self.tok: list[int] = []
        self.cost: list[float] = []

    def key(self, i: int) -> tuple[int, int]:
        return (-self.L[i], i)

    def add_bin(self, items: Sequence[int], presorted: bool = False, value: Optional[tuple[int, float]] = None) -> int:
        """A micro-batch of ``items``; ``presorted``: they are already longest first, ties by index.

        ``value``: its (tokens, cost), where the caller knows them already.
        """
        # else sorted so: two sorts in C (the second is stable), no key call per item
        self.items.append(list(items) if presorted else sorted(sorted(items), key=self.L.__getitem__, reverse=True))
        tok, cost = value if value is not None else self.value(self.items[-1])
        self.tok.append(tok)
        self.cost.append(cost)
        return len(self.items) - 1

    def add_bins(self, groups: list[list[int]], values: list[tuple[int, float]]) -> None:
        """Micro-batches already longest first (ties by index), with their (tokens, cost): no copies, no sums."""
        self.items += groups
        self.tok += [v[0] for v in values]
        self.cost += [v[1] for v in values]

    def _refresh(self, j: int) -> None:
        self.tok[j], self.cost[j] = self.value(self.items[j])

    def value(self, items: Sequence[int]) -> tuple[int, float]:
        if not items:
            return 0, 0.0
        if self.packed:
            return sum(map(self.L.__getitem__, items)), sum(map(self.c.__getitem__, items))
        longest = max(map(self.L.__getitem__, items))
        return len(items) * longest, len(items) * self.cm.sequence(longest)

    def candidates(self, j: int) -> list[int]:
        """Sequences of bin j worth moving or swapping.

        Packed, each of them. Padded, a bin costs count x cost(longest), so only
        its longest (which sets the cost) and its shortest (the cheapest to
        seat elsewhere) differ from the rest.
        """
        items = self.items[j]
        if not self.packed:
            return list(items) if len(items) <= 2 else [items[0], items[-1]]
        if len(items) <= _CANDIDATES:
            return list(items)
        # many short sequences: an even spread over the lengths is enough choice
        step = (len(items) - 1) / (_CANDIDATES - 1)
        return [items[round(m * step)] for m in range(_CANDIDATES)]

    def move(self, i: int, src: int, dst: int) -> None:
        self.items[src].remove(i)
        dst_items = self.items[dst]
        dst_items.insert(bisect.bisect_left([self.key(k) for k in dst_items], self.key(i)), i)
        self._refresh(src)
        self._refresh(dst)
