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
first; sequences of one length are taken in index order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from balance_batch.balanced.packed import _Packer  # the balanced planner's histogram packer
from balance_batch.errors import check_choice, positive_int
from balance_batch.stats import lower_bound_from_histogram

OVERSIZE = ("alone", "error")  # a sequence longer than the capacity: a row of its own, or a ValueError


@dataclass(frozen=True)
class Packing:
    """Rows of sequence indices as two arrays; ``lengths`` are the input's, for the statistics."""

    indices: np.ndarray  # int64, every sequence index once, row after row
    offsets: np.ndarray  # int64, rows + 1 entries: row r is indices[offsets[r]:offsets[r + 1]]
    capacity: int
    lengths: np.ndarray  # int64, the packed sequences' lengths, by index
    lower_bound: int  # the fewest rows any packing can have (``balance_batch.stats.lower_bound_from_histogram``)

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.rows

    def row(self, r: int) -> np.ndarray:
        return self.indices[self.offsets[r] : self.offsets[r + 1]]

    def row_tokens(self) -> np.ndarray:
        """Real tokens in each row (an oversize row holds more than the capacity)."""
        if not self.rows:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(self.lengths[self.indices], self.offsets[:-1])

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

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


def _as_lengths(lengths: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"pack: lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.mod(arr, 1) == 0):
            raise ValueError(f"pack: lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 1:
        i = int(np.argmin(arr))
        raise ValueError(f"pack: lengths[{i}] = {int(arr[i])}: every sequence needs at least 1 token")
    return arr


def pack(lengths: Union[Sequence[int], np.ndarray], capacity: int, *, max_seqs_per_row: Optional[int] = None,
         oversize: str = "alone") -> Packing:
    """Every sequence into rows of at most ``capacity`` tokens (at most ``max_seqs_per_row`` sequences each).

    ``oversize``: a sequence longer than ``capacity`` gets a row of its own
    (``"alone"``, the rows first, longest first) or is refused (``"error"``: a
    ValueError naming the first). Raises ValueError on a bad argument.
    """
    capacity = positive_int("capacity", capacity, who="pack")
    positive_int("max_seqs_per_row", max_seqs_per_row, none_ok=True, who="pack")
    check_choice("oversize", oversize, OVERSIZE, who="pack")
    arr = _as_lengths(lengths)
    n = arr.size
    over = arr > capacity
    n_over = int(np.count_nonzero(over))
    if n_over and oversize == "error":
        i = int(np.argmax(over))
        raise ValueError(f"pack: lengths[{i}] = {int(arr[i])} is over the capacity {capacity} "
                         "(oversize='alone' gives it a row of its own)")
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
    bound = lower_bound_from_histogram(hist, capacity, n_over, max_seqs_per_row)
    return Packing(indices, offsets, capacity, arr, bound)


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
