"""Steps 3-4 of the balanced planner: micro-batches grouped into lock-step steps by cost (``_Grid``), then sequences
moved or swapped out of each step's costliest micro-batch while the sum of step maxima drops."""

from __future__ import annotations

import heapq
import math

from balance_batch.balanced.bins import _Bins


class _Grid:
    """Micro-batches placed in S steps of W slots; the quantity to lower is the sum of step maxima."""

    def __init__(self, bins: _Bins, n_steps: int, world: int):
        self.bins, self.S, self.W = bins, n_steps, world
        while len(bins.items) < n_steps * world:
            bins.add_bin([])
        self.step_of = [0] * len(bins.items)
        self.members: list[list[int]] = [[] for _ in range(n_steps)]
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

    def step_max(self, s: int) -> float:
        return max(self.bins.cost[j] for j in self.members[s])

    def total(self) -> float:
        return sum(self.step_max(s) for s in range(self.S))

    def top(self, s: int) -> tuple[float, int, float]:
        """(cost of the costliest micro-batch, which one, cost of the next costliest) of step s."""
        cost = self.bins.cost
        members = self.members[s]
        if len(members) == 1:
            return cost[members[0]], members[0], 0.0
        costs = [cost[j] for j in members]
        mx = max(costs)
        j = min(j for j, c in zip(members, costs) if c == mx)
        return mx, j, heapq.nlargest(2, costs)[1]

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
            tops = [self.top(s) for s in range(S)]
            mean = sum(b.cost) / W
            if sum(t[0] for t in tops) <= (1 + 1e-6) * mean:
                break  # every step is level: nothing left to gain
            improved = False
            excess = [tops[s][0] * W - sum(b.cost[j] for j in self.members[s]) for s in range(S)]
            for s in sorted(range(S), key=lambda s: (-excess[s], s)):
                if work <= 0:
                    break
                mx, j, second = tops[s]
                if mx - second <= eps or not b.items[j]:
                    continue  # a tie (or a dummy): no single change lowers this step
                best_delta, best = -eps, None
                steps = range(max(0, s - window), min(S, s + window + 1))
                for i in b.candidates(j):
                    if work <= 0:
                        break
                    cost_j_out = b.after(j, i, None)[1]
                    for t in steps:
                        mx_t = tops[t][0]
                        for k in self.members[t]:
                            if k == j:
                                continue
                            work -= 1
                            tok_k, cost_k, cnt_k = b.after(k, None, i)
                            if b.fits(tok_k, cnt_k):  # move i from j to k
                                delta = self._delta(s, j, cost_j_out, t, k, cost_k, second, mx_t)
                                if delta < best_delta:
                                    best_delta, best = delta, (i, None, k)
                            for i2 in b.candidates(k):  # swap i with a cheaper sequence of k
                                work -= 1
                                if b.c[i2] >= b.c[i]:
                                    continue
                                tok_k, cost_k, cnt_k = b.after(k, i2, i)
                                if not b.fits(tok_k, cnt_k):
                                    continue
                                tok_j, cost_j, cnt_j = b.after(j, i, i2)
                                if not b.fits(tok_j, cnt_j):
                                    continue
                                delta = self._delta(s, j, cost_j, t, k, cost_k, second, mx_t)
                                if delta < best_delta:
                                    best_delta, best = delta, (i, i2, k)
                if best is not None:
                    i, i2, k = best
                    b.move(i, j, k)
                    if i2 is not None:
                        b.move(i2, k, j)
                    for t in {s, self.step_of[k]}:
                        tops[t] = self.top(t)
                    improved = True
            before = sum(t[0] for t in tops)
            self.regroup()
            if self.total() < before - eps:
                improved = True
            if not improved:
                break
        return work

    def _delta(
        self, s: int, j: int, cost_j: float, t: int, k: int, cost_k: float, second_s: float, mx_t: float
    ) -> float:
        """Change of the sum of step maxima when j (the costliest of step s) becomes cost_j and k becomes cost_k."""
        mx_s = self.bins.cost[j]
        if s != t:
            return max(cost_j, second_s) - mx_s + max(cost_k, mx_t) - mx_t
        cost = self.bins.cost
        rest = max((cost[m] for m in self.members[s] if m != j and m != k), default=0.0)
        return max(cost_j, cost_k, rest) - mx_s
