"""Steps 1-2 of the balanced planner, packed: how many steps, and the sequences laid into micro-batches of about equal
cost, on the histogram of lengths (``_Packer``: longest-processing-time first, an exact search for few sequences,
best-fit decreasing)."""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Optional, Sequence

from balance_batch.balanced.bins import _Bins
from balance_batch.cost import CostModel
from balance_batch.stats import lower_bound_bins

# Packed, at most this many sequences within the budget: where LPT misses the fewest steps, an exact search of at
# most _EXACT_NODES placements looks for them (a few milliseconds)
_EXACT_MAX = 16
_EXACT_NODES = 20_000


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
