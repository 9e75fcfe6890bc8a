"""The packed planner's exact search for a packing into a given number of micro-batches (``_Completion``): bin
completion on the histogram of lengths, for steps where best-fit decreasing leaves one micro-batch over."""

from __future__ import annotations

import bisect
import math
from typing import Optional, Sequence


class _Completion:
    """Bin completion (Korf, 2002-2003), on the histogram of lengths: micro-batch after micro-batch, each takes the
    longest sequence left plus one set of the others (a multiset of lengths, so sequences of one length are never
    tried in two orders), the fullest sets first.

    Pruned four ways: a set must be undominated (``_undominated``: maximal,
    and no sequence left out can take the place of shorter ones in it); the
    rooms left over, summed, may not exceed the slack ``n_bins × B − Σ
    lengths``; the micro-batches left must be able to hold the sequences left
    (``_too_many``: none holds more than the shortest ones whose sum fits);
    and a histogram left over that failed once is not searched again. None of
    them loses a packing: what they prune leads to none, or (a dominated set)
    to none that a fuller set tried in its place does not lead to.

    ``budget`` is the work left (lengths looked at); below 0 the search gives up.
    """

    def __init__(self, hist: Sequence[tuple[int, int]], budget: int, cap: float, work: int):
        self.budget, self.cap, self.work_left = budget, cap, work
        self.lengths = [length for length, _ in hist]  # longest first
        self.left = [k for _, k in hist]
        self.m = len(self.lengths)
        self.slack = 0
        self.failed: set = set()
        self.chosen: list[list[tuple[int, int]]] = []  # per micro-batch: (index into lengths, count)

    def run(self, n_bins: int) -> Optional[list[list[tuple[int, int]]]]:
        """Every micro-batch's (index into the lengths, count) of a packing into ``n_bins``; None when there is none or
        the budget ran out. Call once, with sequences to pack."""
        total = sum(length * k for length, k in zip(self.lengths, self.left))
        self.slack = n_bins * self.budget - total
        if n_bins <= 0 or self.slack < 0 or sum(self.left) > n_bins * self.cap:
            return None
        return self.chosen if self._solve(n_bins, 0) else None

    def _solve(self, bins: int, waste: int) -> bool:
        left = self.left
        a = next((d for d in range(self.m) if left[d]), self.m)
        if a == self.m:
            return True
        key = (bins, tuple(left))
        if key in self.failed:
            return False
        if bins == 0 or self._too_many(bins):
            return False
        left[a] -= 1
        room = self.budget - self.lengths[a]
        options = self._fills(a, room, room - (self.slack - waste), self.cap - 1)
        if self.work_left < 0:
            left[a] += 1
            return False
        options.sort(key=lambda o: o[0])  # the fullest first (stable: longer lengths first among equals)
        for room, picked in options:
            for d, t in picked:
                left[d] -= t
            self.chosen.append([(a, 1)] + picked)
            if self._solve(bins - 1, waste + room):
                return True
            self.chosen.pop()
            for d, t in picked:
                left[d] += t
            if self.work_left < 0:
                break
        left[a] += 1
        if self.work_left >= 0:
            self.failed.add(key)
        return False

    def _fills(self, a: int, room: int, need: int, seats: float) -> list[tuple[int, list[tuple[int, int]]]]:
        """Every undominated set of the lengths from index a on that takes between ``need`` and ``room`` tokens, with
        the room each leaves; [] when the budget ran out."""
        out: list[tuple[int, list[tuple[int, int]]]] = []
        return out if self._walk(a, room, seats, room - need, out, []) else []

    def _walk(self, d: int, room: int, seats: float, most_room: int, out: list, picked: list[tuple[int, int]]) -> bool:
        """Sets that add lengths from index d on to ``picked`` within ``room`` and ``seats``, leaving at most
        ``most_room``, appended to ``out``; False when the budget ran out."""
        lengths, left, m = self.lengths, self.left, self.m
        while d < m and (not left[d] or lengths[d] > room):
            d += 1
        self.work_left -= 1 + m - d  # the lengths looked at below
        if self.work_left < 0:
            return False
        if room - sum(min(left[e], room // lengths[e]) * lengths[e] for e in range(d, m)) > most_room:
            return True  # what is left to take cannot fill the set as full as it must be
        if d == m or not seats:  # nothing more fits: kept if full enough and undominated
            if room <= most_room and self._undominated(room, seats, picked):
                out.append((room, list(picked)))
            return True
        length = lengths[d]
        for t in range(int(min(left[d], room // length, seats)), -1, -1):  # more of the longer lengths first
            if t:
                left[d] -= t
                picked.append((d, t))
            ok = self._walk(d + 1, room - t * length, seats - t, most_room, out, picked)
            if t:
                left[d] += t
                picked.pop()
            if not ok:
                return False
        return True

    def _undominated(self, room: int, seats: float, picked: list[tuple[int, int]]) -> bool:
        """False when a packing that holds this set as a micro-batch becomes one that holds a fuller set instead: a
        sequence left out fits in the room (the set is not maximal), or takes the place of a shorter sequence of the
        set within the room, or (with no cap on sequences) of two whose sum is at most its length. (Martello and
        Toth's dominance, 1990.) The set's first sequence, the longest left, stays."""
        lengths, left, m = self.lengths, self.left, self.m
        looked = 1
        if seats:
            e = m - 1
            while e >= 0 and not left[e]:
                e -= 1
            looked += m - e
            if e >= 0 and lengths[e] <= room:
                self.work_left -= looked
                return False
        for d, _ in picked:  # the next longer length left out, within the room of this one's place
            e = d - 1
            while e >= 0 and not left[e]:
                e -= 1
            looked += d - e
            if e >= 0 and lengths[e] <= lengths[d] + room:
                self.work_left -= looked
                return False
        self.work_left -= looked
        if self.cap < math.inf or sum(t for _, t in picked) < 2:  # a cap: two giving way to one may overfill one
            return True
        return not self._pair_gives_way(room, picked)

    def _pair_gives_way(self, room: int, picked: list[tuple[int, int]]) -> bool:
        """Whether two sequences of the set, their sum at most the length of one left out, can give way to it within
        the room."""
        lengths, left, m = self.lengths, self.left, self.m
        longest_out = next((lengths[e] for e in range(m) if left[e]), 0)
        shortest = [lengths[d] for d, t in picked[-2:] for _ in range(min(t, 2))][-2:]
        if sum(shortest) > longest_out:
            return False  # no two of the set are as short as the longest left out
        inside = [lengths[d] for d, _ in picked]
        pairs = [y + inside[j] for i, (y, (_, t)) in enumerate(zip(inside, picked)) for j in range(i + (t < 2),
                                                                                                  len(inside))]
        self.work_left -= m + len(pairs)
        outside = [lengths[e] for e in range(m - 1, -1, -1) if left[e]]  # left out, shortest first
        for p in pairs:
            if p <= longest_out:
                e = bisect.bisect_left(outside, p)
                if outside[e] <= p + room:
                    return True
        return False

    def _too_many(self, bins: int) -> bool:
        """True when more sequences are left than ``bins`` micro-batches can hold: none holds more than the shortest
        ones left whose sum fits the budget (nor more than the cap)."""
        self.work_left -= self.m
        n_left, most, room = 0, 0, self.budget
        for d in range(self.m - 1, -1, -1):  # shortest first
            k, length = self.left[d], self.lengths[d]
            n_left += k
            if k and room >= 0:
                t = min(k, room // length) if length else k
                most += t
                room = room - t * length if t == k else -1  # -1: a shorter one is left out, no longer one fits
        return n_left > bins * min(most, self.cap)
