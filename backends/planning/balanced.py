"""The balanced planner: the fewest lock-step steps, about equal modeled cost in every step and on every rank.

How it plans (B = the budget, W = ranks, S = steps, n = sequences):

1. Steps. Packed: S is the lower bound (see ``stats.lower_bound_bins``), more
   only when the micro-batches do not fit in S x W slots: then best-fit
   decreasing says how many are enough. Padded: S is what the fewest padded
   micro-batches (greedy over the globally sorted lengths, which is optimal
   for ``count * longest <= B``) need over W ranks, never more than the
   original dealt greedy. With few micro-batches per rank padded ones are too
   coarse to even out the ranks: when the ranks end more than 0.5% apart,
   other micro-batch counts and then more steps (up to the greedy's) are
   tried, within a bounded amount of work, and the first step count within
   0.5% is kept.
2. Micro-batches, S x W of them (fewer when there are fewer sequences).
   Packed: every sequence longer than B alone, the rest longest-processing-
   time first into the cheapest micro-batch that has room, so they come out
   of about equal cost (best-fit decreasing's own when the fill is too tight
   for that). Both packers work on the histogram of lengths (``_Packer``):
   sequences of one length, and micro-batches holding the same lengths, are
   interchangeable, so a length's sequences go into whole groups of
   micro-batches at once. Padded: contiguous runs of the sorted lengths (that
   keeps padding low), the costliest split until there are S x W, counted
   per distinct length (``_Runs``).
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

``max_seqs`` caps the sequences of every micro-batch in every step above.
Steps 1-3 and 6 take O(n log n) (sorts) plus about O(distinct lengths);
steps 4-5 a fixed budget of candidate evaluations, each round's bookkeeping
counted in it. Everything is deterministic: ties break on example indices.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Optional, Sequence

import numpy as np

from backends.planning.cost import CostModel
from backends.planning.greedy import Schedule, _greedy_token_budget, deal_to_ranks, length_order, sort_by_length
from backends.planning.stats import lower_bound_bins

# Bounds on refinement work (candidate evaluations), so huge inputs still plan in seconds.
_WORK_PER_ITEM = 400
_MIN_WORK = 400_000
_MAX_WORK = 400_000
_CANDIDATES = 24  # sequences of one micro-batch considered for a move or swap
# Packed, at most this many sequences within the budget: where LPT misses the fewest steps, an exact search of at
# most _EXACT_NODES placements looks for them (a few milliseconds)
_EXACT_MAX = 16
_EXACT_NODES = 20_000
_MIN_CALL = 50_000  # evaluations one search for a transfer between two ranks may always use
_OVERRUN = 200_000  # the last round of transfers may finish its searches this far past the budget
_PADDED_IMBALANCE = 1.005  # padded: a per-rank cost max/mean above this is worth a step more
_PADDED_RETRIES = 8  # padded: at most this many steps more than the fewest, each a whole planning pass
_PADDED_FEW_STEPS = 64  # padded: only plans of at most this many steps try other cuts and more steps
_PADDED_SEARCH = 8  # padded: the retries together use at most this many times one plan's refinement work


class _Bins:
    """Micro-batches under construction: items (longest first), computed tokens and modeled cost of each."""

    def __init__(self, lengths: Sequence[int], costs: Sequence[float], budget: int, layout: str, cost_model: CostModel,
                 max_seqs: Optional[int] = None):
        self.L, self.c, self.B, self.packed, self.cm = lengths, costs, budget, layout == "packed", cost_model
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
        return count <= 1 or (tok <= self.B and count <= self.cap)

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


class _Rooms:
    """Micro-batches by room left (0..budget tokens): add one, or take one with the least room >= x, in O(1) big-int
    steps.

    Two levels of bit sets: bit r % 1024 of ``low[r // 1024]`` says some
    micro-batch has room r, bit k of ``high`` says ``low[k]`` is not empty.
    """

    def __init__(self, budget: int):
        self.ids: dict[int, list[int]] = {}
        self.low = [0] * (budget // 1024 + 1)
        self.high = 0

    def add(self, room: int, j: int) -> None:
        ids = self.ids.get(room)
        if ids:
            heapq.heappush(ids, j)
            return
        self.ids[room] = [j]
        k = room >> 10
        if not self.low[k]:
            self.high |= 1 << k
        self.low[k] |= 1 << (room & 1023)

    def take_at_least(self, x: int) -> Optional[tuple[int, int]]:
        """(room, micro-batch) with the least room >= x (the first micro-batch among equals), removed; None if none."""
        k = x >> 10
        word = self.low[k] >> (x & 1023) if k < len(self.low) else 0
        if word:
            room = x + (word & -word).bit_length() - 1
        else:
            higher = self.high >> (k + 1)
            if not higher:
                return None
            k += (higher & -higher).bit_length()
            word = self.low[k]
            room = (k << 10) + (word & -word).bit_length() - 1
        ids = self.ids[room]
        j = heapq.heappop(ids)
        if not ids:
            del self.ids[room]
            k = room >> 10
            self.low[k] &= ~(1 << (room & 1023))
            if not self.low[k]:
                self.high &= ~(1 << k)
        return room, j


class _Packer:
    """Packed micro-batches built on the histogram of lengths: micro-batches that hold the same lengths move as one
    group.

    Sequences of one length are interchangeable, and so are micro-batches that
    hold the same lengths, so both packers below place a length's sequences
    into whole groups of micro-batches at a time (a group splits when only
    part of it takes one more). Groups number at most a few per distinct
    length, so a million short sequences take thousands of steps, not millions.
    """

    def __init__(self, hist: Sequence[tuple[int, int]], budget: int, cap: float, seq_cost: dict):
        self.hist, self.B, self.cap, self.seq_cost = hist, budget, cap, seq_cost
        # per group: tokens, sequences, micro-batches, cost and the lengths it holds as [(length, count)]
        self.tok: list[int] = []
        self.cnt: list[int] = []
        self.nb: list[int] = []
        self.cost: list[float] = []
        self.pattern: list[list[tuple[int, int]]] = []

    def group(self, nb: int, tok: int = 0, cnt: int = 0, cost: float = 0.0, pattern=()) -> int:
        self.tok.append(tok)
        self.cnt.append(cnt)
        self.nb.append(nb)
        self.cost.append(cost)
        self.pattern.append(list(pattern))
        return len(self.nb) - 1

    def grow(self, g: int, length: int, t: int) -> None:
        """Every micro-batch of group g takes t more sequences of ``length``."""
        self.tok[g] += t * length
        self.cnt[g] += t
        c, cost = self.seq_cost[length], self.cost[g]
        for _ in range(t):  # one by one, as a sum over the micro-batch's sequences adds them (the same float)
            cost += c
        self.cost[g] = cost
        self.pattern[g].append((length, t))

    def split(self, g: int, nb: int) -> int:
        """``nb`` micro-batches of group g as a group of their own (same contents)."""
        self.nb[g] -= nb
        return self.group(nb, self.tok[g], self.cnt[g], self.cost[g], self.pattern[g])

    def lpt(self, n_bins: int, n_heavy: int) -> bool:
        """Longest-processing-time first with a token capacity (each sequence into the cheapest micro-batch it fits).

        False when some sequence fits nowhere. Micro-batches of rank 0 (the
        first ``n_heavy``) take what fits first, the rest fill evenly.
        """
        B, cap = self.B, self.cap
        heap = []  # (rank, cost, group)
        for rank, nb in ((0, n_heavy), (1, n_bins - n_heavy)):
            if nb > 0:
                heap.append((rank, 0.0, self.group(nb)))
        parked: list[tuple[int, int, float, int]] = []  # (-room, rank, cost, group): too full for the current length
        for length, k in self.hist:
            c = self.seq_cost[length]
            while parked and -parked[0][0] >= length:
                _, rank, cost, g = heapq.heappop(parked)
                heapq.heappush(heap, (rank, cost, g))
            while k > 0:
                if not heap:
                    return False
                rank, cost, g = heap[0]
                room = B - self.tok[g]
                if room < length:
                    heapq.heappop(heap)
                    heapq.heappush(parked, (-room, rank, cost, g))
                    continue
                nb = self.nb[g]
                if k < nb:  # the last of this length: k of the group's micro-batches take one each
                    g2 = self.split(g, k)
                    self.grow(g2, length, 1)
                    self._requeue(heap, rank, g2)
                    break
                t = min(room // length, k // nb, cap - self.cnt[g])
                if len(heap) > 1:  # the next cheapest micro-batches: rounds while this group is no costlier
                    rank2, cost2, _ = min(heap[1:3])
                    if rank2 == rank and c > 0:
                        t = min(t, int((cost2 - cost) // c) + 1)
                t = max(1, t)
                self.grow(g, length, t)
                k -= t * nb
                heapq.heappop(heap)
                self._requeue(heap, rank, g)
        return True

    def exact(self, n_bins: int, nodes: int) -> bool:
        """Search every placement (longest first) for one into ``n_bins`` micro-batches; False when there is none or
        the search used up ``nodes`` placements. For few sequences, where LPT can miss a fill as tight as the budget."""
        B, cap = self.B, self.cap
        seqs = [length for length, k in self.hist for _ in range(k)]
        tok, cnt, into = [0] * n_bins, [0] * n_bins, [0] * len(seqs)
        left = [nodes]

        def place(i: int) -> bool:
            if i == len(seqs):
                return True
            tried = set()
            for j in range(n_bins):
                state = (tok[j], cnt[j])
                if tok[j] + seqs[i] > B or cnt[j] >= cap or state in tried:
                    continue  # micro-batches alike now are alike for the rest: one of them is tried
                left[0] -= 1
                if left[0] < 0:
                    return False
                tried.add(state)
                tok[j] += seqs[i]
                cnt[j] += 1
                into[i] = j
                if place(i + 1):
                    return True
                tok[j] -= seqs[i]
                cnt[j] -= 1
            return False

        if not place(0):
            return False
        for j in range(n_bins):
            g = self.group(1)
            for length, run in itertools.groupby(seqs[i] for i in range(len(seqs)) if into[i] == j):
                self.grow(g, length, len(list(run)))
        return True

    def _requeue(self, heap: list, rank: int, g: int) -> None:
        if self.cnt[g] < self.cap and self.tok[g] < self.B:
            heapq.heappush(heap, (rank, self.cost[g], g))

    def bfd(self) -> None:
        """Best-fit decreasing (each sequence, longest first, into the fullest micro-batch with room): as many as it
        needs."""
        B, cap = self.B, self.cap
        rooms = _Rooms(B)
        for length, k in self.hist:
            while k > 0:
                found = rooms.take_at_least(length)
                if found is None:  # new micro-batches, each as full as the budget and the cap allow
                    q = int(min(B // length, cap))
                    full, rest = divmod(k, q)
                    if full:
                        g = self.group(full)
                        self.grow(g, length, q)
                        self._add_room(rooms, g)
                    if rest:
                        g = self.group(1)
                        self.grow(g, length, rest)
                        self._add_room(rooms, g)
                    break
                room, g = found
                q = int(min(room // length, cap - self.cnt[g]))
                nb = self.nb[g]
                full = min(nb, k // q)
                rest = k - full * q if full < nb else 0
                if full < nb:
                    if rest:
                        g_rest = self.split(g, 1)
                        self.grow(g_rest, length, rest)
                        self._add_room(rooms, g_rest)
                    if full:
                        g_full = self.split(g, full)
                        self.grow(g_full, length, q)
                        self._add_room(rooms, g_full)
                    if self.nb[g]:
                        self._add_room(rooms, g)
                    break
                self.grow(g, length, q)
                self._add_room(rooms, g)
                k -= full * q

    def _add_room(self, rooms: "_Rooms", g: int) -> None:
        room = self.B - self.tok[g]
        if room > 0 and self.cnt[g] < self.cap:
            rooms.add(room, g)

    def n_bins(self) -> int:
        return sum(self.nb)

    def values(self) -> list[tuple[int, float]]:
        """Every micro-batch's (tokens, cost), in the order of ``groups``."""
        out: list[tuple[int, float]] = []
        for g, nb in enumerate(self.nb):
            out += [(self.tok[g], self.cost[g])] * nb
        return out

    def groups(self, pools: dict) -> list[list[int]]:
        """Every micro-batch's sequences (longest first, ties by index), ``pools[length]`` giving the indices of each
        length."""
        taken = {length: 0 for length in pools}
        out: list[list[int]] = []
        for g, nb in enumerate(self.nb):
            pattern = self.pattern[g]
            if nb > 1 and all(t == 1 for _, t in pattern):  # one of each length: a column per length, zipped in C
                columns = []
                for length, _ in pattern:
                    at = taken[length]
                    columns.append(pools[length][at : at + nb])
                    taken[length] = at + nb
                out += map(list, zip(*columns)) if columns else ([] for _ in range(nb))
                continue
            for _ in range(nb):
                items: list[int] = []
                for length, t in pattern:
                    at = taken[length]
                    items += pools[length][at : at + t]
                    taken[length] = at + t
                out.append(items)
        return out


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
        self.n, self.B, self.max_seqs = len(self.order), budget, max_seqs or len(self.order)
        # blocks of equal length in the sorted order: [end position, length, cost of one]
        starts = [0, *(np.flatnonzero(np.diff(ordered)) + 1).tolist()] if self.n else []
        ends = starts[1:] + [self.n]
        self.blocks: list[list] = [[end, int(ordered[a]), costs[self.order[a]]] for a, end in zip(starts, ends)]
        self.spans: list[tuple[int, int, int]] = []  # of the last cut: (first position, run size, runs)

    def size(self, length: int, cost: float, cap: float) -> int:
        k = min(self.B // length, self.max_seqs)
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


def _best_transfer(b: _Bins, slots: list[list[int]], maxima: list[float], totals: list[float], hi: int, lo: int,
                   budget: int):
    """The move (or swap) of a sequence from rank ``hi`` to rank ``lo`` that lowers the larger of their totals most.

    Returns (gain, (i, i2 or None, step of i, step of the target, change of hi, change of lo), evaluations).
    No micro-batch grows past its step's maximum or the budget. Stops after
    about ``budget`` evaluations; where all pairs of steps would cost more
    than that, the likeliest ones come first.
    """
    S = len(slots)
    sources, targets = range(S), range(S)
    if S > 256 or S * S * min(_CANDIDATES, 1 + len(b.items[slots[0][hi]])) ** 2 > budget:
        # look first (with many steps, only) where a transfer is likeliest to help
        keep = 16 if S > 256 else S
        sources = sorted(range(S), key=lambda s: (b.cost[slots[s][lo]] - b.cost[slots[s][hi]], s))[:keep]
        targets = sorted(range(S), key=lambda t: (b.cost[slots[t][lo]] - maxima[t], t))[:keep]
    best_gain, best, used = 0.0, None, 0
    for s in sources:
        if used >= budget:
            break
        j = slots[s][hi]
        for i in b.candidates(j):
            if used >= budget:
                break
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


def _assign_ranks(grid: _Grid, work: int) -> tuple[list[list[int]], int]:
    """Per step, which rank runs which micro-batch: rank totals as even as the steps allow.

    Returns ``slots[s][r]`` = micro-batch id, and the work left. Swapping micro-batches within a
    step never changes the step's maximum, so this cannot lengthen the critical path.
    """
    b, W, S = grid.bins, grid.W, grid.S
    if W == 1:
        return [list(grid.members[s]) for s in range(S)], work
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
    if W == 1:
        return slots, work
    tol = 1e-5 * sum(totals) / W  # closer than this is level
    # Swaps within steps between the busiest rank and another one.
    while work > 0:
        hi = max(range(W), key=lambda r: (totals[r], -r))
        if totals[hi] - min(totals) <= tol:
            return slots, work
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
            if totals[hi] - totals[lo] <= tol or work <= -_OVERRUN:
                break
            gain, transfer, used = _best_transfer(b, slots, maxima, totals, hi, lo, max(work, _MIN_CALL))
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
    return slots, work


def _sequence_order(lengths: Sequence[int], costs: Sequence[float], a: float, b: float) -> list[int]:
    """Costliest first, ties longest then by index. With a, b >= 0 cost grows with length: a sort by length in C."""
    if a >= 0 and b >= 0:
        return sort_by_length(lengths)
    return sorted(range(len(lengths)), key=lambda i: (-costs[i], -lengths[i], i))


def _packed_groups(order: Sequence[int], lengths: Sequence[int], costs: Sequence[float], B: int, W: int,
                   cost_model: CostModel, max_seqs: Optional[int], seq_cost: dict) -> tuple[_Bins, int]:
    """Steps 1-2 packed: the micro-batches of the fewest steps this planner reaches, and that step count.

    Longest-processing-time first (even costs) at the lower bound; with few
    sequences (``_EXACT_MAX``) where LPT fails there, an exact search at the
    bound; where the fill is too tight, best-fit decreasing says how many micro-batches
    are enough, and LPT is tried once more with that many (BFD's own, with a
    few empty ones, when LPT still fails). Both work on the histogram of
    lengths (``_Packer``): at most four packings, each about O(distinct lengths).
    """
    n_lone = sum(n > B for n in lengths)
    if all(lengths[i] > B for i in order[:n_lone]):  # longest first (as a rule): the over-long ones are a prefix
        lone, rest = order[:n_lone], order[n_lone:]
    else:
        lone, rest = [i for i in order if lengths[i] > B], [i for i in order if lengths[i] <= B]
    pools = {length: list(ids) for length, ids in itertools.groupby(rest, key=lengths.__getitem__)}
    hist = [(length, len(ids)) for length, ids in pools.items()]  # longest first, as ``rest`` is
    cap = max_seqs or math.inf
    bound = math.ceil(lower_bound_bins(lengths, B, max_seqs=max_seqs) / W)

    def lpt(n_steps: int) -> Optional[_Packer]:
        packer = _Packer(hist, B, cap, seq_cost)
        n_rest = n_steps * W - len(lone)
        if n_rest <= 0:
            return None if rest else packer
        # over-long sequences fill whole steps, costliest first; the last one may have free slots
        n_heavy = min(n_rest, (-len(lone)) % W)
        return packer if packer.lpt(n_rest, n_heavy) else None

    n_steps, packer = bound, lpt(bound)
    if packer is None and len(rest) <= _EXACT_MAX and bound * W > len(lone):
        exact = _Packer(hist, B, cap, seq_cost)  # few sequences: a fill LPT missed may still exist
        if exact.exact(bound * W - len(lone), _EXACT_NODES):
            packer = exact
    if packer is None:
        bfd = _Packer(hist, B, cap, seq_cost)
        bfd.bfd()
        enough = math.ceil((len(lone) + bfd.n_bins()) / W)
        for n_steps in sorted({bound + 1, enough}) if enough > bound else ():
            packer = lpt(n_steps)
            if packer is not None:
                break
        if packer is None:  # BFD's micro-batches, and a few empty ones the refinement below can fill
            n_steps, packer = max(bound, enough), bfd
    bins = _Bins(lengths, costs, B, "packed", cost_model, max_seqs)
    for i in lone:
        bins.add_bin([i], presorted=True)
    groups = packer.groups(pools)
    empty = n_steps * W - len(lone) - len(groups)
    bins.add_bins(groups + [[] for _ in range(empty)], packer.values() + [(0, 0.0)] * empty)
    return bins, n_steps


def balanced_schedules(
    lengths: Sequence[int], world_size: int, max_tokens: int, layout: str, cost_model: CostModel,
    max_seqs: Optional[int] = None,
) -> list[Schedule]:
    """Per rank, S micro-batches (``None`` for an empty slot): see the module docstring.

    ``max_seqs`` caps the sequences of a micro-batch (None: no cap).
    """
    n, W, B = len(lengths), world_size, max_tokens
    if n == 0:
        return [[] for _ in range(W)]
    seq_cost = {x: cost_model.sequence(x) for x in set(lengths)}
    costs = list(map(seq_cost.__getitem__, lengths))
    work = min(_MAX_WORK, max(_MIN_WORK, _WORK_PER_ITEM * n))
    order = _sequence_order(lengths, costs, cost_model.a, cost_model.b)
    if layout == "packed":
        bins, n_steps = _packed_groups(order, lengths, costs, B, W, cost_model, max_seqs, seq_cost)
        grid = _Grid(bins, n_steps, W)
        if W > 1:  # one rank has nothing to even out: its steps are its micro-batches, costliest first
            work = grid.improve(work // 2) + work // 2
        slots, _ = _assign_ranks(grid, work)
    else:
        fewest = fewest_padded_microbatches(lengths, B, max_seqs)
        n_steps = math.ceil(len(fewest) / W)
        if W == 1:  # one rank has nothing to balance: the fewest micro-batches, filled greedily, pad least
            bins, grid, slots, _ = _padded_attempt(lengths, costs, B, W, cost_model, n_steps, fewest, work, max_seqs)
        else:
            bins, grid, slots = _padded_plan(lengths, costs, B, W, cost_model, n_steps, len(fewest), work, max_seqs)
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


def _padded_attempt(lengths: Sequence[int], costs: Sequence[float], B: int, W: int, cost_model: CostModel,
                    n_steps: int, groups: Sequence[Sequence[int]], work: int,
                    max_seqs: Optional[int] = None) -> tuple[_Bins, _Grid, list[list[int]], int]:
    """Steps 3-5 of the module docstring for padded micro-batches ``groups`` over ``n_steps`` steps; the last item is
    the work used."""
    bins = _Bins(lengths, costs, B, "padded", cost_model, max_seqs)
    for g in groups:
        bins.add_bin(g, presorted=True)
    grid = _Grid(bins, n_steps, W)
    left = grid.improve(work // 2) + work // 2
    slots, left = _assign_ranks(grid, left)
    return bins, grid, slots, work - left


def _padded_plan(lengths: Sequence[int], costs: Sequence[float], B: int, W: int, cost_model: CostModel,
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
        len(_greedy_token_budget(d, lengths, B, max_seqs)) for d in deal_to_ranks(sort_by_length(lengths), W)
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
            *attempt, used = _padded_attempt(lengths, costs, B, W, cost_model, steps,
                                             _padded_groups(lengths, costs, B, n_bins, max_seqs), work, max_seqs)
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
