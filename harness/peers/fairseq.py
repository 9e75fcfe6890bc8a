"""fairseq's ``--max-tokens`` batching (``data_utils.batch_by_size`` and ``EpochBatchIterator``), written here from its
published algorithm.

The indices are shuffled with the run's seed, then sorted by length (ascending, stable, so the shuffle only orders
ties). ``batch_by_size`` fills a batch while count × longest stays within ``max_tokens`` (and the count within
``max_sentences``), preferring counts that are multiples of ``required_batch_size_multiple`` (8 by default): a batch
that overflows keeps its last whole multiple and the rest starts the next one. The batches are shuffled with
``seed + epoch`` and rank r takes batches r, r+W, ...; a short rank is padded with an empty batch, on which fairseq
runs a dummy step. A sequence over ``max_tokens`` is refused (its assert). Rows are padded.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from harness.peers.common import PeerPlan, budget_of, ceil_div, refuse_over

NAME = "fairseq"
LAYOUT = "padded"
SOURCE = "facebookresearch/fairseq fairseq/data/data_utils_fast.pyx and fairseq/data/iterators.py at 3d262bb"


def batch_by_size(order: Sequence[int], sizes: Sequence[int], max_tokens: int, max_sentences: int = 0,
                  multiple: int = 1) -> list[list[int]]:
    """fairseq's batching of ``order``: a running batch of whole multiples of ``multiple`` plus a tail; when adding
    the next would overflow, the running batch closes and the tail (with the next) starts a new one, or closes too
    if the tail alone overflows. 0 for ``max_tokens`` or ``max_sentences``: no limit."""
    ends = [0] * (len(order) + 1)
    count = start = 0
    tail_max = batch_max = 0
    for pos, idx in enumerate(order):
        tail_max = max(tail_max, sizes[idx])
        new_max = max(batch_max, tail_max)
        sentences = pos + 1 - start
        overflow = 0 < max_sentences < sentences or 0 < max_tokens < sentences * new_max
        if overflow:
            if 0 < max_tokens < tail_max * (pos + 1 - ends[count]):  # the tail alone overflows: close it too
                count += 1
                ends[count] = pos
                tail_max = sizes[idx]
            start = ends[count]
            count += 1
            new_max = tail_max
        if overflow or sentences < multiple or sentences % multiple == 0:
            ends[count] = pos + 1
            batch_max = new_max
            tail_max = 0
    if order and ends[count] != len(order):
        count += 1
    cuts = ends[:count] + [len(order)] if order else []
    out, begin = [], 0
    for end in cuts:
        out.append(list(order[begin:end]))
        begin = end
    return out


def plan(lengths: Sequence[int], world_size: int, budget: Optional[int], max_sentences: Optional[int] = None,
         multiple: int = 8, seed: int = 1, epoch: int = 1) -> PeerPlan:
    """fairseq's plan of ``lengths`` for ``world_size`` ranks with ``--max-tokens budget``."""
    budget = budget_of(NAME, budget)
    refuse_over(NAME, lengths, budget, "max_tokens", "fairseq asserts sentence lengths do not exceed max_tokens")
    sizes = np.asarray(lengths, dtype=np.int64)
    shuffled = np.random.RandomState(seed).permutation(len(sizes))
    order = shuffled[np.argsort(sizes[shuffled], kind="mergesort")].tolist()
    batches = batch_by_size(order, lengths, budget, max_sentences or 0, multiple)
    np.random.RandomState(seed + epoch).shuffle(batches)
    per_rank = ceil_div(len(batches), world_size)
    grid = [list(batches[r::world_size]) + [None] * (per_rank - len(batches[r::world_size]))
            for r in range(world_size)]
    knobs = {"max_tokens": budget, "max_sentences": max_sentences, "required_batch_size_multiple": multiple,
             "seed": seed, "epoch": epoch}
    empty = per_rank * world_size - len(batches)
    return PeerPlan(grid, knobs, "batches shuffled with seed + epoch, batch i on rank i mod W; a short rank runs "
                    "an empty batch (fairseq's dummy step)", peer_empty=empty)
