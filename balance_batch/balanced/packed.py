"""Steps 1-2 of the balanced planner, packed: how many steps, and the sequences laid into micro-batches of about equal
cost, on the histogram of lengths (``_Packer``: longest-processing-time first, best-fit decreasing, and an exact search
where BFD leaves a micro-batch over)."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Optional, Sequence

from balance_batch.balanced.bins import _Bins
from balance_batch.balanced.completion import _Completion
from balance_batch.cost import CostModel
from balance_batch.stats import lower_bound_bins

# Where LPT and best-fit decreasing both miss the fewest steps, an exact search (``_Packer.search``) looks for them,
# in a step of at most _SEARCH_BINS micro-batches, capped in units of work (lengths looked at): _SEARCH_WORK for a step
# of at most _EXACT_MAX sequences (a search that used it all took 0.3-0.8 s on the project's 2-core machine), a
# hundredth of it for more (a few milliseconds, so a large step where BFD leaves a step over costs little more).
# What is known of when the cap suffices comes from scripts/bench_tight.py, on verl's test shape (lengths uniform in
# [50, 90], budget 300): of 2,000 seeded steps of 25 lengths and 300 of 20 or 25, every one reached the optimum and
# none needed more than 34,000. With more sequences the cap can run out: in 1 of 300 steps of 30 lengths (its optimum
# is a micro-batch above the bound, which the search does not prove within the cap; best-fit decreasing reaches it)
# and in 1 of 200 steps of 40, which then takes a micro-batch more than the optimum. Elsewhere nothing is measured.
_EXACT_MAX = 64
_SEARCH_BINS = 256
_SEARCH_WORK = 1_000_000
_BITSET_BUDGET = 1 << 20  # _Rooms: bit sets of budget / 1,024 words up to this budget, a sorted list above it


def _search_work(n_seqs: int) -> int:
    """The search's cap on work for a step (or a corpus) of ``n_seqs`` sequences."""
    return _SEARCH_WORK if n_seqs <= _EXACT_MAX else _SEARCH_WORK // 100


class _Rooms:
    """Micro-batches by room left (0..budget tokens): add one, or take one with the least room >= x (the first
    micro-batch among equals).

    Budgets up to ``_BITSET_BUDGET``: two levels of bit sets, O(1) big-int
    steps (bit r % 1024 of ``low[r // 1024]`` says some micro-batch has room r,
    bit k of ``high`` says ``low[k]`` is not empty). Larger budgets: a sorted
    list of the rooms in use (bisection), so memory and time follow the
    micro-batches, not the budget.
    """

    def __init__(self, budget: int):
        self.ids: dict[int, list[int]] = {}
        self.rooms: Optional[list[int]] = [] if budget > _BITSET_BUDGET else None  # sorted, distinct
        self.low = [0] * (budget // 1024 + 1) if self.rooms is None else []
        self.high = 0

    def add(self, room: int, j: int) -> None:
        ids = self.ids.get(room)
        if ids:
            heapq.heappush(ids, j)
            return
        self.ids[room] = [j]
        if self.rooms is not None:
            bisect.insort(self.rooms, room)
            return
        k = room >> 10
        if not self.low[k]:
            self.high |= 1 << k
        self.low[k] |= 1 << (room & 1023)

    def take_at_least(self, x: int) -> Optional[tuple[int, int]]:
        """(room, micro-batch) with the least room >= x (the first micro-batch among equals), removed; None if none."""
        room = self._least_at_least(x)
        if room is None:
            return None
        ids = self.ids[room]
        j = heapq.heappop(ids)
        if not ids:
            del self.ids[room]
            if self.rooms is not None:
                del self.rooms[bisect.bisect_left(self.rooms, room)]
            else:
                k = room >> 10
                self.low[k] &= ~(1 << (room & 1023))
                if not self.low[k]:
                    self.high &= ~(1 << k)
        return room, j

    def _least_at_least(self, x: int) -> Optional[int]:
        if self.rooms is not None:
            e = bisect.bisect_left(self.rooms, x)
            return self.rooms[e] if e < len(self.rooms) else None
        k = x >> 10
        word = self.low[k] >> (x & 1023) if k < len(self.low) else 0
        if word:
            return x + (word & -word).bit_length() - 1
        higher = self.high >> (k + 1)
        if not higher:
            return None
        k += (higher & -higher).bit_length()
        word = self.low[k]
        return (k << 10) + (word & -word).bit_length() - 1


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
        self.hist, self.budget, self.cap, self.seq_cost = hist, budget, cap, seq_cost
        # per group: tokens, sequences, micro-batches, cost and the lengths it holds as [(length, count)]
        self.tok: list[int] = []
        self.cnt: list[int] = []
        self.nb: list[int] = []
        self.cost: list[float] = []
        self.pattern: list[list[tuple[int, int]]] = []
        self.search_work = 0  # the work ``search`` used, its last call

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
        budget, cap = self.budget, self.cap
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
                room = budget - self.tok[g]
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

    def search(self, n_bins: int, work: int) -> bool:
        """An exact search for a packing into ``n_bins`` micro-batches (``_Completion``: bin completion); False when
        there is none or when it used up ``work`` (lengths looked at). For steps where best-fit decreasing leaves one
        micro-batch over. ``search_work`` keeps the work the last search used.
        """
        self.search_work = 0
        if not sum(length * k for length, k in self.hist):
            return n_bins >= 0
        completion = _Completion(self.hist, self.budget, self.cap, work)
        chosen = completion.run(n_bins)
        self.search_work = work - completion.work_left
        if chosen is None:
            return False
        for content in chosen:  # a micro-batch's lengths, longest first (its first length may come again)
            g = self.group(1)
            for d, run in itertools.groupby(sorted(content), key=lambda p: p[0]):
                self.grow(g, self.hist[d][0], sum(t for _, t in run))
        return True

    def _requeue(self, heap: list, rank: int, g: int) -> None:
        if self.cnt[g] < self.cap and self.tok[g] < self.budget:
            heapq.heappush(heap, (rank, self.cost[g], g))

    def bfd(self) -> None:
        """Best-fit decreasing (each sequence, longest first, into the fullest micro-batch with room): as many as it
        needs."""
        budget, cap = self.budget, self.cap
        rooms = _Rooms(budget)
        for length, k in self.hist:
            while k > 0:
                found = rooms.take_at_least(length)
                if found is None:  # new micro-batches, each as full as the budget and the cap allow
                    q = int(min(budget // length, cap))
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
        room = self.budget - self.tok[g]
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


def _packed_groups(order: Sequence[int], lengths: Sequence[int], costs: Sequence[float], budget: int, W: int,
                   cost_model: CostModel, max_seqs: Optional[int], seq_cost: dict) -> tuple[_Bins, int]:
    """Steps 1-2 packed: the micro-batches of the fewest steps this planner reaches, and that step count.

    Longest-processing-time first (even costs) at the lower bound; where the
    fill is too tight, best-fit decreasing says how many micro-batches are
    enough; where that is a step more than the bound, an exact search for the
    bound's micro-batches (``_Packer.search``, bin completion, capped by
    ``_search_work``); failing that, LPT is tried once more with BFD's count
    (BFD's own, with a few empty ones, when LPT still fails). All work on the
    histogram of lengths (``_Packer``): at most five packings, each about
    O(distinct lengths) but the capped search.
    """
    n_lone = sum(n > budget for n in lengths)
    if all(lengths[i] > budget for i in order[:n_lone]):  # longest first (as a rule): the over-long ones are a prefix
        lone, rest = order[:n_lone], order[n_lone:]
    else:
        lone, rest = [i for i in order if lengths[i] > budget], [i for i in order if lengths[i] <= budget]
    pools = {length: list(ids) for length, ids in itertools.groupby(rest, key=lengths.__getitem__)}
    hist = [(length, len(ids)) for length, ids in pools.items()]  # longest first, as ``rest`` is
    cap = max_seqs or math.inf
    bound = math.ceil(lower_bound_bins(lengths, budget, max_seqs=max_seqs) / W)

    def lpt(n_steps: int) -> Optional[_Packer]:
        packer = _Packer(hist, budget, cap, seq_cost)
        n_rest = n_steps * W - len(lone)
        if n_rest <= 0:
            return None if rest else packer
        # over-long sequences fill whole steps, costliest first; the last one may have free slots
        n_heavy = min(n_rest, (-len(lone)) % W)
        return packer if packer.lpt(n_rest, n_heavy) else None

    n_steps, packer = bound, lpt(bound)
    if packer is None:
        bfd = _Packer(hist, budget, cap, seq_cost)
        bfd.bfd()
        enough = math.ceil((len(lone) + bfd.n_bins()) / W)
        n_search = bound * W - len(lone)  # the micro-batches the bound leaves for the rest
        if enough > bound and 0 < n_search <= _SEARCH_BINS:  # one micro-batch less would save a step: search for it
            exact = _Packer(hist, budget, cap, seq_cost)
            if exact.search(n_search, _search_work(len(rest))):
                packer, enough = exact, bound
    if packer is None:
        for n_steps in sorted({bound + 1, enough}) if enough > bound else ():
            packer = lpt(n_steps)
            if packer is not None:
                break
        if packer is None:  # BFD's micro-batches, and a few empty ones the refinement below can fill
            n_steps, packer = max(bound, enough), bfd
    bins = _Bins(lengths, costs, budget, "packed", cost_model, max_seqs)
    for i in lone:
        bins.add_bin([i], presorted=True)
    groups = packer.groups(pools)
    empty = n_steps * W - len(lone) - len(groups)
    bins.add_bins(groups + [[] for _ in range(empty)], packer.values() + [(0, 0.0)] * empty)
    return bins, n_steps
