"""The peers' planning knobs around our planners (``plan_step`` and the sampler): groups kept together (verl's
``force_group_size``), at least or a multiple of k micro-batches on every rank (verl's ``min_num_micro_batch`` and
``num_batches_divided_by``), padded micro-batches of a multiple of k sequences (fairseq's ``bsz_mult``).

A planner here is any function of (unit lengths, cap) to lock-step schedules (per rank, micro-batches of indices,
``None`` for a dummy); the knobs plan through it and then split or place what it cannot know about.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

from balance_batch.cost import CostModel, microbatch_cost, microbatch_tokens
from balance_batch.errors import shown
from balance_batch.planners import PLANNERS, PlanSettings

Base = Callable[[list[int], Optional[int]], list[list]]  # (unit lengths, cap) -> per rank, micro-batches or None


def check_knobs(settings: PlanSettings, *, groups: bool, takes_knobs: bool, who: str = "") -> None:
    """One ValueError for a combination the knobs cannot honour (each value was checked by the caller); ``groups``:
    whether groups were given, ``takes_knobs``: whether the planner takes them."""
    knobs, layout = settings.knobs, settings.layout
    given = (["groups"] if groups else []) + knobs.given()
    lead = f"{who}: " if who else ""
    if given and not takes_knobs:
        raise ValueError(f"{lead}{given[0]}: planner {settings.planner!r} keeps its peer's own semantics and has no "
                         f"such knob (planners {' and '.join(PLANNERS)} take it)")
    if knobs.padded_sequences_multiple_of is not None:
        if layout != "padded":
            raise ValueError(f"{lead}padded_sequences_multiple_of: needs layout 'padded' (a packed row has no "
                             f"sequence count to round), got layout {layout!r}")
        if groups:
            raise ValueError(f"{lead}padded_sequences_multiple_of: not with groups (a group's size decides its "
                             "micro-batch's count); give one or the other")
    if settings.budget is None and (groups or knobs.padded_sequences_multiple_of is not None):
        key = "groups" if groups else "padded_sequences_multiple_of"
        raise ValueError(f"{lead}{key}: needs max_tokens_per_microbatch (a group fits, or k sequences fit, only "
                         "within a token budget)")
    counts = knobs.min_microbatches is not None or knobs.microbatches_multiple_of is not None
    if counts and not settings.lockstep:
        key = "min_microbatches" if knobs.min_microbatches is not None else "microbatches_multiple_of"
        raise ValueError(f"{lead}{key}: makes every rank's micro-batch count equal, with dummies where nothing is "
                         "left to split, which lockstep=False would drop; use lockstep=True")


def checked_groups(groups, n: int, who: str = "") -> Optional[list[int]]:
    """``groups`` as one int per item, or one ValueError."""
    if groups is None:
        return None
    lead = f"{who}: " if who else ""
    arr = np.asarray(groups)
    if arr.ndim != 1 or len(arr) != n or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{lead}groups: must be one integer group id per item ({n}), got {shown(groups)}")
    return arr.tolist()


class _Fit:
    """What fits one micro-batch: the budget (sum packed, count x longest padded) and the cap on sequences."""

    def __init__(self, lengths: Sequence[int], budget: Optional[int], layout: str, cap: Optional[int],
                 cost_model: CostModel):
        self.lengths, self.budget, self.layout, self.cap, self.cost_model = lengths, budget, layout, cap, cost_model

    def tokens(self, items: Sequence[int]) -> int:
        return microbatch_tokens(items, self.lengths, self.layout)

    def ok(self, items: Sequence[int]) -> bool:
        if self.cap is not None and len(items) > self.cap:
            return False
        return self.budget is None or self.tokens(items) <= self.budget

    def cost(self, items: Optional[Sequence[int]]) -> float:
        return microbatch_cost(items, self.lengths, self.layout, self.cost_model)

    def pack(self, units: list[list[int]]) -> list[list[int]]:
        """``units`` into the fewest micro-batches first-fit decreasing finds, each within the budget (a unit that
        is over it alone); padded, the longest first, which keeps like lengths together."""
        key = (lambda u: (-max(self.lengths[i] for i in u), u[0])) if self.layout == "padded" else \
            (lambda u: (-sum(self.lengths[i] for i in u), u[0]))
        pieces: list[list[int]] = []
        for unit in sorted(units, key=key):
            for piece in pieces:
                if self.ok(piece + unit):
                    piece.extend(unit)
                    break
            else:
                pieces.append(list(unit))
        return pieces


def plan_with_knobs(lengths: Sequence[int], groups: Optional[list[int]], settings: PlanSettings, base: Base
                    ) -> list[list]:
    """Per rank, lock-step micro-batches (``None`` a dummy) of ``lengths`` (all positive) under ``groups`` and the
    settings' count knobs, planned through ``base`` (the planner).

    Groups: a group whose items fit one micro-batch (the budget and the cap) is planned as one item (packed: its
    summed length; padded: count x its longest) and expanded; a micro-batch that then holds more than fits (padded
    groups of unlike lengths, the cap) is split between groups; a group that fits no micro-batch is packed on its own
    into consecutive micro-batches of one rank (the rank with the fewest). Counts: each rank's costliest micro-batch
    with more than one group (or sequence) is halved until the rank has the count asked for, then dummies.
    """
    knobs, cap = settings.knobs, settings.max_seqs
    fit = _Fit(lengths, settings.budget, settings.layout, cap, settings.cost_model)
    k = knobs.padded_sequences_multiple_of
    if k is not None:  # the planner cuts multiples of k itself (``greedy.cut_multiple_of``)
        rows, units_of = base(list(lengths), cap), None
    else:
        units = _units(len(lengths), groups)
        whole = [u for u in units if len(u) == 1 or fit.ok(u)]
        apart = [u for u in units if not (len(u) == 1 or fit.ok(u))]
        grid = base([fit.tokens(u) for u in whole], cap)
        rows = [[None if mb is None else [i for j in mb for i in whole[j]] for mb in rank] for rank in grid]
        units_of = None
        if groups is not None:
            unit_id = {i: u for u, unit in enumerate(units) for i in unit}
            units_of = lambda mb: _grouped(mb, unit_id)  # noqa: E731
            rows = [[mb for b in rank for mb in ([b] if b is None or fit.ok(b) else fit.pack(units_of(b)))]
                    for rank in rows]
            rows = _place_apart(rows, apart, fit)
    steps = max(len(rank) for rank in rows) if rows else 0
    want = max(steps, knobs.min_microbatches or 0)
    if knobs.microbatches_multiple_of:
        want = math.ceil(want / knobs.microbatches_multiple_of) * knobs.microbatches_multiple_of
    if want > steps:
        rows = [_split_to(rank, want, fit, k, units_of) for rank in rows]
    steps = max(want, steps)
    return [list(rank) + [None] * (steps - len(rank)) for rank in rows]


def _units(n: int, groups: Optional[list[int]]) -> list[list[int]]:
    """Each item alone, or the items of each group (in index order), groups in the order they first appear."""
    if groups is None:
        return [[i] for i in range(n)]
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    return list(by_group.values())


def _grouped(mb: list[int], unit_id: dict[int, int]) -> list[list[int]]:
    """A micro-batch's items by their group, in order."""
    out: dict[int, list[int]] = {}
    for i in mb:
        out.setdefault(unit_id[i], []).append(i)
    return list(out.values())


def _place_apart(rows: list[list], apart: list[list[int]], fit: _Fit) -> list[list]:
    """Each group that fits no micro-batch, packed alone into consecutive micro-batches of one rank: the rank that
    then runs the fewest (ties: the cheapest, then the first), costliest group first."""
    if not apart:
        return rows
    rows = [list(rank) for rank in rows]
    for rank in rows:  # a rank's trailing dummies give way to the block
        while rank and rank[-1] is None:
            rank.pop()
    cost = [sum(fit.cost(mb) for mb in rank) for rank in rows]
    for unit in sorted(apart, key=lambda u: (-sum(fit.cost([i]) for i in u), u[0])):
        block = fit.pack([[i] for i in unit])
        r = min(range(len(rows)), key=lambda r: (len(rows[r]), cost[r], r))
        rows[r].extend(block)
        cost[r] += sum(fit.cost(mb) for mb in block)
    return rows


def _split_to(rank: list, want: int, fit: _Fit, k: Optional[int], units_of) -> list:
    """``rank``'s micro-batches, the costliest splittable one halved until there are ``want`` (split halves stay
    side by side), then dummies up to ``want``."""
    real = [mb for mb in rank if mb]
    while len(real) < want:
        best, halves = None, None
        for j in sorted(range(len(real)), key=lambda j: (-fit.cost(real[j]), j)):
            halves = _halves(real[j], fit, k, units_of)
            if halves:
                best = j
                break
        if best is None:
            break
        real[best:best + 1] = halves
    return real + [None] * (want - len(real))


def _halves(mb: list[int], fit: _Fit, k: Optional[int], units_of) -> Optional[list[list[int]]]:
    """``mb`` in two of about equal cost (None when it cannot split: one group, one sequence, or, with ``k``, fewer
    than 2k sequences or a count that is no multiple of k). Padded sequences split by length (the longer half
    first), which keeps padding low; groups and packed sequences by cost, costliest first into the cheaper half."""
    L = fit.lengths
    if k is not None or (units_of is None and fit.layout == "padded"):
        c, step = len(mb), k or 1
        if c < 2 * step or c % step:
            return None
        ordered = sorted(mb, key=lambda i: (-L[i], i))
        cut = step * math.ceil(c / step / 2)
        return [ordered[:cut], ordered[cut:]]
    units = units_of(mb) if units_of is not None else [[i] for i in mb]
    if len(units) < 2:
        return None
    halves: list[list[int]] = [[], []]
    load = [0.0, 0.0]
    for unit in sorted(units, key=lambda u: (-sum(fit.cost([i]) for i in u), u[0])):
        h = 0 if load[0] <= load[1] else 1
        halves[h].extend(unit)
        load[h] += sum(fit.cost([i]) for i in unit)
    position = {i: p for p, i in enumerate(mb)}
    return [sorted(h, key=position.__getitem__) for h in halves]
