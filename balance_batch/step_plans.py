"""The sampler's second part: its epochs' cuts and each step's plan for this rank, computed once and kept.

``Epochs`` chains the cutter over epochs (an epoch's cut depends on the tokens and sequences consumed before it);
``StepPlans`` plans a step's items through the library's one pipeline (``balance_batch.plan.planned_rows``) and keeps
the last ones asked for, so a loader's prefetch and ``steps()`` plan each step once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from balance_batch.plan import planned_rows
from balance_batch.planners import PlanSettings
from balance_batch.sampler_state import settings_config
from balance_batch.step_cutter import EpochCut, StepCutter

PLAN_CACHE = 64  # planned steps kept


@dataclass(frozen=True)
class Step:
    """One optimizer step, as this rank sees it.

    ``microbatches``: this rank's micro-batches, lists of dataset indices, run in this order; ``[]`` is a dummy (run
    it with zero loss weight: every rank runs the same number). ``global_tokens`` / ``global_loss_tokens``: the
    step's tokens and loss tokens over all ranks (the loss denominator). ``step``: optimizer steps before this one,
    since epoch 0; ``consumed_tokens`` / ``consumed_sequences``: tokens / sequences of those steps, all ranks. A step
    resumed from a state taken mid-step (a loader's, at a micro-batch) holds only the micro-batches still to run;
    ``first_microbatch`` counts those before.
    """

    microbatches: list[list[int]]
    global_tokens: int
    global_loss_tokens: int
    step: int
    epoch: int
    consumed_tokens: int
    first_microbatch: int = 0  # micro-batches of this step run before a resume taken mid-step (they are not here)
    consumed_sequences: int = 0  # sequences of the steps before it, all ranks, all epochs


class Partial(NamedTuple):
    """A step resumed mid-way: ``done`` of its micro-batches ran (under the saved plan); ``rest`` (per rank, lists of
    item ids) is what remains, re-planned when the plan settings changed, else None (the plan's own tail)."""

    epoch: int
    step: int
    done: int
    rest: Optional[list]
    handed: Optional[list]  # with ``rest``: the step's items already handed out, all ranks


class Epochs:
    """Each epoch's cut (the last one asked about kept) and the (steps, tokens, sequences) before each epoch."""

    def __init__(self, cutter: StepCutter):
        self.cutter = cutter
        self.reset()

    def reset(self, epoch: int = 0, start: Optional[tuple[int, int, int]] = None) -> None:
        """Forget every cut; ``start``: the (steps, tokens, sequences) before ``epoch``, where a state says them."""
        self._starts: dict[int, tuple[int, int, int]] = {0: (0, 0, 0)}
        if start is not None:
            self._starts[epoch] = start
        self._last: Optional[tuple[int, EpochCut]] = None

    def cut(self, epoch: int) -> EpochCut:
        if self._last is None or self._last[0] != epoch:
            _, tokens, sequences = self.start(epoch)
            self._last = (epoch, self.cutter.cut(epoch, (tokens, sequences)))
        return self._last[1]

    def start(self, epoch: int) -> tuple[int, int, int]:
        """Steps, tokens and sequences of all epochs before ``epoch``."""
        known = max(e for e in self._starts if e <= epoch)
        while known < epoch:
            steps, tokens, sequences = self._starts[known]
            cut = self._last[1] if self._last is not None and self._last[0] == known else \
                self.cutter.cut(known, (tokens, sequences))
            self._starts[known + 1] = (steps + len(cut.bounds), *cut.end)
            known += 1
        return self._starts[epoch]

    def n_steps(self, epoch: int) -> int:
        return len(self.cut(epoch).bounds)

    def members(self, epoch: int, step: int) -> np.ndarray:
        """The items of step ``step`` of ``epoch``, in the epoch's order."""
        cut = self.cut(epoch)
        p, q = cut.bounds[step]
        return cut.order[p:q]


class StepPlans:
    """Each step of each epoch planned for ``rank``, the last ``PLAN_CACHE`` kept, and each epoch's micro-batch counts
    as planned so far (-1: not planned yet)."""

    def __init__(self, epochs: Epochs, loss_tokens: np.ndarray, settings: PlanSettings, rank: int):
        self.epochs, self.loss_tokens, self.settings, self.rank = epochs, loss_tokens, settings, rank
        self.lengths, self.groups = epochs.cutter.lengths, epochs.cutter.groups
        self.clear()

    def clear(self) -> None:
        self._plans: OrderedDict = OrderedDict()
        self._counts: dict[int, np.ndarray] = {}

    def step(self, epoch: int, s: int) -> Step:
        """Step ``s`` of ``epoch`` for this rank, whole."""
        key = (epoch, s)
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        members = self.epochs.members(epoch, s)
        mine = [members[mb].tolist() if mb else [] for mb in self.rows(members, self.settings, epoch, s)[self.rank]]
        self.counts(epoch)[s] = len(mine)
        tokens, sequences = self.epochs.cut(epoch).before[s]
        step = Step(microbatches=mine, global_tokens=int(self.lengths[members].sum()),
                    global_loss_tokens=int(self.loss_tokens[members].sum()), step=self.epochs.start(epoch)[0] + s,
                    epoch=epoch, consumed_tokens=tokens, consumed_sequences=sequences)
        self._plans[key] = step
        if len(self._plans) > PLAN_CACHE:
            self._plans.popitem(last=False)
        return step

    def counts(self, epoch: int) -> np.ndarray:
        return self._counts.setdefault(epoch, np.full(self.epochs.n_steps(epoch), -1, dtype=np.int64))

    def rows(self, ids: np.ndarray, settings: PlanSettings, epoch: int, s: int) -> list[list]:
        """Per rank, the micro-batches (indices into ``ids``; ``None`` a dummy) of items ``ids`` of step ``s``, under
        ``settings``; with ``longest_first`` in an epoch's first step, the slot holding the epoch's longest item
        first on every rank (the ranks run slot by slot, so the slot moves whole)."""
        groups = None if self.groups is None else self.groups[ids].tolist()
        rows, _ = planned_rows(self.lengths[ids].tolist(), settings, groups)
        if not self.epochs.cutter.longest_first or s != 0:
            return rows
        first = self.epochs.members(epoch, 0)  # the epoch's first step holds its longest item
        at = np.flatnonzero(ids == first[int(np.argmax(self.lengths[first]))])
        if at.size == 0:  # it ran before a resume mid-step: what is left keeps its order
            return rows
        slot = next((k for rank in rows for k, mb in enumerate(rank) if mb and int(at[0]) in mb), 0)
        return [[rank[slot], *rank[:slot], *rank[slot + 1:]] if slot < len(rank) else list(rank) for rank in rows]

    def rest_of_step(self, epoch: int, s: int, done: int, handed: Optional[list], saved: PlanSettings
                     ) -> Optional[Partial]:
        """The rest of step ``s`` whose first ``done`` micro-batches ran under ``saved`` settings (``handed``: its
        items that ran, where the saved run had re-planned it), planned under this sampler's; None when nothing is
        left."""
        members = self.epochs.members(epoch, s)
        if handed is None and settings_config(saved) == settings_config(self.settings):
            return Partial(epoch, s, done, None, None) if done < len(self.step(epoch, s).microbatches) else None
        if handed is None:  # the saved run's plan of this step says which items its first micro-batches held
            old = self.rows(members, saved, epoch, s)
            handed = sorted(int(members[i]) for rank in old for mb in rank[:done] for i in (mb or ()))
        ran = set(handed)
        rest = np.array([m for m in members.tolist() if m not in ran], dtype=np.int64)
        if rest.size == 0:
            return None
        plan = self.rows(rest, self.settings, epoch, s)
        return Partial(epoch, s, done, [[rest[mb].tolist() if mb else [] for mb in r] for r in plan], handed)
