"""NeMo-RL's two ways of cutting a batch, written here from its published algorithms: sequence packing
(``nemo_rl/data/packing/algorithms.py``, bins dealt to ranks by ``BatchedDataDict.shard_by_batch_size``) and dynamic
batching (the same method's ``dynamic_batching_args``).

Packing: every sequence (rounded up to ``sequence_length_pad_multiple``) goes into bins of ``max_tokens_per_microbatch``
tokens by modified first-fit decreasing (the default; first-fit decreasing, first-fit shuffle and concatenative are
here too); the bin count is raised to at least, and a multiple of, the number of ranks by moving single sequences
into new bins; bin i runs on rank i mod W. A sequence over the budget is refused (its ValueError).

Dynamic batching: sort the batch by length, deal it to ranks like cards, then cut every rank at the same positions:
a micro-batch grows while count × (the ranks' longest at each position, rounded up to ``sequence_length_round``)
fits the budget. Rows are padded. A rounded length over the budget is refused (its assert).
"""

from __future__ import annotations

import random
from bisect import bisect_right
from typing import Optional, Sequence

from harness.peers.common import PeerPlan, PeerRefusal, budget_of, deal_round_robin, round_up

SOURCE = "NVIDIA-NeMo/RL nemo_rl/data/packing/algorithms.py and nemo_rl/distributed/batched_data_dict.py at 7ea279a"
PACKING, DYNAMIC = "nemo_rl_packing", "nemo_rl_dynamic"
ALGORITHMS = ("modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle", "concatenative")
Item = tuple[int, int]  # (index, length)


def _check(lengths: Sequence[int], capacity: int) -> None:
    for i, n in enumerate(lengths):
        if n > capacity:
            raise PeerRefusal(f"planner: {PACKING} refuses example {i}: sequence length {n} exceeds bin capacity "
                              f"{capacity} (NeMo-RL's packer raises ValueError); raise mtpm to at least "
                              f"{max(lengths)} or use planner=balanced")


def concatenative(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """In order, a new bin whenever the next sequence does not fit."""
    _check(lengths, capacity)
    bins: list[list[int]] = []
    room = -1
    for i, n in enumerate(lengths):
        if not bins or n > room:
            bins.append([])
            room = capacity
        bins[-1].append(i)
        room -= n
    return bins


def first_fit(order: Sequence[Item], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Each sequence, in ``order``, into the first bin with room (a new one if none)."""
    _check(lengths, capacity)
    bins: list[list[int]] = []
    room: list[int] = []
    for n, i in order:
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    return first_fit(sorted(((n, i) for i, n in enumerate(lengths)), reverse=True), lengths, capacity)


def first_fit_shuffle(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    order = [(n, i) for i, n in enumerate(lengths)]
    random.Random(seed).shuffle(order)
    return first_fit(order, lengths, capacity)


def _classes(items: Sequence[Item], capacity: int) -> tuple[list[Item], ...]:
    """Johnson & Garey's classes: large (C/2, C], medium (C/3, C/2], small (C/6, C/3], tiny (0, C/6]."""
    large, medium, small, tiny = [], [], [], []
    for item in items:
        n = item[1]
        home = large if n > capacity / 2 else medium if n > capacity / 3 else small if n > capacity / 6 else tiny
        home.append(item)
    large.sort(key=lambda t: t[1], reverse=True)
    medium.sort(key=lambda t: t[1], reverse=True)
    small.sort(key=lambda t: t[1])
    tiny.sort(key=lambda t: t[1])
    return large, medium, small, tiny


def _pair_smalls(bins: list[list[Item]], small: list[Item], capacity: int) -> None:
    """Backwards over the large bins without a medium item: the smallest small one and the largest that fits with
    it."""
    for b in reversed(bins):
        if len(small) < 2 or any(capacity / 3 < n <= capacity / 2 for _, n in b):
            continue
        room = capacity - sum(n for _, n in b)
        if small[0][1] + small[1][1] > room:
            continue
        first = small.pop(0)
        j = max(k for k in range(len(small)) if small[k][1] <= room - first[1])  # small[0] fits, so j exists
        b.extend([first, small.pop(j)])


def _fill_then_spill(bins: list[list[Item]], rest: list[Item], capacity: int) -> list[list[Item]]:
    """The largest remaining item that fits, into each large bin in turn; what is left goes, largest first, into the
    least-filled new bin when it fits there, else a bin of its own."""
    for b in bins:
        while rest:
            room = capacity - sum(n for _, n in b)
            if room < rest[-1][1]:
                break
            b.append(rest.pop(next(k for k, (_, n) in enumerate(rest) if n <= room)))
    spill: list[list[Item]] = [[]]
    filled = [0]
    for item in rest:
        if item[1] <= capacity - filled[0]:
            target, total = spill.pop(0), filled.pop(0)
        else:
            target, total = [], 0
        target.append(item)
        total += item[1]
        at = bisect_right(filled, total)
        spill.insert(at, target)
        filled.insert(at, total)
    return spill


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Johnson & Garey's MFFD in NeMo-RL's phases: a bin per large item, a medium one into each, pairs of small ones
    into bins without a medium, the rest largest-first into the large bins, then the leftovers."""
    if any(n <= 0 for n in lengths):
        raise PeerRefusal(f"planner: {PACKING} refuses a sequence of length 0 (NeMo-RL's packer: sequence lengths "
                          f"must be positive)")
    _check(lengths, capacity)
    large, medium, small, tiny = _classes(list(enumerate(lengths)), capacity)
    bins: list[list[Item]] = [[item] for item in large]
    for b in bins:
        room = capacity - b[0][1]
        k = next((k for k, (_, n) in enumerate(medium) if n <= room), None)
        if k is not None:
            b.append(medium.pop(k))
    _pair_smalls(bins, small, capacity)
    rest = sorted(medium + small + tiny, key=lambda t: t[1], reverse=True)
    bins.extend(_fill_then_spill(bins, rest, capacity))
    return [[i for i, _ in b] for b in bins if b]


def adjust_bin_count(bins: list[list[int]], at_least: int, multiple: int) -> list[list[int]]:
    """Raise the bin count to ``at_least`` and then a multiple of ``multiple`` by moving the last sequence of the
    fullest bins (by count) into new ones, one at a time (NeMo-RL's ``_adjust_bin_count``)."""
    target = max(len(bins), at_least)
    target += -target % multiple
    if target == len(bins):
        return bins
    total = sum(len(b) for b in bins)
    if total < target:
        raise PeerRefusal(f"planner: {PACKING} cannot make {target} bins (at least one per rank) from {total} "
                          f"sequences (NeMo-RL raises ValueError); use at least {target} examples or fewer ranks")
    out = [list(b) for b in bins]
    sources = sorted(((len(b), i) for i, b in enumerate(bins)), reverse=True)
    s = 0
    for _ in range(target - len(bins)):
        while len(out[sources[s][1]]) <= 1:
            s += 1
        out.append([out[sources[s][1]].pop()])
    return out


def _pack(algorithm: str, lengths: Sequence[int], capacity: int, seed: int) -> list[list[int]]:
    if algorithm == "modified_first_fit_decreasing":
        return modified_first_fit_decreasing(lengths, capacity)
    if algorithm == "first_fit_decreasing":
        return first_fit_decreasing(lengths, capacity)
    if algorithm == "first_fit_shuffle":
        return first_fit_shuffle(lengths, capacity, seed)
    if algorithm == "concatenative":
        return concatenative(lengths, capacity)
    raise PeerRefusal(f"algorithm: {algorithm!r} is not a NeMo-RL packing algorithm (valid: {', '.join(ALGORITHMS)})")


def plan_packing(lengths: Sequence[int], world_size: int, budget: Optional[int],
                 algorithm: str = ALGORITHMS[0], pad_multiple: int = 1, seed: int = 0) -> PeerPlan:
    """NeMo-RL's sequence packing of ``lengths`` for ``world_size`` ranks, bins of ``budget`` tokens."""
    budget = budget_of(PACKING, budget)
    padded = [round_up(n, pad_multiple) for n in lengths]
    bins = adjust_bin_count(_pack(algorithm, padded, budget, seed), world_size, world_size)
    knobs = {"max_tokens_per_microbatch": budget, "algorithm": algorithm, "sequence_length_pad_multiple": pad_multiple,
             "min_bin_count": world_size, "bin_count_multiple": world_size, "microbatch_order": "packer"}
    if algorithm == "first_fit_shuffle":
        knobs["seed"] = seed
    differs = [] if pad_multiple == 1 else [(f"sequences are rounded up to {pad_multiple} tokens to plan; the harness "
                                            "packs their real lengths")]
    return PeerPlan(deal_round_robin(bins, world_size), knobs, "bin i runs on rank i mod W; the bin count is a "
                    "multiple of W, so every rank runs the same number", differs)


def plan_dynamic(lengths: Sequence[int], world_size: int, budget: Optional[int], round_to: int = 64) -> PeerPlan:
    """NeMo-RL's dynamic batching of ``lengths`` for ``world_size`` ranks under ``budget`` padded tokens."""
    budget = budget_of(DYNAMIC, budget)
    n = len(lengths)
    if n % world_size:
        raise PeerRefusal(f"planner: {DYNAMIC} shards the batch evenly (NeMo-RL asserts batch size % shards == 0): "
                          f"{n} examples do not divide over {world_size} ranks; use a multiple of {world_size}")
    order = sorted(range(n), key=lambda i: lengths[i])
    shards = [order[r::world_size] for r in range(world_size)]
    width = max(lengths, default=0)  # the batch's padded width: no position is rounded past it
    widths = [min(round_up(max(lengths[s[p]] for s in shards), round_to), width) for p in range(n // world_size)]
    over = [m for m in widths if m > budget]
    if over:  # named at once, the largest: the budget that plans every position, not the next one that fails
        raise PeerRefusal(f"planner: {DYNAMIC} refuses padded ({round_to}) sequence lengths up to {max(over)}, over "
                          f"max_tokens_per_microbatch {budget} (NeMo-RL asserts); raise mtpm to at least {max(over)}")
    cuts: list[list[int]] = []
    longest = 0
    for p, m in enumerate(widths):
        if cuts and (len(cuts[-1]) + 1) * max(longest, m) <= budget:
            cuts[-1].append(p)
            longest = max(longest, m)
        else:
            cuts.append([p])
            longest = m
    grid = [[[s[p] for p in cut] for cut in cuts] for s in shards]
    knobs = {"max_tokens_per_microbatch": budget, "sequence_length_round": round_to}
    return PeerPlan(grid, knobs, "sorted by length and dealt to ranks like cards; every rank cut at the same positions",
                    [(f"the peer pads a micro-batch to the ranks' longest at each position rounded up to {round_to}; "
                     "the harness pads each rank's micro-batch to its own longest")])
