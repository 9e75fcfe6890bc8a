"""The balanced planner: the fewest lock-step steps, about equal modeled cost in every step and on every rank.

How it plans (B = the budget, W = ranks, S = steps):

1. Steps. Packed: S is the lower bound (see ``stats.lower_bound_bins``), one
   more only when the micro-batches do not fit in S x W slots. Padded: S is
   what the fewest padded micro-batches (greedy over the globally sorted
   lengths, which is optimal for ``count * longest <= B``) need over W ranks,
   never more than the original dealt greedy. With few micro-batches per rank
   padded ones are too coarse to even out the ranks: when the ranks end more
   than 0.5% apart, other micro-batch counts and then more steps (up to the
   greedy's) are tried, and the first step count within 0.5% is kept.
2. Micro-batches, S x W of them (fewer when there are fewer sequences).
   Packed: every sequence longer than B alone, the rest longest-processing-
   time first into the cheapest micro-batch that has room, so they come out
   of about equal cost. Padded: contiguous runs of the sorted lengths (that
   keeps padding low), the costliest split until there are S x W.
3. Steps from micro-batches: sorted by cost and grouped W at a time, which
   minimises the sum over steps of each step's costliest micro-batch (what a
   lock-step backend waits for) for a given set of micro-batches.
4. Refinement: sequences are moved or swapped out of each step's costliest
   micro-batch when that lowers the sum of step maxima (within the budget),
   and micro-batches regrouped, until nothing improves (bounded work).
5. Ranks: each step's micro-batches are dealt to ranks, costliest to the
   least loaded rank, then swapped within steps (which leaves every step's
   maximum as it is) and sequences moved between ranks into micro-batches
   below their step's maximum, to even out the per-rank totals.
6. Order: the costliest step first, so an out-of-memory shows at once.

Everything is deterministic: ties break on example indices.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Optional, Sequence

from backends.planning.cost import CostModel
from backends.planning.greedy import Schedule, _greedy_token_budget, deal_to_ranks, sort_by_length
from backends.planning.stats import lower_bound_bins

# Bounds on refinement work (candidate evaluations), so huge inputs still plan in seconds.
_WORK_PER_ITEM = 400
_MIN_WORK = 400_000
_MAX_WORK = 400_000
_CANDIDATES = 24  # sequences of one micro-batch considered for a move or swap
_PADDED_IMBALANCE = 1.005  # padded: per-rank cost max/mean worth a step more (issue 10)
_PADDED_RETRIES = 8  # padded: at most this many steps more than the fewest, each a whole planning pass


class _Bins:
    """Micro-batches under construction: items (longest first), computed tokens and modeled cost of each."""

    def __init__(self, lengths: Sequence[int], costs: Sequence[float], budget: int, layout: str, cost_model: CostModel):
        self.L, self.c, self.B, self.packed, self.cm = lengths, costs, budget, layout == "packed", cost_model
        self.items: list[list[int]] = []
        self.tok: list[int] = []
        self.cost: list[float] = []

    def key(self, i: int) -> tuple[int, int]:
        return (-self.L[i], i)

    def add_bin(self, items: Sequence[int]) -> int:
        self.items.append(sorted(items, key=self.key))
        self.tok.append(0)
        self.cost.append(0.0)
        j = len(self.items) - 1
        self._refresh(j)
        return j

    def _refresh(self, j: int) -> None:
        self.tok[j], self.cost[j] = self.value(self.items[j])

    def value(self, items: Sequence[int]) -> tuple[int, float]:
        if not items:
            return 0, 0.0
        if self.packed:
            return sum(self.L[i] for i in items), sum(self.c[i] for i in items)
        longest = max(self.L[i] for i in items)
        return len(items) * longest, len(items) * self.cm.sequence(longest)

    def after(self, j: int, remove: Optional[int], add: Optional[int]) -> tuple[int, float, int]:
        """(tokens, cost, count) of bin j once ``remove`` leaves it and ``add`` joins it."""
        items = self.items[j]
        count = len(items) - (remove is not None) + (add is not None)
        if count == 0:
            return 0, 0.0, 0
        if self.packed:
            tok, cost = self.tok[j], self.cost[j]
            if remove is not None:
                tok, cost = tok - self.L[remove], cost - self.c[remove]
            if add is not None:
                tok, cost = tok + self.L[add], cost + self.c[add]
            return tok, cost, count
        longest = 0
        for i in items:  # longest first: the first one that is not leaving
            if i != remove:
                longest = self.L[i]
                break
        if add is not None:
            longest = max(longest, self.L[add])
        return count * longest, count * self.cm.sequence(longest), count

    def fits(self, tok: int, count: int) -> bool:
        return count <= 1 or tok <= self.B

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
        self.items[dst].append(i)
        self.items[dst].sort(key=self.key)
        self._refresh(src)
        self._refresh(dst)


def _pack_packed(order: Sequence[int], n_bins: int, n_heavy: int, bins: _Bins) -> Optional[list[list[int]]]:
    """Longest-processing-time first with a token capacity: each sequence into the cheapest micro-batch it fits.

    The first ``n_heavy`` micro-batches share a step with over-long sequences
    (which cost more than any micro-batch within the budget can): they take
    every sequence that fits first, as the costliest ones come first, because
    cost placed there is hidden under the step's maximum.
    """
    L, c, B = bins.L, bins.c, bins.B
    if n_bins <= 0:
        return [] if not order else None
    groups: list[list[int]] = [[] for _ in range(n_bins)]
    tok = [0] * n_bins
    heap = [(0 if j < n_heavy else 1, 0.0, j) for j in range(n_bins)]
    # Micro-batches too full for the current sequence wait here, fullest last, until
    # sequences short enough come (they come longest first), so none is looked at twice in vain.
    parked: list[tuple[int, int, float, int]] = []  # (-room, rank, cost, j)
    for i in order:
        while parked and -parked[0][0] >= L[i]:
            _, rank, cost, j = heapq.heappop(parked)
            heapq.heappush(heap, (rank, cost, j))
        while heap:
            rank, cost, j = heapq.heappop(heap)
            if tok[j] + L[i] <= B:
                groups[j].append(i)
                tok[j] += L[i]
                heapq.heappush(heap, (rank, cost + c[i], j))
                break
            heapq.heappush(parked, (tok[j] - B, rank, cost, j))
        else:
            return None
    return groups


def _best_fit_decreasing(order: Sequence[int], n_bins: int, B: int, L: Sequence[int]) -> Optional[list[list[int]]]:
    """Best-fit decreasing by tokens (into the fullest micro-batch with room): the fallback when the fill is tight."""
    groups: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room, micro-batch), sorted
    for i in sorted(order, key=lambda i: (-L[i], i)):
        at = bisect.bisect_left(rooms, (L[i], -1))
        if at < len(rooms):
            room, j = rooms.pop(at)
            groups[j].append(i)
            bisect.insort(rooms, (room - L[i], j))
        elif len(groups) < n_bins:
            groups.append([i])
            bisect.insort(rooms, (B - L[i], len(groups) - 1))
        else:
            return None
    return groups + [[] for _ in range(n_bins - len(groups))]


def fewest_padded_microbatches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy ``count * longest <= budget`` over the globally sorted lengths: the fewest padded micro-batches.

    Optimal: some optimal plan holds the longest sequences together in one
    micro-batch (swapping a shorter one in never raises another's longest).
    """
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sort_by_length(lengths):
        if current and (len(current) + 1) * max(longest, lengths[i]) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        groups.append(current)
    return groups


def _capped_runs(order: Sequence[int], lengths: Sequence[int], costs: Sequence[float], budget: int, cap: float,
                 limit: int) -> Optional[list[tuple[int, int]]]:
    """Contiguous runs of ``order`` (longest first), each within the budget and ``count * cost(longest) <= cap``.

    None as soon as more than ``limit`` runs are needed. A run's longest is its
    first sequence, so each run is sized in O(1).
    """
    runs: list[tuple[int, int]] = []
    p, n = 0, len(order)
    while p < n:
        if len(runs) == limit:
            return None
        first = order[p]
        k = budget // lengths[first]
        if cap < math.inf and costs[first] > 0:
            k = min(k, int(cap // costs[first]))
        k = max(1, k)
        runs.append((p, min(n, p + k)))
        p += k
    return runs


def _padded_groups(lengths: Sequence[int], costs: Sequence[float], budget: int, n_bins: int) -> list[list[int]]:
    """At most ``n_bins`` contiguous runs of the sorted lengths with the smallest costliest run (bisection on the cap)."""
    order = sort_by_length(lengths)
    lo = max(costs)  # no run can cost less than the costliest sequence alone
    # The budget alone (no cap) gives the fewest runs, no more than n_bins; its costliest run bounds the cap.
    best = _capped_runs(order, lengths, costs, budget, math.inf, len(order))
    assert best is not None and len(best) <= n_bins
    hi = max(lo, max((b - a) * costs[order[a]] for a, b in best))
    for _ in range(60):
        if hi - lo <= 1e-4 * hi:
            break
        mid = (lo + hi) / 2
        runs = _capped_runs(order, lengths, costs, budget, mid, n_bins)
        if runs is None:
            lo = mid
        else:
            hi, best = mid, runs
    return [order[a:b] for a, b in best]


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
        order = sorted(range(len(b.items)), key=lambda j: (-b.cost[j], b.items[j][0] if b.items[j] else math.inf))
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
        members = sorted(self.members[s], key=lambda j: (-cost[j], j))
        return cost[members[0]], members[0], (cost[members[1]] if len(members) > 1 else 0.0)

    def improve(self, work: int) -> int:
        """Move or swap sequences out of each step's costliest micro-batch while the sum of step maxima drops.

        Candidates are every micro-batch when there are few, else those of
        nearby steps (sorted grouping has already put similar ones there).
        """
        b, W, S = self.bins, self.W, self.S
        eps = 1e-9 * max(1.0, max(b.cost, default=1.0))
        window = S if S * W <= 1024 else 2
        while work > 0:
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

    def _delta(self, s: int, j: int, cost_j: float, t: int, k: int, cost_k: float, second_s: float, mx_t: float) -> float:
        """Change of the sum of step maxima when j (the costliest of step s) becomes cost_j and k becomes cost_k."""
        mx_s = self.bins.cost[j]
        if s != t:
            return max(cost_j, second_s) - mx_s + max(cost_k, mx_t) - mx_t
        cost = self.bins.cost
        rest = max((cost[m] for m in self.members[s] if m != j and m != k), default=0.0)
        return max(cost_j, cost_k, rest) - mx_s


def _best_transfer(b: _Bins, slots: list[list[int]], maxima: list[float], totals: list[float], hi: int, lo: int):
    """The move (or swap) of a sequence from rank ``hi`` to rank ``lo`` that lowers the larger of their totals most.

    Returns (gain, (i, i2 or None, step of i, step of the target, change of hi, change of lo), evaluations).
    No micro-batch grows past its step's maximum or the budget.
    """
    S = len(slots)
    sources, targets = range(S), range(S)
    if S > 256:  # look only where a transfer is likeliest to help
        sources = sorted(range(S), key=lambda s: (b.cost[slots[s][lo]] - b.cost[slots[s][hi]], s))[:16]
        targets = sorted(range(S), key=lambda t: (b.cost[slots[t][lo]] - maxima[t], t))[:16]
    best_gain, best, used = 0.0, None, 0
    for s in sources:
        j = slots[s][hi]
        for i in b.candidates(j):
            for t in targets:
                k = slots[t][lo]
                for i2 in [None, *b.candidates(k)]:  # None: move i; else swap it with i2
                    used += 1
                    tok_k, cost_k, cnt_k = b.after(k, i2, i)
                    if cost_k > maxima[t] or not b.fits(tok_k, cnt_k):
                        continue
                    tok_j, cost_j, cnt_j = b.after(j, i, i2)
                    if cost_j > maxima[s] or not b.fits(tok_j, cnt_j):
                        continue
                    d_hi, d_lo = cost_j - b.cost[j], cost_k - b.cost[k]
                    gain = totals[hi] - max(totals[hi] + d_hi, totals[lo] + d_lo)
                    if gain > best_gain:
                        best_gain, best = gain, (i, i2, s, t, d_hi, d_lo)
    return best_gain, best, used


def _assign_ranks(grid: _Grid, work: int) -> list[list[int]]:
    """Per step, which rank runs which micro-batch: rank totals as even as the steps allow.

    Returns ``slots[s][r]`` = micro-batch id. Swapping micro-batches within a
    step never changes the step's maximum, so this cannot lengthen the critical path.
    """
    b, W, S = grid.bins, grid.W, grid.S
    totals = [0.0] * W
    slots: list[list[int]] = [[-1] * W for _ in range(S)]

    def spread(s: int) -> float:
        costs = [b.cost[j] for j in grid.members[s]]
        return max(costs) - min(costs)

    for s in sorted(range(S), key=lambda s: (-spread(s), s)):
        ranks = sorted(range(W), key=lambda r: (totals[r], r))
        for r, j in zip(ranks, sorted(grid.members[s], key=lambda j: (-b.cost[j], j))):
            slots[s][r] = j
            totals[r] += b.cost[j]
    if W == 1:
        return slots
    tol = 1e-5 * sum(totals) / W  # closer than this is level
    # Swaps within steps between the busiest rank and another one.
    while work > 0:
        hi = max(range(W), key=lambda r: (totals[r], -r))
        if totals[hi] - min(totals) <= tol:
            return slots
        gain_best, best = tol, None
        for lo in range(W):
            gap = totals[hi] - totals[lo]
            if gap <= tol:
                continue
            work -= S
            for s in range(S):
                d = b.cost[slots[s][hi]] - b.cost[slots[s][lo]]
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
    # Sequences moved (or swapped) from the busiest rank to another, never past a step's maximum.
    maxima = [grid.step_max(s) for s in range(S)]
    while work > 0:
        hi = max(range(W), key=lambda r: (totals[r], -r))
        best_gain, best = tol, None
        for lo in sorted(range(W), key=lambda r: (totals[r], r)):
            if totals[hi] - totals[lo] <= tol:
                break
            gain, transfer, used = _best_transfer(b, slots, maxima, totals, hi, lo)
            work -= used
            if gain > best_gain:
                best_gain, best = gain, (lo, transfer)
        if best is None:
            break
        lo, (i, i2, s, t, d_hi, d_lo) = best
        j, k = slots[s][hi], slots[t][lo]
        b.move(i, j, k)
        if i2 is not None:
            b.move(i2, k, j)
        totals[hi] += d_hi
        totals[lo] += d_lo
        for u in {s, t}:
            maxima[u] = grid.step_max(u)
    return slots


def balanced_schedules(
    lengths: Sequence[int], world_size: int, max_tokens: int, layout: str, cost_model: CostModel
) -> list[Schedule]:
    """Per rank, S micro-batches (``None`` for an empty slot): see the module docstring."""
    n, W, B = len(lengths), world_size, max_tokens
    if n == 0:
        return [[] for _ in range(W)]
    costs = [cost_model.sequence(x) for x in lengths]
    work = min(_MAX_WORK, max(_MIN_WORK, _WORK_PER_ITEM * n))
    order = sorted(range(n), key=lambda i: (-costs[i], -lengths[i], i))
    if layout == "packed":
        n_steps = math.ceil(lower_bound_bins(lengths, B) / W)
        lone = [i for i in order if lengths[i] > B]
        rest = [i for i in order if lengths[i] <= B]
        while True:
            bins = _Bins(lengths, costs, B, layout, cost_model)
            n_rest = n_steps * W - len(lone)
            # over-long sequences fill whole steps, costliest first; the last one may have free slots
            n_heavy = min(n_rest, (-len(lone)) % W)
            groups = _pack_packed(rest, n_rest, n_heavy, bins)
            if groups is None:
                groups = _best_fit_decreasing(rest, n_rest, B, lengths)
            if groups is not None:
                break
            n_steps += 1  # the bound is not reachable for this input: one step more
        for i in lone:
            bins.add_bin([i])
        for g in groups:
            bins.add_bin(g)
        grid = _Grid(bins, n_steps, W)
        work = grid.improve(work // 2) + work // 2
        slots = _assign_ranks(grid, work)
    else:
        fewest = fewest_padded_microbatches(lengths, B)
        n_steps = math.ceil(len(fewest) / W)
        if W == 1:  # one rank has nothing to balance: the fewest micro-batches, filled greedily, pad least
            bins, grid, slots = _padded_attempt(lengths, costs, B, W, cost_model, n_steps, fewest, work)
        else:
            bins, grid, slots = _padded_plan(lengths, costs, B, W, cost_model, n_steps, len(fewest), work)
    step_order = sorted(range(grid.S), key=lambda s: (-grid.step_max(s), s))
    schedules: list[Schedule] = [[] for _ in range(W)]
    for s in step_order:
        if not any(bins.items[slots[s][r]] for r in range(W)):
            continue  # a step with nothing to run (more steps than micro-batches need) is left out
        for r in range(W):
            items = bins.items[slots[s][r]]
            schedules[r].append(list(items) if items else None)
    return schedules


def _padded_attempt(lengths: Sequence[int], costs: Sequence[float], B: int, W: int, cost_model: CostModel,
                    n_steps: int, groups: Sequence[Sequence[int]], work: int) -> tuple[_Bins, _Grid, list[list[int]]]:
    """Steps 3-5 of the module docstring for padded micro-batches ``groups`` over ``n_steps`` steps."""
    bins = _Bins(lengths, costs, B, "padded", cost_model)
    for g in groups:
        bins.add_bin(g)
    grid = _Grid(bins, n_steps, W)
    work = grid.improve(work // 2) + work // 2
    return bins, grid, _assign_ranks(grid, work)


def _padded_plan(lengths: Sequence[int], costs: Sequence[float], B: int, W: int, cost_model: CostModel,
                 n_steps: int, n_fewest: int, work: int) -> tuple[_Bins, _Grid, list[list[int]]]:
    """Padded over several ranks: the fewest steps whose plan has ranks within ``_PADDED_IMBALANCE`` of each other.

    With a few micro-batches per rank, padded ones are too coarse to even out
    the ranks. Other counts of micro-batches cut the sorted lengths elsewhere,
    and more steps make them finer. So when S x W micro-batches over the fewest
    steps S leave the ranks uneven, every other count that fills those steps is
    tried (the most even within the target wins, ties: the shorter critical
    path), then one step more, and so on up to the original greedy planner's step count (no
    plan may take more). If none is within the target, the most even plan wins.
    """
    greedy_steps = max(len(_greedy_token_budget(d, lengths, B)) for d in deal_to_ranks(sort_by_length(lengths), W))
    last = min(max(n_steps, greedy_steps), n_steps + _PADDED_RETRIES)
    best, best_key = None, None
    for steps in range(n_steps, last + 1):
        # S x W first (what suits the critical path best as a rule), then fewer, down to one over the last step
        counts = [steps * W, *range(steps * W - 1, max(n_fewest, (steps - 1) * W + 1) - 1, -1)]
        for n_bins in counts:
            attempt = _padded_attempt(lengths, costs, B, W, cost_model, steps,
                                      _padded_groups(lengths, costs, B, n_bins), work)
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
        if best_key[0] == 0.0:
            break
    return best
