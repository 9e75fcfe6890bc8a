"""The seed's planner: sort by length, deal ranks like cards, fill micro-batches greedily (padded or packed)."""

from __future__ import annotations

from typing import Optional, Sequence, Sized

import numpy as np

from balance_batch.errors import positive_int

# A schedule is one rank's ordered list of micro-batches. A micro-batch is a
# list of example indices into the whole request; ``None`` is a dummy entry
# that only exists so all ranks call the model the same number of times.
MicroBatch = list[int]
Schedule = list[Optional[MicroBatch]]


def sort_by_length(lengths: Sequence[int]) -> list[int]:
    """Indices ordered longest first (ties by index, so the order is stable).

    Longest first puts the largest micro-batch at the start of a pass, so a
    budget that does not fit fails on the first step rather than the last.
    """
    return length_order(lengths)[0]


def length_order(lengths: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """``sort_by_length``'s order, and the lengths in that order (one gather, for callers that read them in
    sequence)."""
    L = np.asarray(lengths, dtype=np.int64)
    # a stable sort of the negated lengths keeps equal ones in index order: key (-length, index), in numpy
    by_length = np.argsort(-L, kind="stable")
    return by_length.tolist(), L[by_length]


def _greedy_token_budget(
    order: Sequence[int],
    lengths: Sequence[int],
    budget: int,
    max_seqs: Optional[int] = None,
    order_lengths: Optional[Sequence[int]] = None,
) -> list[MicroBatch]:
    """Padded micro-batches over ``order``: a new one when ``count * longest`` would pass ``budget`` (or the count
    reach ``max_seqs``). ``order_lengths``: the lengths of ``order``'s examples, in that order, where the caller has
    them (read in sequence)."""
    cap = max_seqs or len(order) + 1
    batches: list[MicroBatch] = []
    current: MicroBatch = []
    current_max = count = 0
    for idx, n in zip(order, order_lengths if order_lengths is not None else map(lengths.__getitem__, order)):
        longest = n if n > current_max else current_max
        if count and ((count + 1) * longest > budget or count == cap):
            batches.append(current)
            current, current_max, count = [idx], n, 1
        else:
            current.append(idx)
            current_max, count = longest, count + 1
    if current:
        batches.append(current)
    return batches


def make_token_balanced_microbatches(
    sorted_indices: Sequence[int], all_input_ids: Sequence[Sized], max_tokens: int
) -> list[MicroBatch]:
    """Greedy token-budget micro-batches over ``sorted_indices``, in that order.

    A new micro-batch starts when the current one is non-empty and adding the
    next sequence would make ``count * longest`` exceed ``max_tokens``. A
    sequence longer than ``max_tokens`` is never dropped: it sits alone.
    """
    positive_int("max_tokens", max_tokens)
    lengths = [len(seq) for seq in all_input_ids]
    return _greedy_token_budget(sorted_indices, lengths, max_tokens)


def make_fixed_size_microbatches(sorted_indices: Sequence[int], micro_batch_size: int,
                                 max_seqs: Optional[int] = None) -> list[MicroBatch]:
    """Consecutive slices of ``micro_batch_size`` examples, at most ``max_seqs`` (the last may be shorter)."""
    positive_int("micro_batch_size", micro_batch_size)
    return _fixed_slices(sorted_indices, micro_batch_size, max_seqs)


def _fixed_slices(order: Sequence[int], micro_batch_size: int, max_seqs: Optional[int]) -> list[MicroBatch]:
    if max_seqs is not None:
        micro_batch_size = min(micro_batch_size, max_seqs)
    order = list(order)
    return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


def deal_to_ranks(sorted_indices: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal the length-sorted indices to ranks like cards: rank r gets positions r, r+W, ...

    Each rank then holds a similar mix of long and short sequences, and keeps
    the sorted order, so its own micro-batches stay tight.
    """
    positive_int("world_size", world_size)
    order = list(sorted_indices)
    return [order[r::world_size] for r in range(world_size)]


def lockstep_schedules(schedules: Sequence[Sequence[MicroBatch]]) -> list[Schedule]:
    """Every rank's schedule padded with dummies (``None``) up to the longest one, for lock-step ranks."""
    longest = max((len(s) for s in schedules), default=0)
    return [list(s) + [None] * (longest - len(s)) for s in schedules]


def microbatches_for_rank(
    rank_indices: Sequence[int],
    lengths: Sequence[int],
    budget: Optional[int],
    micro_batch_size: int,
    layout: str = "padded",
    max_seqs: Optional[int] = None,
    order_lengths: Optional[Sequence[int]] = None,
) -> list[MicroBatch]:
    """One rank's micro-batches: by the token ``budget`` when it is set, else fixed slices (arguments already
    checked, by ``plan_step`` or the sampler).

    ``layout="packed"`` bounds the sum of lengths instead of ``count * longest``.
    ``max_seqs`` (None: no cap) also starts a new micro-batch once one holds that many sequences.
    ``order_lengths``: the lengths of ``rank_indices`` in order, where the caller has them.
    """
    if budget is None:
        return _fixed_slices(rank_indices, micro_batch_size, max_seqs)
    if layout == "packed":
        return greedy_packed_microbatches(rank_indices, lengths, budget, max_seqs, order_lengths)
    return _greedy_token_budget(rank_indices, lengths, budget, max_seqs, order_lengths)


def greedy_packed_microbatches(order: Sequence[int], lengths: Sequence[int], budget: int,
                               max_seqs: Optional[int] = None,
                               order_lengths: Optional[Sequence[int]] = None) -> list[MicroBatch]:
    """Greedy over ``order`` for packed micro-batches: a new one starts when the sum of lengths would pass
    ``budget``.

    Sequences are laid end to end with no padding, so the budget bounds the sum,
    not ``count * longest``. A sequence longer than ``budget`` sits alone.
    """
    cap = max_seqs or len(order) + 1
    batches: list[MicroBatch] = []
    current: MicroBatch = []
    total = count = 0
    for idx, n in zip(order, order_lengths if order_lengths is not None else map(lengths.__getitem__, order)):
        if count and (total + n > budget or count == cap):
            batches.append(current)
            current, total, count = [idx], n, 1
        else:
            current.append(idx)
            total, count = total + n, count + 1
    if current:
        batches.append(current)
    return batches


def cut_multiple_of(order: Sequence[int], lengths: Sequence[int], budget: int, max_seqs: Optional[int], k: int
                    ) -> list[MicroBatch]:
    """Padded micro-batches of a multiple of ``k`` sequences (fairseq's ``bsz_mult``) over ``order`` (longest first).

    At each point the most sequences that fit (count x the run's longest within ``budget``, at most ``max_seqs``),
    rounded down to a multiple of k when at least k fit; so a micro-batch holds a multiple of k sequences, or fewer
    than k where k of its longest would not fit (one over the budget alone), or the last sequences left.
    """
    out, p, n = [], 0, len(order)
    while p < n:
        c = min(n - p, budget // lengths[order[p]], max_seqs or n)
        if c >= k:
            c -= c % k
        c = max(c, 1)
        out.append(list(order[p:p + c]))
        p += c
    return out
