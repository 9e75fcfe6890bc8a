"""What moving a sequence out of one micro-batch into another, or swapping it with one of the other's, would make of
the two, for many of them at once (numpy): the options steps 4 and 5 of the balanced planner search (``_Table``).

An option takes sequence i out of micro-batch j and puts it into micro-batch k:
a plain move (column 0), or a swap that takes k's c-th candidate
(``_Bins.candidates``) back into j (column c). A search goes pair by pair
(j, i), over the same targets k, every option of a target in turn; each option
counts as one evaluation, and a pair is only started while the evaluations
spent are below the search's budget. Options are kept in that order, so the
first best of them is the first best a loop over the options would keep.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional, Sequence

import numpy as np

from balance_batch.balanced.bins import _CANDIDATES, _Bins

_CHUNK = 1 << 16  # options evaluated together, at most (memory)


class _Options(NamedTuple):
    """Options as flat arrays, in search order: sequence i leaves j for k, ``back`` (-1: none) leaves k for j."""

    j: np.ndarray
    i: np.ndarray
    k: np.ndarray
    back: np.ndarray
    cost_k: np.ndarray  # k's cost after
    fit_k: np.ndarray  # k within the budget and the cap after
    cost_j: np.ndarray  # j's cost after
    fit_j: np.ndarray  # j within the budget and the cap after


class _Table:
    """The micro-batches as numpy rows (count, tokens, cost, candidates, two longest), filled when first needed and
    again after a change (``stale``).

    Costs after an option are computed as ``_Bins`` does, operation for
    operation, so they are the same floats: packed, the micro-batch's cost
    less the leaving sequence's plus the arriving one's; padded, the count
    times the cost of the longest sequence staying or arriving (a sequence's
    cost being the cost model's of its length).
    """

    def __init__(self, bins: _Bins):
        self.bins = bins
        # one more entry, at index -1: no sequence, of length 0 and cost 0.0
        self.L = np.append(np.asarray(bins.L, dtype=np.int64), 0)
        self.c = np.append(np.asarray(bins.c, dtype=np.float64), 0.0)
        n = len(bins.items)
        self.ready = np.array([not items for items in bins.items], dtype=bool)  # an empty row is as made below
        self.count = np.zeros(n, dtype=np.int64)
        self.tok = np.zeros(n, dtype=np.int64)
        self.cost = np.zeros(n)
        self.cand = np.full((n, 1 + (_CANDIDATES if bins.packed else 2)), -1, dtype=np.int64)  # column 0: the move
        self.head = np.full((n, 2), -1, dtype=np.int64)  # the two longest sequences (padded: what sets the cost)

    def stale(self, j: int) -> None:
        self.ready[j] = False

    def fill(self, ks: np.ndarray) -> None:
        """Rows ks up to date."""
        stale = ks[~self.ready[ks]]
        if not len(stale):
            return
        b = self.bins
        rows = list(dict.fromkeys(stale.tolist()))
        items = [b.items[j] for j in rows]
        self.count[rows] = [len(x) for x in items]
        self.tok[rows] = [b.tok[j] for j in rows]
        self.cost[rows] = [b.cost[j] for j in rows]
        self.head[rows, 0] = [x[0] if x else -1 for x in items]
        self.head[rows, 1] = [x[1] if len(x) > 1 else -1 for x in items]
        cands = [b.candidates(j) for j in rows]
        sizes = np.array([len(x) for x in cands], dtype=np.int64)
        at = np.repeat(np.cumsum(sizes) - sizes, sizes)  # where each row's candidates start in the flat list
        self.cand[rows, 1:] = -1
        self.cand[np.repeat(rows, sizes), 1 + np.arange(len(at)) - at] = list(itertools.chain.from_iterable(cands))
        self.ready[rows] = True

    def real(self, ks: np.ndarray) -> np.ndarray:
        """Which options of a pair each target in ``ks`` (any shape) has: ks.shape + (1 + candidates,), column 0 (the
        move) always; how many there are is what a pair costs. Fills their rows."""
        self.fill(ks.ravel())
        real = self.cand[ks] >= 0
        real[..., 0] = True
        return real

    def options(self, j: np.ndarray, i: np.ndarray, k: np.ndarray, column: np.ndarray) -> _Options:
        """Options (flat arrays, rows j and k filled): i leaves j for k, and k's candidate ``column`` (0: none) leaves
        k for j."""
        back = self.cand[k, column]
        move = column == 0
        n_k = self.count[k] + move
        n_j = self.count[j] - move
        if self.bins.packed:
            L, c = self.L, self.c
            tok_k, cost_k = self.tok[k] - L[back] + L[i], self.cost[k] - c[back] + c[i]
            tok_j, cost_j = self.tok[j] - L[i] + L[back], self.cost[j] - c[i] + c[back]
        else:
            head = self.head
            tok_k, cost_k = self._padded(n_k, np.where(head[k, 0] != back, head[k, 0], head[k, 1]), i)
            tok_j, cost_j = self._padded(n_j, np.where(head[j, 0] != i, head[j, 0], head[j, 1]), back)
        empty = n_j == 0  # j gave its only sequence away
        tok_j, cost_j = np.where(empty, 0, tok_j), np.where(empty, 0.0, cost_j)
        return _Options(j, i, k, back, cost_k, self._fits(tok_k, n_k), cost_j, self._fits(tok_j, n_j))

    def _padded(self, count: np.ndarray, stay: np.ndarray, arrive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A padded micro-batch's tokens and cost: ``count`` times the longer of ``stay`` (its longest left) and
        ``arrive`` (ties: the one staying; -1: no sequence)."""
        L_stay, L_arrive = self.L[stay], self.L[arrive]
        take = (L_arrive > L_stay) | (stay < 0)
        return count * np.where(take, L_arrive, L_stay), count * np.where(take, self.c[arrive], self.c[stay])

    def _fits(self, tok: np.ndarray, count: np.ndarray) -> np.ndarray:
        return (count <= 1) | ((tok <= self.bins.budget) & (count <= self.bins.cap))


def _pairs_within(n_pairs: int, per_pair: int, budget: int) -> int:
    """How many of ``n_pairs`` pairs a search starts: each while fewer than ``budget`` evaluations are spent."""
    return n_pairs if per_pair == 0 else max(0, min(n_pairs, -(-budget // per_pair)))


class _Best:
    """The first option of the largest gain above ``floor``, over blocks of options offered in search order."""

    def __init__(self, floor: float):
        self.gain = floor
        self.found: Optional[tuple[tuple, int]] = None  # the block it is of, and its index there

    def offer(self, gains: np.ndarray, block: tuple) -> None:
        """The ``gains`` of a block of options (-inf where one is not allowed); ``block`` is kept with the best."""
        if len(gains):
            at = int(np.argmax(gains))
            if gains[at] > self.gain:
                self.gain, self.found = float(gains[at]), (block, at)


def _move(o: _Options, at: int) -> tuple[int, Optional[int], int]:
    """(i, the sequence taken back or None, k) of option ``at``."""
    back = int(o.back[at])
    return int(o.i[at]), None if back < 0 else back, int(o.k[at])


def _layout(real: np.ndarray, n_pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Options in search order over groups g, each its first ``n_pairs[g]`` pairs over its targets' options
    ``real[g]`` (targets x columns): per option, (group, pair, target, column).

    Group after group, pair after pair, target after target, column after column.
    """
    g_opt, t_opt, c_opt = np.nonzero(real)
    per_pair = np.bincount(g_opt, minlength=len(real))
    first_opt = np.cumsum(per_pair) - per_pair
    sizes = np.asarray(n_pairs, dtype=np.int64) * per_pair
    group = np.repeat(np.arange(len(real)), sizes)
    at = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # within its group
    width = per_pair[group]
    opt = first_opt[group] + at % width
    return group, at // width, t_opt[opt], c_opt[opt]


def _chunks(n_pairs: int, per_pair: int) -> Sequence[range]:
    """Pairs in groups of at most ``_CHUNK`` options (one pair at least)."""
    step = max(1, _CHUNK // max(1, per_pair))
    return [range(a, min(n_pairs, a + step)) for a in range(0, n_pairs, step)]
