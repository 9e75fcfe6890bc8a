"""Corpus packers of other projects, written here from their published algorithms, to measure ``balance_batch.pack``
against: rows of at most ``capacity`` tokens, every sequence once. Each returns the rows' count and, where the
algorithm itself assigns sequences (per-sequence packers), the rows as lists of indices.

- TRL ``pack_dataset(strategy="bfd")``: best-fit decreasing, one sequence at a time, the fullest row with room found
  through a segment tree over remaining space (``trl/data_utils.py``).
- torchtune ``PackedDataset``: greedy in dataset order, a new pack whenever the next sequence does not fit
  (``torchtune/datasets/_packed.py``).
- NeMo-RL's first-fit decreasing and modified first-fit decreasing: ``harness.peers.nemo_rl``.
- The packed-BERT histogram packers (Krell et al. 2021): LPFHP (the fullest pack that fits, as many copies of the
  length as fit) and SPFHP (the emptiest pack that fits, one copy a round), at most ``max_seqs`` sequences a pack
  (3 in the paper's runs). They return pack strategies with counts, not sequence ids, as published.

A sequence over the capacity is given a row of its own by every packer here (TRL truncates it, torchtune refuses
it, the histogram packers take lengths up to the capacity only), so all of them pack the same sequences.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class _SpaceTree:
    """Which remaining spaces (1..capacity) some row has, and the smallest one ≥ x, in O(log capacity)."""

    def __init__(self, capacity: int):
        size = 1
        while size < capacity + 1:
            size *= 2
        self.size = size
        self.best = [0] * (2 * size)  # per node: the largest space present below it (0: none)

    def set(self, space: int, present: bool) -> None:
        i = space + self.size
        self.best[i] = space if present else 0
        i //= 2
        while i:
            self.best[i] = max(self.best[2 * i], self.best[2 * i + 1])
            i //= 2

    def smallest_at_least(self, x: int) -> int:
        """The smallest space ≥ x present, or 0."""
        if self.best[1] < x:
            return 0
        i = 1
        while i < self.size:  # go left while the left subtree has a space ≥ x
            i = 2 * i if self.best[2 * i] >= x else 2 * i + 1
        return i - self.size


def trl_bfd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing, sequence by sequence (ties: the longer first, then by index)."""
    tree = _SpaceTree(capacity)
    by_space: dict[int, list[int]] = {}
    rows: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        if n > capacity:
            rows.append([i])
            continue
        space = tree.smallest_at_least(n)
        if space:
            ids = by_space[space]
            r = ids.pop()
            if not ids:
                del by_space[space]
                tree.set(space, False)
        else:
            r, space = len(rows), capacity
            rows.append([])
        rows[r].append(i)
        left = space - n
        if left:
            if left not in by_space:
                by_space[left] = []
                tree.set(left, True)
            by_space[left].append(r)
    return rows


def torchtune_greedy(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """In dataset order: a sequence joins the current pack while it fits, else starts the next one."""
    rows: list[list[int]] = []
    room = -1
    for i, n in enumerate(lengths):
        if n > room:
            rows.append([i])
            room = capacity - n
        else:
            rows[-1].append(i)
            room -= n
    return rows


def _histogram(lengths: Sequence[int], capacity: int) -> tuple[np.ndarray, int]:
    arr = np.asarray(lengths, dtype=np.int64)
    over = int(np.count_nonzero(arr > capacity))
    return np.bincount(arr[arr <= capacity], minlength=capacity + 1), over


def histogram_packer(lengths: Sequence[int], capacity: int, fullest: bool, max_seqs: Optional[int] = 3
                     ) -> list[tuple[int, tuple[int, ...]]]:
    """LPFHP (``fullest``) or SPFHP over the histogram: (count, pack) strategies, an oversize sequence one each."""
    hist, over = _histogram(lengths, capacity)
    cap = max_seqs or capacity
    open_: dict[int, list[list]] = {}  # remaining space -> [count, pack] strategies still open
    done: list[tuple[int, tuple[int, ...]]] = [(over, ())] if over else []

    def add(count: int, pack: tuple, space: int) -> None:
        if not count:
            return
        if space == 0 or len(pack) >= cap:
            done.append((count, pack))
        else:
            open_.setdefault(space, []).append([count, pack])

    for length in range(capacity, 0, -1):
        k = int(hist[length])
        while k > 0:
            fits = [s for s in open_ if s >= length]
            if not fits:
                per = min(capacity // length, cap) if fullest else 1
                add(k // per, (length,) * per, capacity - per * length)
                if k % per:
                    add(1, (length,) * (k % per), capacity - (k % per) * length)
                break
            space = min(fits) if fullest else max(fits)
            strategies = open_[space]
            count, pack = strategies.pop()
            if not strategies:
                del open_[space]
            per = min(space // length, cap - len(pack), k) if fullest else 1
            used = min(count, k // per)
            add(count - used, pack, space)
            add(used, pack + (length,) * per, space - per * length)
            k -= used * per
    for strategies in open_.values():
        done += [(c, p) for c, p in strategies]
    return done


def rows_of(strategies: list[tuple[int, tuple[int, ...]]]) -> int:
    return sum(count for count, _ in strategies)
