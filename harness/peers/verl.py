"""verl's dynamic batch size (``verl/utils/seqlen_balancing.py`` and the trainer's ``_balance_batch``), written here
from its published algorithm.

1. The trainer splits the batch over data-parallel ranks in equal counts by Karmarkar–Karp on the workload
   24576·L + L² (``balance_batch``, on by default), each rank's share ordered light/heavy alternately.
2. Each rank takes ``ceil(Σ L ÷ max_token_len)`` micro-batches (never more than its sequences), the ranks agree on
   the largest count (``same_micro_num_in_dp``), and Karmarkar–Karp (sizes free) partitions the rank's sequences by
   workload into that many.
3. Strict budget (the change merged 2026-08-25): while any micro-batch sums to more than ``max_token_len``
   tokens, every rank repartitions with one more.
4. The micro-batches run heaviest in the middle, lightest at both ends (``use_dynamic_bsz_balance``).

A sequence longer than ``max_token_len`` is refused, as verl's assert does. Rows are packed (remove-padding).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional, Sequence

from harness.peers.common import PeerPlan, PeerRefusal, budget_of, ceil_div, refuse_over

NAME = "verl"
LAYOUT = "packed"
SOURCE = ("verl-project/verl verl/utils/seqlen_balancing.py and verl/trainer/ppo/ray_trainer.py at 1dda039 "
          "(2026-08-22), with https://github.com/verl-project/verl/pull/7553 (strict max_token_len, merged 2026-08-25)")
LINEAR_WEIGHT = 24576  # verl's calculate_workload: 24576·L + L² (a 7B model's 12·h² and 2·h with h = 4096)


def workload(n: int) -> int:
    return LINEAR_WEIGHT * n + n * n


class _Part:
    """One partition: its items (index, value) and their sum; ordered by (sum, size, items) as verl orders them."""

    __slots__ = ("total", "items")

    def __init__(self, items: Sequence[tuple[int, int]] = ()):
        self.items = list(items)
        self.total = sum(v for _, v in self.items)

    def key(self):
        return self.total, len(self.items), self.items


class _State:
    """k partitions, heaviest first; the heap pops the state with the widest spread (ties: the heavier top)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[_Part]):
        self.parts = sorted(parts, key=_Part.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.parts[0].total - self.parts[-1].total

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.parts[0].key() > other.parts[0].key()

    def absorb(self, other: "_State") -> None:
        """The differencing step: this state's heaviest partition takes the other's lightest, and so on."""
        k = len(self.parts)
        for i in range(k):
            mine, theirs = self.parts[i], other.parts[k - 1 - i]
            mine.items.extend(theirs.items)
            mine.total += theirs.total
        self.parts.sort(key=_Part.key, reverse=True)


def karmarkar_karp(values: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """The largest differencing method over ``values`` into ``k`` partitions (indices, each sorted).

    ``equal_size``: every partition gets ``len(values) ÷ k`` items (the caller checks that it divides): the sorted
    values are taken k at a time, one to each partition, before differencing.
    """
    ranked = sorted((v, i) for i, v in enumerate(values))
    tie = itertools.count()  # equal states pop in the order they were made
    heap: list[tuple[_State, int]] = []
    if equal_size:
        for start in range(0, len(ranked), k):
            parts = [_Part([(i, v)]) for v, i in ranked[start:start + k]]
            heapq.heappush(heap, (_State(parts), next(tie)))
    else:
        for v, i in ranked:
            parts = [_Part([(i, v)])] + [_Part() for _ in range(k - 1)]
            heapq.heappush(heap, (_State(parts), next(tie)))
    while len(heap) > 1:
        first, _ = heapq.heappop(heap)
        second, _ = heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, (first, next(tie)))
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(i for i, _ in part.items) for part in heap[0][0].parts]


def _rank_shares(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """The trainer's split: equal counts by workload, each share light/heavy alternately (its _balance_batch)."""
    n = len(lengths)
    if n % world_size:
        raise PeerRefusal(f"planner: {NAME} splits the batch over ranks in equal counts (Karmarkar–Karp, equal_size; "
                          f"balance_batch): {n} examples do not divide over {world_size} ranks; use a multiple of "
                          f"{world_size} examples")
    loads = [workload(x) for x in lengths]
    shares = karmarkar_karp(loads, world_size, equal_size=True)
    ordered = []
    for share in shares:
        share = sorted(share, key=lambda i: (loads[i], i))
        ordered.append(share[::2] + share[1::2][::-1])
    return ordered


def _micro_batches(share: Sequence[int], lengths: Sequence[int], k: int) -> list[list[int]]:
    """One rank's k micro-batches, by workload (global indices, in the order verl runs them)."""
    local = [workload(lengths[i]) for i in share]
    parts = karmarkar_karp(local, k, equal_size=False)
    parts.sort(key=lambda p: (sum(local[j] for j in p), p[0] if p else 0), reverse=True)
    parts = parts[::2][::-1] + parts[1::2]
    return [[share[j] for j in p] for p in parts]


def plan(lengths: Sequence[int], world_size: int, budget: Optional[int], strict: bool = True) -> PeerPlan:
    """verl's plan of ``lengths`` for ``world_size`` ranks with ``max_token_len = budget``."""
    budget = budget_of(NAME, budget)
    refuse_over(NAME, lengths, budget, "max_token_len", "verl asserts max_token_len >= every sequence length")
    knobs = {"max_token_len": budget, "workload": f"{LINEAR_WEIGHT}*L + L^2", "balance_batch": True,
             "same_micro_num_in_dp": True, "use_dynamic_bsz_balance": True, "strict": strict}
    spread = ("ranks get equal counts of sequences by Karmarkar-Karp on the workload; each rank cuts its own into "
              "micro-batches, the count agreed as the ranks' maximum")
    if not lengths:
        return PeerPlan([[] for _ in range(world_size)], knobs, spread)
    shares = _rank_shares(lengths, world_size)
    k = max(min(len(s), ceil_div(sum(lengths[i] for i in s), budget)) for s in shares)
    while True:
        if any(k > len(s) for s in shares):
            raise PeerRefusal(f"planner: {NAME} needs {k} micro-batches on every rank but a rank holds fewer "
                              f"sequences (verl asserts num_micro_batches <= batch size); use more examples")
        grid = [_micro_batches(s, lengths, k) for s in shares]
        over = any(sum(lengths[i] for i in mb) > budget for rank in grid for mb in rank)
        if not (strict and over):
            break
        k += 1  # the strict change: one more on every rank (the retry is collective) until none is over
    knobs["micro_batches_per_rank"] = k
    return PeerPlan(grid, knobs, spread)
