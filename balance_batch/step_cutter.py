"""The sampler's first part: an epoch's items cut into optimizer steps, a pure function of the dataset's lengths,
the seed, the epoch, the step sizes and what earlier epochs consumed (as ``DistributedSampler.__iter__`` is of its
seed and epoch). No planning and no position here: ``TokenBudgetSampler`` plans the steps and keeps the position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from balance_batch.errors import positive_int

StepSize = Union[int, Sequence[Sequence[int]]]  # a step size: a number, or a ramp [(consumed, size), ...]
WHO = "TokenBudgetSampler"


class EpochCut(NamedTuple):
    """An epoch's steps: ``order`` (its items in order), ``bounds`` (each step's [start, end) in ``order``),
    ``before`` (each step's (tokens, sequences) consumed before it, all epochs) and ``end`` (the same after the
    epoch)."""

    order: np.ndarray
    bounds: list[tuple[int, int]]
    before: list[tuple[int, int]]
    end: tuple[int, int]


def step_ramp(size: StepSize, key: str, who: str = WHO) -> list[tuple[int, int]]:
    """A step size (``key``: tokens_per_step or sequences_per_step) as [(threshold, size), ...] from threshold 0,
    thresholds increasing, or one ValueError."""
    if not isinstance(size, (list, tuple)):
        positive_int(key, size, who=who)
        return [(0, int(size))]
    unit = key.split("_")[0]
    bad = ValueError(f"{who}: {key} must be a positive integer or a schedule [(consumed_{unit}, {key}), ...] "
                     f"starting at 0 with increasing thresholds and positive sizes, got {size!r}")
    try:
        pairs = [(int(c), int(t)) for c, t in size]
    except (TypeError, ValueError):
        raise bad from None
    ok = (pairs and pairs[0][0] == 0 and all(t > 0 for _, t in pairs)
          and all(a[0] < b[0] for a, b in zip(pairs, pairs[1:])))
    if not ok:
        raise bad
    return pairs


def megatron_rampup(rampup, final: StepSize, key: str, who: str = WHO) -> list[tuple[int, int]]:
    """Megatron-LM's ``--rampup-batch-size start increment over`` as a threshold schedule.

    The step size starts at ``start`` and grows by ``increment`` each time over / ((final - start) / increment) more
    sequences (or tokens) are consumed, reaching ``final`` once ``over`` are (Megatron: size = start + increment *
    floor(consumed / (over / increments)), so the j-th increment applies from ceil(j * over / increments) on,
    computed exactly here).
    """
    bad = (f"{who}: rampup must be (start, increment, over) with 0 < start <= {key}, increment > 0 "
           f"dividing {key} - start, and over >= 0 (Megatron-LM's rampup_batch_size), got {rampup!r}")
    if isinstance(final, (list, tuple)):
        raise ValueError(f"{who}: rampup: {key} must then be the final size (a positive integer), not a schedule: "
                         "give one or the other")
    final = positive_int(key, final, who=who)
    try:
        start, increment, over = (int(v) for v in rampup)
        ok = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in rampup)
    except (TypeError, ValueError):
        raise ValueError(bad) from None
    if not ok or not (0 < start <= final and increment > 0 and over >= 0 and (final - start) % increment == 0):
        raise ValueError(bad)
    increments = (final - start) // increment
    pairs: dict[int, int] = {}
    for j in range(increments + 1):  # a later size on the same threshold replaces an earlier one (over < increments)
        pairs[-(-j * over // increments) if increments else 0] = start + j * increment
    return sorted(pairs.items())


def step_size(sequences_per_step, tokens_per_step, rampup, who: str = WHO) -> tuple[str, list[tuple[int, int]], Any]:
    """(what the step size counts, its ramp, ``sequences_per_step`` as a state records it), or one ValueError naming
    ``who`` takes them (the sampler, the stream)."""
    if (sequences_per_step is None) == (tokens_per_step is None):
        raise ValueError(f"{who}: give exactly one of sequences_per_step and tokens_per_step, got "
                         f"{'both' if sequences_per_step is not None else 'neither'}")
    key, size = (("sequences_per_step", sequences_per_step) if tokens_per_step is None
                 else ("tokens_per_step", tokens_per_step))
    ramp = megatron_rampup(rampup, size, key, who) if rampup is not None else step_ramp(size, key, who)
    unit = key.split("_")[0]
    if unit == "tokens":
        return unit, ramp, None
    plain = rampup is None and not isinstance(size, (list, tuple))
    return unit, ramp, int(size) if plain else [list(p) for p in ramp]


def size_at(ramp, consumed: int) -> int:
    """The step size once ``consumed`` sequences (or tokens) were consumed: the ramp's last threshold reached."""
    return next(t for c, t in reversed(ramp) if consumed >= c)


@dataclass(frozen=True, eq=False)
class StepCutter:
    """Cuts an epoch into steps: ``cut(epoch, consumed)`` depends on nothing else.

    ``lengths``: tokens per item (int64); ``groups``: a group id per item or None; ``unit``: what the step size
    counts ("sequences" or "tokens"); ``ramp``: [(threshold, size), ...] from 0.
    """

    lengths: np.ndarray
    groups: Optional[np.ndarray]
    seed: int
    shuffle: bool
    unit: str
    ramp: tuple[tuple[int, int], ...]
    drop_last: bool
    longest_first: bool

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's items in order: a seeded permutation of the items, or with ``groups`` of the groups (each
        group's items together, in index order), groups in the order they first appear; items of 0 tokens left out.
        With ``longest_first``, the unit (item or group) holding the longest item is moved to the front (the first of
        equal longest items in that order), the rest keeping their order."""
        n = len(self.lengths)
        if self.groups is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        else:
            _, first, inv = np.unique(self.groups, return_index=True, return_inverse=True)
            rank = np.empty(len(first), dtype=np.int64)
            rank[np.argsort(first, kind="stable")] = np.arange(len(first))  # groups by first appearance
            if self.shuffle:
                rank = np.random.default_rng([self.seed, epoch]).permutation(len(first))[rank]
            order = np.argsort(rank[inv.ravel()], kind="stable")
        order = order if self.lengths.all() else order[self.lengths[order] > 0]
        if self.longest_first:
            units = self.unit_bounds(order)
            k = int(np.searchsorted(units, int(np.argmax(self.lengths[order])), side="right")) - 1
            a, b = int(units[k]), int(units[k + 1])
            order = np.concatenate([order[a:b], order[:a], order[b:]])
        return order

    def unit_bounds(self, order: np.ndarray) -> np.ndarray:
        """Where each cut unit starts in ``order`` (an item, or a group's items), and its end: len(units) + 1."""
        if self.groups is None:
            return np.arange(len(order) + 1)
        g = self.groups[order]
        return np.concatenate([[0], np.flatnonzero(g[1:] != g[:-1]) + 1, [len(order)]])

    def size_at(self, consumed: int) -> int:
        """The step size once ``consumed`` sequences (or tokens) were consumed (``size_at``)."""
        return size_at(self.ramp, consumed)

    def cut(self, epoch: int, consumed: tuple[int, int]) -> EpochCut:
        """``epoch`` cut into steps, ``consumed`` (tokens, sequences) by the epochs before it.

        A step is the most cut units (items, or whole groups) from where the last ended whose sequences (or tokens)
        stay within the step size, at least one. The last step is short ("not full", dropped with ``drop_last``) when
        one more unit of the largest would still have fitted.
        """
        order = self.order(epoch)
        tokens = np.concatenate([[0], np.cumsum(self.lengths[order])])
        units = self.unit_bounds(order)
        unit_tokens = tokens[units]
        by_count = self.unit == "sequences"
        prefix = units if by_count else unit_tokens
        n = len(units) - 1
        slack = (int(np.diff(units).max()) - 1) if by_count else int(np.diff(unit_tokens).max())
        done_tokens, done_sequences = consumed
        bounds, before, p = [], [], 0
        while p < n:
            target = self.size_at(done_sequences if by_count else done_tokens)
            q = max(p + 1, int(np.searchsorted(prefix, prefix[p] + target, side="right")) - 1)
            full = q < n or int(prefix[q] - prefix[p]) >= target - slack
            if q == n and not full and self.drop_last:
                break
            bounds.append((int(units[p]), int(units[q])))
            before.append((done_tokens, done_sequences))
            done_tokens += int(unit_tokens[q] - unit_tokens[p])
            done_sequences += int(units[q] - units[p])
            p = q
        return EpochCut(order, bounds, before, (done_tokens, done_sequences))
