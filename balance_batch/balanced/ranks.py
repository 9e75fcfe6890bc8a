"""Step 5 of the balanced planner: which rank runs which micro-batch of each step, the per-rank totals as even as the
steps allow (swaps within steps, then sequences moved between ranks, never past a step's maximum)."""

from __future__ import annotations

from balance_batch.balanced.bins import _CANDIDATES, _Bins
from balance_batch.balanced.steps import _Grid

_MIN_CALL = 50_000  # evaluations one search for a transfer between two ranks may always use
_OVERRUN = 200_000  # the last round of transfers may finish its searches this far past the budget


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
