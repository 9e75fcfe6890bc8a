"""Pack a corpus offline: every sequence into rows of at most ``capacity`` tokens, laid end to end, as arrays.

``pack(lengths, capacity)`` plans on the histogram of lengths (sequences of one
length are interchangeable, and so are rows that hold the same lengths), then
hands out sequence ids in one vectorised pass. The planning is best-fit
decreasing over groups of identical rows, the same packer the balanced planner
uses for its packed micro-batches; its cost grows with the number of distinct
lengths, not of sequences. Only the final assignment is proportional to the
corpus: a stable radix sort of the lengths and one strided copy per group.

The result is two arrays, never a Python list per row: ``indices`` (every
sequence index, row after row) and ``offsets`` (rows + 1 entries; row ``r`` is
``indices[offsets[r]:offsets[r + 1]]``). Within a row the sequences run longest
first; sequences of one length are taken in index order. Where a row holds part
of a sequence (``oversize="truncate"`` or ``"split"``, ``strategy="wrapped"``),
two more arrays say which tokens: ``piece_starts`` and ``piece_lengths``, one
entry per slot of ``indices``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from balance_batch.balanced.packed import _SEARCH_BINS, _Packer, _search_work  # the balanced planner's packer
from balance_batch.errors import check_choice, checked_lengths, positive_int
from balance_batch.stats import lower_bound_from_histogram

# a sequence longer than the capacity: a row of its own, a ValueError, its first ``capacity`` tokens, or cut into
# pieces of ``capacity`` tokens and a remainder, each packed like a sequence
OVERSIZE = ("alone", "error", "truncate", "split")
# best-fit decreasing (whole sequences, or pieces as ``oversize`` says), or every sequence in order, cut into rows of
# exactly ``capacity`` tokens (the pre-training layout)
STRATEGIES = ("bfd", "wrapped")


def _no_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Packing:
    """Rows of sequence indices as two arrays; ``lengths`` are the input's, for the statistics.

    A slot of a row is a whole sequence unless ``piece_starts``/``piece_lengths`` are given: then slot ``k`` holds
    the tokens ``[piece_starts[k], piece_starts[k] + piece_lengths[k])`` of sequence ``indices[k]`` (a split
    sequence's id appears once per piece). ``pieces(r)`` gives them for any packing.
    """

    indices: np.ndarray  # int64, every packed sequence index (once per piece), row after row
    offsets: np.ndarray  # int64, rows + 1 entries: row r is indices[offsets[r]:offsets[r + 1]]
    capacity: int
    lengths: np.ndarray  # int64, the input's lengths, by index
    lower_bound: int  # the fewest rows any packing can have (``balance_batch.stats.lower_bound_from_histogram``)
    piece_starts: Optional[np.ndarray] = None  # int64 per slot: the piece's first token; None: whole sequences
    piece_lengths: Optional[np.ndarray] = None  # int64 per slot: the piece's tokens; None: whole sequences
    empty: np.ndarray = field(default_factory=_no_ids)  # ids of 0-token sequences, placed in no row
    truncated: np.ndarray = field(default_factory=_no_ids)  # ids cut to their first ``capacity`` tokens

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.rows

    def row(self, r: int) -> np.ndarray:
        """Row r's sequence ids (a piece's id as often as the row holds pieces of it)."""
        return self.indices[self.offsets[r] : self.offsets[r + 1]]

    def pieces(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row r as (ids, first tokens, token counts): what a dataset slices, ``seq[start:start + length]``."""
        lo, hi = self.offsets[r], self.offsets[r + 1]
        ids = self.indices[lo:hi]
        if self.piece_starts is None:
            return ids, np.zeros(len(ids), dtype=np.int64), self.lengths[ids]
        return ids, self.piece_starts[lo:hi], self.piece_lengths[lo:hi]

    def slot_lengths(self) -> np.ndarray:
        """Tokens in each slot of ``indices``."""
        return self.lengths[self.indices] if self.piece_lengths is None else self.piece_lengths

    def row_tokens(self) -> np.ndarray:
        """Real tokens in each row (an oversize row with ``oversize="alone"`` holds more than the capacity)."""
        if not self.rows:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(self.slot_lengths(), self.offsets[:-1])

    @property
    def tokens(self) -> int:
        """Tokens the rows hold (a truncated sequence's kept tokens only)."""
        return int(self.lengths.sum() if self.piece_lengths is None else self.piece_lengths.sum())

    @property
    def efficiency(self) -> float:
        """Real tokens ÷ the tokens the rows hold when each is padded to the capacity (an oversize row to its own
        length): 1.0 is no padding at all."""
        computed = int(np.maximum(self.row_tokens(), self.capacity).sum())
        return self.tokens / computed if computed else 1.0

    @property
    def bound_ratio(self) -> float:
        """The lower bound on rows ÷ the rows used: 1.0 is a packing no algorithm can beat."""
        return self.lower_bound / self.rows if self.rows else 1.0


def _as_lengths(lengths: Union[Sequence[int], np.ndarray]) -> tuple[np.ndarray, int]:
    """The lengths as int64 (``errors.checked_lengths``), and the shortest (0 for none)."""
    arr = checked_lengths(lengths, "pack")
    return arr, int(arr.min()) if arr.size else 0


def pack(lengths: Union[Sequence[int], np.ndarray], capacity: int, *, max_seqs_per_row: Optional[int] = None,
         oversize: Optional[str] = None, strategy: str = "bfd") -> Packing:
    """Pack a whole corpus offline: every sequence into rows of at most ``capacity`` tokens, laid end to end.

    Best-fit decreasing over the histogram of lengths (the balanced planner's packer), so its cost grows with the
    distinct lengths, not the sequences; the result is arrays, never a list per row. ``python -m balance_batch.pack``
    does the same on a lengths file.

    Args:
        lengths: each sequence's token count (non-negative integers; a sequence of 0 tokens goes in no row and its
            id is in ``Packing.empty``).
        capacity: the most tokens a row holds.
        max_seqs_per_row: at most this many sequences in a row (None: no cap).
        oversize: what becomes of a sequence longer than ``capacity``: ``"alone"`` (a row of its own, the default;
            those rows first), ``"error"`` (a ValueError naming the first), ``"truncate"`` (its first ``capacity``
            tokens; its id in ``Packing.truncated``) or ``"split"`` (pieces of ``capacity`` tokens and a remainder,
            each packed like a sequence).
        strategy: ``"bfd"`` (best-fit decreasing, whole sequences or pieces) or ``"wrapped"`` (every sequence end to
            end in index order, cut into rows of exactly ``capacity`` tokens; a sequence may run on into the next row;
            ``oversize`` and ``max_seqs_per_row`` do not apply).

    Returns:
        A ``Packing``: ``indices`` and ``offsets`` (row ``r`` is ``indices[offsets[r]:offsets[r + 1]]``, longest
        first), ``lower_bound`` (the fewest rows any packing can have), ``efficiency``, and ``pieces(r)`` where a
        row holds part of a sequence.

    Raises:
        ValueError: one line naming the first bad argument (or, with ``oversize="error"``, the first sequence over
            the capacity) and what would be valid.

    Example:
        >>> packing = pack([900, 300, 300, 200, 100, 1500], 1000)
        >>> [packing.row(r).tolist() for r in range(packing.rows)], packing.lower_bound
        ([[5], [0, 4], [1, 2, 3]], 3)
    """
    capacity = positive_int("capacity", capacity, who="pack")
    positive_int("max_seqs_per_row", max_seqs_per_row, none_ok=True, who="pack")
    check_choice("strategy", strategy, STRATEGIES, who="pack")
    if oversize is not None:
        check_choice("oversize", oversize, OVERSIZE, who="pack")
    arr, shortest = _as_lengths(lengths)
    if strategy == "wrapped":
        given = [f"{k}={v!r}" for k, v in (("oversize", oversize), ("max_seqs_per_row", max_seqs_per_row)) if v]
        if given:
            verb, pronoun = ("do", "them") if len(given) > 1 else ("does", "it")
            raise ValueError(f"pack: {' and '.join(given)} {verb} not apply to strategy='wrapped' (it cuts every row "
                             f"at exactly the capacity); leave {pronoun} unset or use strategy='bfd'")
        return _wrapped(arr, capacity)
    oversize = oversize or "alone"
    placed = np.flatnonzero(arr) if shortest == 0 else None  # the sequences with tokens, where some have none
    empty = np.flatnonzero(arr == 0) if placed is not None else _no_ids()
    over = arr > capacity
    n_over = int(np.count_nonzero(over))
    if n_over and oversize == "error":
        i = int(np.argmax(over))
        raise ValueError(f"pack: lengths[{i}] = {int(arr[i])} is over the capacity {capacity} "
                         "(oversize='alone' gives it a row of its own, 'truncate' cuts it, 'split' packs its pieces)")
    if not n_over or oversize in ("alone", "error"):
        indices, offsets, bound = _best_fit(arr if placed is None else arr[placed], capacity, max_seqs_per_row)
        if placed is not None:
            indices = placed[indices]
        return Packing(indices, offsets, capacity, arr, bound, empty=empty)
    if oversize == "truncate":
        kept = np.minimum(arr if placed is None else arr[placed], capacity)
        indices, offsets, bound = _best_fit(kept, capacity, max_seqs_per_row)
        kept = kept[indices]
        if placed is not None:
            indices = placed[indices]
        return Packing(indices, offsets, capacity, arr, bound, np.zeros(len(indices), dtype=np.int64), kept,
                       empty=empty, truncated=np.flatnonzero(over))
    # split: each sequence as ceil(length / capacity) pieces, in index order, each packed like a sequence
    per_item = np.maximum(-(-arr // capacity), 0)
    items = np.repeat(np.arange(arr.size, dtype=np.int64), per_item)
    first = np.cumsum(per_item) - per_item  # each item's first piece
    starts = (np.arange(items.size, dtype=np.int64) - first[items]) * capacity
    piece_lengths = np.minimum(arr[items] - starts, capacity)
    slots, offsets, bound = _best_fit(piece_lengths, capacity, max_seqs_per_row)
    return Packing(items[slots], offsets, capacity, arr, bound, starts[slots], piece_lengths[slots], empty=empty)


def _wrapped(arr: np.ndarray, capacity: int) -> Packing:
    """Every sequence end to end in index order, cut into rows of exactly ``capacity`` tokens (the last: the rest).

    A piece starts where a sequence (of 1 token or more) starts, or where a row starts inside a sequence: two sorted
    runs merged by position (no sort: a sort of the merged starts took 50 s on 16.3 million)."""
    ids = np.flatnonzero(arr)  # the sequences with tokens, in order
    ends = np.cumsum(arr[ids])
    item_starts = ends - arr[ids]
    total = int(ends[-1]) if ids.size else 0
    row_starts = np.arange(-(-total // capacity), dtype=np.int64) * capacity
    holder = np.searchsorted(item_starts, row_starts, side="right") - 1  # the sequence each row starts in
    inner = item_starts[holder] != row_starts  # a row that starts inside a sequence cuts a piece there
    cuts, cut_in = row_starts[inner], holder[inner]
    # each start's place among all starts: its own index plus the starts of the other run before it
    at_item = np.arange(ids.size) + np.searchsorted(cuts, item_starts)
    at_cut = np.arange(cuts.size) + cut_in + 1
    starts = np.empty(ids.size + cuts.size, dtype=np.int64)
    which = np.empty(starts.size, dtype=np.int64)  # position in ids
    starts[at_item], which[at_item] = item_starts, np.arange(ids.size)
    starts[at_cut], which[at_cut] = cuts, cut_in
    piece_lengths = np.diff(starts, append=total)
    offsets = np.append(np.searchsorted(starts, row_starts), starts.size).astype(np.int64)
    return Packing(ids[which], offsets, capacity, arr, row_starts.size, starts - item_starts[which], piece_lengths,
                   empty=np.flatnonzero(arr == 0))


def _best_fit(arr: np.ndarray, capacity: int, max_seqs_per_row: Optional[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """Rows of indices into ``arr`` (every length ≥ 1) by best-fit decreasing on its histogram, an oversize one
    alone, as (indices, offsets, lower bound); where BFD takes more rows than the bound and the bound is a few rows,
    the balanced planner's exact search (capped) for the bound's rows."""
    n = arr.size
    over = arr > capacity
    n_over = int(np.count_nonzero(over))
    # ids grouped by length, each length's in index order: a stable sort (radix on 16 bits) with the oversize ones
    # as one key past the capacity
    key_type = np.uint16 if capacity + 1 < 2**16 else np.uint32
    key = np.minimum(arr, capacity + 1).astype(key_type) if n_over else arr.astype(key_type)
    order = np.argsort(key, kind="stable")
    hist = _histogram(key, capacity + 2)[: capacity + 1]
    start = np.zeros(capacity + 2, dtype=np.int64)
    np.cumsum(hist, out=start[1:])
    cap = max_seqs_per_row or math.inf
    packer = _Packer([(length, int(hist[length])) for length in np.nonzero(hist)[0][::-1].tolist()], capacity, cap,
                     _UNIT_COST)
    packer.bfd()
    n_small = n - n_over
    bound = lower_bound_from_histogram(hist, capacity, n_over, max_seqs_per_row)
    if bound - n_over < packer.n_bins() and bound - n_over <= _SEARCH_BINS:  # few rows, one over: the exact search
        exact = _Packer(packer.hist, capacity, cap, _UNIT_COST)
        if exact.search(bound - n_over, _search_work(n_small)):
            packer = exact
    indices = np.empty(n, dtype=np.int64)
    widths: list[int] = []
    counts: list[int] = []
    # oversize rows first, longest first (ties by index)
    if n_over:
        lone = order[n_small:]
        lone = lone[np.argsort(-arr[lone], kind="stable")]
        indices[:n_over] = lone
        widths.append(1)
        counts.append(n_over)
    pos = n_over
    taken = start[:-1].copy()
    for nb, pattern in zip(packer.nb, packer.pattern):
        if not nb:
            continue
        width = sum(t for _, t in pattern)
        block = indices[pos : pos + nb * width].reshape(nb, width)
        col = 0
        for length, t in pattern:
            at = int(taken[length])
            block[:, col : col + t] = order[at : at + nb * t].reshape(nb, t)
            taken[length] = at + nb * t
            col += t
        pos += nb * width
        widths.append(width)
        counts.append(nb)
    assert pos == n, "pack: every sequence is placed once"
    offsets = np.empty(int(sum(counts)) + 1, dtype=np.int64)
    offsets[0] = end = 0
    for width, nb in zip(widths, counts):  # each group's rows are one width: an arithmetic run, written in place
        run = offsets[end + 1 : end + 1 + nb]
        np.multiply(np.arange(1, nb + 1, dtype=np.int64), width, out=run)
        run += offsets[end]
        end += nb
    return indices, offsets, bound


def _histogram(key: np.ndarray, size: int, chunk: int = 1 << 20) -> np.ndarray:
    """Counts of each key, a chunk at a time: np.bincount copies its input to 64-bit integers first, and a fresh copy
    of a whole corpus's keys is memory the process has never touched (on a virtual machine, the slowest part of a
    call)."""
    counts = np.zeros(size, dtype=np.int64)
    for at in range(0, key.size, chunk):
        counts += np.bincount(key[at : at + chunk], minlength=size)
    return counts


class _UnitCost(dict):
    """Cost = tokens for every length: the packer's cost bookkeeping, which packing alone does not use."""

    def __missing__(self, length: int) -> float:
        return float(length)


_UNIT_COST = _UnitCost()
