"""A token-budget batch sampler for a dataset: seeded epochs cut into optimizer steps (a count of sequences, or a
token count that may ramp up), each step planned over the ranks into micro-batches by the library's planner.

No torch here: ``iter(sampler)`` yields lists of dataset indices, which is what ``torch.utils.data.DataLoader``'s
``batch_sampler`` takes; the packing collate is in ``balance_batch.collate``.

Every rank builds the same sampler (same lengths, seed, budget, world size) and computes the same plan of every
step, so ranks agree without a collective: each gets the same number of micro-batches in every step (an empty list
is a dummy it must still run, so lock-step backends such as FSDP2 do not hang), and each step's token and loss-token
totals over all ranks are known before the step runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np

from balance_batch.balanced import balanced_schedules
from balance_batch.cost import LAYOUTS, CostModel
from balance_batch.errors import check_choice, positive_int
from balance_batch.knobs import Knobs, check_knobs, checked_groups, plan_with_knobs
from balance_batch.plan import PLANNERS, plan_step
from balance_batch.sampler_state import STATE_VERSION, PlanSettings, check_state
from balance_batch.world import resolve_world

Schedule = Union[int, Sequence[Sequence[int]]]  # a step size: a number, or [(consumed, size), ...]
_PLAN_CACHE = 64  # planned steps kept, so iter() (a DataLoader's prefetch) and steps() plan each step once


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


def _ramp(size: Schedule, key: str = "tokens_per_step") -> list[tuple[int, int]]:
    """A step size (``key``: tokens_per_step or sequences_per_step) as [(threshold, size), ...] from threshold 0,
    thresholds increasing."""
    if not isinstance(size, (list, tuple)):
        positive_int(key, size, who="TokenBudgetSampler")
        return [(0, int(size))]
    unit = key.split("_")[0]
    bad = ValueError(f"TokenBudgetSampler: {key} must be a positive integer or a schedule "
                     f"[(consumed_{unit}, {key}), ...] starting at 0 with increasing thresholds and "
                     f"positive sizes, got {size!r}")
    try:
        pairs = [(int(c), int(t)) for c, t in size]
    except (TypeError, ValueError):
        raise bad from None
    ok = (pairs and pairs[0][0] == 0 and all(t > 0 for _, t in pairs)
          and all(a[0] < b[0] for a, b in zip(pairs, pairs[1:])))
    if not ok:
        raise bad
    return pairs


def megatron_rampup(rampup, final: Schedule, key: str) -> list[tuple[int, int]]:
    """Megatron-LM's ``--rampup-batch-size start increment over`` as a threshold schedule: the step size starts at
    ``start`` and grows by ``increment`` each time over / ((final - start) / increment) more sequences (or tokens) are
    consumed, reaching ``final`` once ``over`` are (Megatron: size = start + increment * floor(consumed / (over /
    increments)), so the j-th increment applies from ceil(j * over / increments) on, computed exactly here)."""
    bad = (f"TokenBudgetSampler: rampup must be (start, increment, over) with 0 < start <= {key}, increment > 0 "
           f"dividing {key} - start, and over >= 0 (Megatron-LM's rampup_batch_size), got {rampup!r}")
    if isinstance(final, (list, tuple)):
        raise ValueError(f"TokenBudgetSampler: rampup: {key} must then be the final size (a positive integer), not "
                         "a schedule: give one or the other")
    final = positive_int(key, final, who="TokenBudgetSampler")
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


def _epoch_arg(method: str, epoch) -> int:
    """``epoch`` as an int, or one ValueError naming the method it was given to."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"TokenBudgetSampler.{method}: epoch must be a non-negative integer, got {epoch!r}")
    return int(epoch)


class _Partial(NamedTuple):
    """A step resumed mid-way: ``done`` of its micro-batches ran (under the saved plan); ``rest`` (per rank, lists of
    item ids) is what remains, re-planned when the plan settings changed, else None (the plan's own tail)."""

    epoch: int
    step: int
    done: int
    rest: Optional[list]
    handed: Optional[list]  # with ``rest``: the step's items already handed out, all ranks


class TokenBudgetSampler:
    """Optimizer steps of a dataset, planned into equal-count micro-batches per rank; see docs/library.md.

    ``lengths``: tokens of each dataset item. ``max_tokens_per_microbatch``: the budget of one micro-batch (packed:
    the sum of lengths; padded: count x longest); a longer sequence runs alone. A step is ``sequences_per_step``
    sequences, or at most ``tokens_per_step`` tokens over all ranks (a number, or a ramp
    ``[(consumed_tokens, tokens_per_step), ...]``: the size from the last threshold the tokens consumed before the step
    have reached). ``world_size`` / ``rank``: default the initialised ``torch.distributed`` group's
    (``process_group``, default the whole job), as ``DistributedSampler``'s do. ``loss_tokens_per_sequence``: per
    item, the tokens its loss counts (default length - 1: a causal LM predicts every token but the first, as
    ``balance_batch.collate.pack_collate`` lays it out). ``cost_model`` (default: cost = tokens) is what the planner
    balances; ``max_seqs_per_microbatch`` caps a micro-batch's sequences. ``lengths`` and ``loss_tokens`` (int64
    arrays, one entry per item), ``world_size``, ``rank`` and ``epoch`` are public, read-only.

    ``sequences_per_step`` may ramp too (``[(consumed_sequences, size), ...]``); ``rampup=(start, increment, over)``
    is Megatron-LM's ramp to the size given (sequences or tokens), made into such a list (``megatron_rampup``). The
    peers' knobs (``plan_step``'s docstring, docs/library.md): ``groups`` (a group id per item: the epoch's order
    shuffles groups, a step holds whole groups, a group that fits a micro-batch shares one), ``min_microbatches``,
    ``microbatches_multiple_of`` and ``padded_sequences_multiple_of``. An item of 0 tokens is in no step.

    ``longest_first=True`` (as Hugging Face's ``LengthGroupedSampler``) puts each epoch's longest item (its group,
    with ``groups``) at the front of the epoch's order, so it is in the epoch's first step, and runs the micro-batch
    slot that holds it first on every rank: on its rank, the longest item's micro-batch is the step's first, so a
    budget too large for the memory fails at once rather than hours in.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens_per_microbatch: int,
        world_size: Optional[int] = None,
        rank: Optional[int] = None,
        process_group: Any = None,
        seed: int = 0,
        shuffle: bool = True,
        sequences_per_step: Optional[int] = None,
        tokens_per_step: Optional[Schedule] = None,
        layout: str = "packed",
        planner: str = "balanced",
        drop_last: bool = False,
        max_seqs_per_microbatch: Optional[int] = None,
        loss_tokens_per_sequence: Optional[Sequence[int]] = None,
        cost_model: Optional[CostModel] = None,
        groups: Optional[Sequence[int]] = None,
        min_microbatches: Optional[int] = None,
        microbatches_multiple_of: Optional[int] = None,
        padded_sequences_multiple_of: Optional[int] = None,
        rampup: Optional[Sequence[int]] = None,
        longest_first: bool = False,
    ):
        who = "TokenBudgetSampler"
        positive_int("max_tokens_per_microbatch", max_tokens_per_microbatch, who=who)
        world_size, rank = resolve_world(world_size, rank, process_group)
        if (sequences_per_step is None) == (tokens_per_step is None):
            raise ValueError("TokenBudgetSampler: give exactly one of sequences_per_step and tokens_per_step, got "
                             f"{'both' if sequences_per_step is not None else 'neither'}")
        key, size = (("sequences_per_step", sequences_per_step) if tokens_per_step is None
                     else ("tokens_per_step", tokens_per_step))
        self._unit = key.split("_")[0]  # what the ramp counts: "sequences" or "tokens"
        self._ramp = megatron_rampup(rampup, size, key) if rampup is not None else _ramp(size, key)
        check_choice("layout", layout, LAYOUTS, who=who)
        check_choice("planner", planner, PLANNERS, who=who)
        positive_int("max_seqs_per_microbatch", max_seqs_per_microbatch, none_ok=True, who=who)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"TokenBudgetSampler: seed must be an integer, got {seed!r}")
        if not isinstance(longest_first, (bool, np.bool_)):
            raise ValueError(f"TokenBudgetSampler: longest_first must be True or False, got {longest_first!r}")
        L = np.asarray(lengths)
        if L.ndim != 1 or L.size == 0 or not np.issubdtype(L.dtype, np.integer) or (L < 0).any() or not L.any():
            raise ValueError("TokenBudgetSampler: lengths must be a sequence of non-negative integers, at least one "
                             "positive (an item of 0 tokens is in no step)")
        self.lengths = L.astype(np.int64)
        self.groups = checked_groups(groups, len(L), who=who)
        knobs = Knobs(None, *(positive_int(k, v, none_ok=True, who=who) for k, v in (
            ("min_microbatches", min_microbatches), ("microbatches_multiple_of", microbatches_multiple_of),
            ("padded_sequences_multiple_of", padded_sequences_multiple_of))))
        check_knobs(knobs._replace(groups=self.groups), planner=planner, layout=layout,
                    budget=max_tokens_per_microbatch, who=who)
        if loss_tokens_per_sequence is None:
            self.loss_tokens = np.maximum(self.lengths - 1, 0)
        else:
            lt = np.asarray(loss_tokens_per_sequence)
            if (lt.shape != L.shape or not np.issubdtype(lt.dtype, np.integer) or (lt < 0).any()
                    or (lt > self.lengths).any()):
                raise ValueError("TokenBudgetSampler: loss_tokens_per_sequence must give, per item, an integer in "
                                 "[0, its length]")
            self.loss_tokens = lt.astype(np.int64)
        self.max_tokens_per_microbatch = int(max_tokens_per_microbatch)
        self.world_size, self.rank, self.seed = world_size, rank, int(seed)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.longest_first = bool(longest_first)
        # a number, or the ramp as [[consumed_sequences, size], ...] (given so, or from rampup); None: sized in tokens
        self.sequences_per_step = None if self._unit == "tokens" else int(size) if len(self._ramp) == 1 and \
            rampup is None and not isinstance(size, (list, tuple)) else [list(p) for p in self._ramp]
        self.layout, self.planner = layout, planner
        self.max_seqs_per_microbatch = max_seqs_per_microbatch
        self.cost_model = cost_model or CostModel.tokens()
        self._settings = PlanSettings(self.max_tokens_per_microbatch, self.world_size, layout, planner,
                                      max_seqs_per_microbatch, self.cost_model, *knobs[1:])
        self._epoch_starts: dict[int, tuple[int, int, int]] = {0: (0, 0, 0)}  # epoch -> steps, tokens, sequences before
        self._plans: OrderedDict = OrderedDict()
        self._counts: dict[int, np.ndarray] = {}  # epoch -> micro-batches per step (-1: not planned yet)
        self._cut_epoch: Optional[int] = None
        self._start(0, 0)

    def _start(self, epoch: int, position: int, partial: Optional[_Partial] = None) -> None:
        """Put the training position at step ``position`` of ``epoch`` (``partial``: resumed mid-way into it)."""
        self._epoch, self._position, self._partial = epoch, position, partial
        self._generation = getattr(self, "_generation", 0) + 1  # iterators of an earlier position no longer report
        self._stepped = False  # whether steps() has yielded since: then it, not a loader's iterator, is the position
        self._handed: Optional[tuple[int, int, int]] = None  # furthest (epoch, step, micro-batch) iter() handed out

    # ------------------------------------------------------------------ the epoch's steps

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's items in order: a seeded permutation of the items, or with ``groups`` of the groups (each
        group's items together, in index order), groups in the order they first appear; items of 0 tokens left out.
        With ``longest_first``, the unit (item or group) holding the longest item is moved to the front (the first of
        equal longest items in that order), the rest keeping their order."""
        if self.groups is None:
            order = np.arange(len(self.lengths)) if not self.shuffle else \
                np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
        else:
            _, first, inv = np.unique(np.asarray(self.groups), return_index=True, return_inverse=True)
            rank = np.empty(len(first), dtype=np.int64)
            rank[np.argsort(first, kind="stable")] = np.arange(len(first))  # groups by first appearance
            if self.shuffle:
                rank = np.random.default_rng([self.seed, epoch]).permutation(len(first))[rank]
            order = np.argsort(rank[inv.ravel()], kind="stable")
        order = order if self.lengths.all() else order[self.lengths[order] > 0]
        if self.longest_first:
            units = self._unit_bounds(order)
            k = int(np.searchsorted(units, int(np.argmax(self.lengths[order])), side="right")) - 1
            a, b = int(units[k]), int(units[k + 1])
            order = np.concatenate([order[a:b], order[:a], order[b:]])
        return order

    def _unit_bounds(self, order: np.ndarray) -> np.ndarray:
        """Where each cut unit starts in ``order`` (an item, or a group's items), and its end: len(units) + 1."""
        if self.groups is None:
            return np.arange(len(order) + 1)
        g = np.asarray(self.groups)[order]
        return np.concatenate([[0], np.flatnonzero(g[1:] != g[:-1]) + 1, [len(order)]])

    def _cut(self, epoch: int):
        """``_cut_steps(epoch)``, kept for the epoch last asked about."""
        if self._cut_epoch != epoch:
            self._cut_value, self._cut_epoch = self._cut_steps(epoch), epoch
        return self._cut_value

    def _cut_steps(self, epoch: int):
        """(order, step bounds [(start, end)] into order, (tokens, sequences) consumed before each step, (tokens,
        sequences) consumed after the epoch) for ``epoch``.

        A step is the most cut units (items, or whole groups) from where the last ended whose sequences (or tokens)
        stay within the step size, at least one. The last step is short ("not full", dropped with ``drop_last``) when
        one more unit of the largest would still have fitted."""
        order = self._order(epoch)
        tokens = np.concatenate([[0], np.cumsum(self.lengths[order])])
        units = self._unit_bounds(order)
        unit_tokens = tokens[units]
        by_count = self._unit == "sequences"
        prefix = units if by_count else unit_tokens
        n = len(units) - 1
        slack = (int(np.diff(units).max()) - 1) if by_count else int(np.diff(unit_tokens).max())
        _, consumed, sequences = self._epoch_start(epoch)
        bounds, before, p = [], [], 0
        while p < n:
            target = self._target(sequences if by_count else consumed)
            q = max(p + 1, int(np.searchsorted(prefix, prefix[p] + target, side="right")) - 1)
            full = q < n or int(prefix[q] - prefix[p]) >= target - slack
            if q == n and not full and self.drop_last:
                break
            bounds.append((int(units[p]), int(units[q])))
            before.append((consumed, sequences))
            consumed += int(unit_tokens[q] - unit_tokens[p])
            sequences += int(units[q] - units[p])
            p = q
        return order, bounds, before, (consumed, sequences)

    def _target(self, consumed: int) -> int:
        return next(t for c, t in reversed(self._ramp) if consumed >= c)

    def _epoch_start(self, epoch: int) -> tuple[int, int, int]:
        """Steps, tokens and sequences of all epochs before ``epoch`` (each epoch's cut depends on those before it)."""
        known = max(e for e in self._epoch_starts if e <= epoch)
        while known < epoch:
            steps = self._epoch_starts[known][0]
            _, bounds, _, end = self._cut_value if self._cut_epoch == known else self._cut_steps(known)
            self._epoch_starts[known + 1] = (steps + len(bounds), *end)
            known += 1
        return self._epoch_starts[epoch]

    @property
    def epoch(self) -> int:
        return self._epoch

    def steps_before(self, epoch: int) -> int:
        """Optimizer steps of all epochs before ``epoch`` (``steps_before(3)``: the steps of 3 epochs from the start;
        with a token ramp, each epoch's count depends on the tokens before it)."""
        return self._epoch_start(_epoch_arg("steps_before", epoch))[0]

    @property
    def steps_in_epoch(self) -> int:
        """Optimizer steps in the current epoch (all of them, including those already taken)."""
        return len(self._cut(self._epoch)[1])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new seeded order); the current epoch keeps its position (so a resumed run may call it)."""
        epoch = _epoch_arg("set_epoch", epoch)
        if epoch != self._epoch:
            self._start(epoch, 0)

    def _position_now(self) -> tuple[int, int, int]:
        """(epoch, step, micro-batch) training has reached: steps()'s, or, where only a loader's iterator has taken
        this epoch's micro-batches, how far it handed them out. The micro-batch counts those this run takes of the
        step (after a resume mid-step, from where it resumed)."""
        if self._handed is not None and not self._stepped:
            return self._handed
        return self._epoch, self._position, 0

    def _move_on_if_done(self) -> None:
        """An epoch consumed to its end moves on to the next (as ``set_epoch(epoch + 1)`` would), never yielding an
        empty epoch: a loop that forgets ``set_epoch`` still sees every item once per epoch, in a new order."""
        epoch, position, _ = self._position_now()
        if position >= len(self._cut(epoch)[1]):
            self._start(epoch + 1, 0)

    # ------------------------------------------------------------------ planning

    def plan(self, step_in_epoch: int, epoch: Optional[int] = None) -> Step:
        """Step ``step_in_epoch`` of ``epoch`` (default: the current one) for this rank, whole; moves no position."""
        epoch = self._epoch if epoch is None else epoch
        key = (epoch, step_in_epoch)
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        order, bounds, before, _ = self._cut(epoch)
        members = self._members(epoch, step_in_epoch)
        schedules = self._schedules(self.lengths[members].tolist(), self._settings, self._groups_of(members))
        schedules = self._longest_slot_first(schedules, members, epoch, step_in_epoch)
        mine = [members[mb].tolist() if mb else [] for mb in schedules[self.rank]]
        self._step_counts(epoch)[step_in_epoch] = len(mine)
        start_steps = self._epoch_start(epoch)[0]
        consumed_tokens, consumed_sequences = before[step_in_epoch]
        step = Step(microbatches=mine, global_tokens=int(self.lengths[members].sum()),
                    global_loss_tokens=int(self.loss_tokens[members].sum()), step=start_steps + step_in_epoch,
                    epoch=epoch, consumed_tokens=consumed_tokens, consumed_sequences=consumed_sequences)
        self._plans[key] = step
        if len(self._plans) > _PLAN_CACHE:
            self._plans.popitem(last=False)
        return step

    def _members(self, epoch: int, step_in_epoch: int) -> np.ndarray:
        order, bounds, _, _ = self._cut(epoch)
        p, q = bounds[step_in_epoch]
        return order[p:q]

    def _longest_slot_first(self, schedules: list[list], ids: np.ndarray, epoch: int, step_in_epoch: int) -> list[list]:
        """``schedules`` (per rank, micro-batches of indices into ``ids``) with, under ``longest_first`` in the
        epoch's first step, the micro-batch slot holding the epoch's longest item moved first on every rank (the
        ranks' micro-batches run in lock-step, slot by slot, so the slot moves whole); as they are otherwise."""
        if not self.longest_first or step_in_epoch != 0:
            return schedules
        first = self._members(epoch, 0)  # the epoch's first step holds its longest item (``_order``)
        at = np.flatnonzero(ids == first[int(np.argmax(self.lengths[first]))])
        if at.size == 0:  # it ran before a resume mid-step: what is left keeps its order
            return schedules
        slot = next((s for rank in schedules for s, mb in enumerate(rank) if mb and int(at[0]) in mb), 0)
        return [[rank[slot], *rank[:slot], *rank[slot + 1:]] if slot < len(rank) else list(rank)
                for rank in schedules]

    def _groups_of(self, members: np.ndarray) -> Optional[list[int]]:
        return None if self.groups is None else np.asarray(self.groups)[members].tolist()

    @staticmethod
    def _schedules(lengths: list[int], settings: PlanSettings, groups: Optional[list[int]] = None) -> list[list]:
        """Per rank, the step's micro-batches (indices into ``lengths``), equal counts, ``None`` or [] for a dummy."""
        B, W = settings.max_tokens_per_microbatch, settings.world_size
        knobs = Knobs(groups, *settings[len(PlanSettings._fields) - 3:])
        if settings.planner == "balanced":
            # plan_step's planner without its refinement rounds: planned every step, it must take milliseconds, and the
            # rounds change a step's critical path by 0.01% (docs/measurements/2026-12-04-sampler.md)
            def base(unit_lengths: list[int], cap: Optional[int]) -> list[list]:
                return balanced_schedules(unit_lengths, W, B, settings.layout, settings.cost_model, cap, work=0)

            if not knobs.given():
                return base(lengths, settings.max_seqs_per_microbatch)
            return plan_with_knobs(lengths, knobs, world_size=W, budget=B, layout=settings.layout,
                                   planner=settings.planner, cost_model=settings.cost_model,
                                   cap=settings.max_seqs_per_microbatch, base=base)
        return plan_step(lengths, world_size=W, max_tokens_per_microbatch=B, layout=settings.layout,
                         planner=settings.planner, cost_model=settings.cost_model,
                         max_seqs_per_microbatch=settings.max_seqs_per_microbatch, **knobs._asdict()).microbatches

    def _partial_at(self, epoch: int, step_in_epoch: int) -> Optional[_Partial]:
        """The resumed-mid-way record when it is of this step, else None."""
        p = self._partial
        return p if p is not None and (p.epoch, p.step) == (epoch, step_in_epoch) else None

    def _step_counts(self, epoch: int) -> np.ndarray:
        """Micro-batches per step of ``epoch`` this rank runs, as planned so far (-1: not planned yet)."""
        return self._counts.setdefault(epoch, np.full(len(self._cut(epoch)[1]), -1, dtype=np.int64))

    def _step_to_run(self, epoch: int, step_in_epoch: int) -> Step:
        """The step as this run takes it: whole, or, resumed mid-way into it, the micro-batches still to run."""
        whole, p = self.plan(step_in_epoch, epoch), self._partial_at(epoch, step_in_epoch)
        if p is None:
            return whole
        rest = whole.microbatches[p.done:] if p.rest is None else [list(mb) for mb in p.rest[self.rank]]
        return dataclasses.replace(whole, microbatches=rest, first_microbatch=p.done)

    # ------------------------------------------------------------------ iteration

    def steps(self) -> Iterator[Step]:
        """This rank's steps from the current position to the end of the epoch; the position moves past each step as
        it is yielded (so ``state_dict()`` after a step is taken resumes at the next one). At the end of an epoch
        that was already consumed, the next epoch's steps (as after ``set_epoch(epoch + 1)``)."""
        if self._position >= self.steps_in_epoch:
            self._start(self._epoch + 1, 0)
        epoch, generation = self._epoch, self._generation
        while self._generation == generation and self._position < self.steps_in_epoch:
            step = self._step_to_run(epoch, self._position)
            self._position += 1
            self._stepped = True
            yield step

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro-batches from the training position to the end of the epoch, one at a time (a
        ``DataLoader``'s ``batch_sampler``), at the end of a consumed epoch the next one's. The iterator has its own
        ``state_dict`` / ``load_state_dict`` at micro-batch granularity (what torchdata's ``StatefulDataLoader``
        saves and restores). It moves the training position only where ``steps()`` is not used: a loop that takes its
        steps from ``steps()`` keeps that position while a loader fetches ahead."""
        self._move_on_if_done()
        return _MicroBatches(self, *self._position_now())

    def _note_handed(self, generation: int, position: tuple[int, int, int]) -> None:
        if generation == self._generation:
            self._handed = position

    def __len__(self) -> int:
        """Micro-batches ``iter`` yields from the training position (at the end of a consumed epoch, the next
        epoch's). Each step's count is planned once and kept: a second call costs nothing."""
        epoch, step, done = self._position_now()
        if step >= len(self._cut(epoch)[1]):
            epoch, step, done = epoch + 1, 0, 0
        counts = self._step_counts(epoch)
        for s in np.flatnonzero(counts[step:] < 0) + step:
            self.plan(int(s), epoch)
        if step >= len(counts):
            return 0
        here = int(counts[step]) if self._partial_at(epoch, step) is None else \
            len(self._step_to_run(epoch, step).microbatches)
        return here - done + int(counts[step + 1:].sum())

    @property
    def batch_size(self) -> None:
        """None: micro-batches vary in size. Read by accelerate's ``prepare`` to shard a batch sampler over its
        processes, which would split this rank's own plan again: refused there (``world_size`` > 1)."""
        if self.world_size > 1:
            raise ValueError(
                f"TokenBudgetSampler: it already plans rank {self.rank}'s micro-batches of {self.world_size}, and "
                "accelerate's prepare() would shard them again over the processes (each rank would run part of its "
                "plan): leave the DataLoader out of accelerator.prepare() and move each batch to the device with "
                "accelerate.utils.send_to_device(batch, accelerator.device)")
        return None

    # ------------------------------------------------------------------ resume

    def _config(self) -> dict:
        if not hasattr(self, "_digest"):  # hashed once: a loader may save the state at every micro-batch
            self._digest = hashlib.sha256(self.lengths.tobytes() + b"|" + self.loss_tokens.tobytes()).hexdigest()[:16]
        return {
            "dataset": f"{len(self.lengths)} items, sha256 {self._digest}",
            "seed": self.seed,
            "shuffle": self.shuffle,
            "sequences_per_step": self.sequences_per_step,
            "tokens_per_step": None if self._unit == "sequences" else [list(p) for p in self._ramp],
            "groups": None if self.groups is None else self._groups_digest(),
            "drop_last": self.drop_last,
            "longest_first": self.longest_first,
            **self._settings.as_config(),
        }

    def _groups_digest(self) -> str:
        return "sha256 " + hashlib.sha256(np.asarray(self.groups, dtype=np.int64).tobytes()).hexdigest()[:16]

    def state_dict(self, after: Optional[Step] = None) -> dict:
        """Where training has got to (plain ints, lists and strings: JSON- and torch.save-able): ``steps()``'s
        position, or, where only a loader's iterator took this epoch's micro-batches, what it handed out. With
        ``after``, the position just after that step (a loader that prefetches whole steps saves the last trained)."""
        if after is not None:
            return self._state(after.epoch, after.step - self._epoch_start(after.epoch)[0] + 1, 0)
        return self._state(*self._position_now())

    def _state(self, epoch: int, step: int, done: int) -> dict:
        """The state at micro-batch ``done`` of the micro-batches this run takes of ``step``."""
        p = self._partial_at(epoch, step)
        microbatch, handed = done, None
        if p is not None:
            microbatch += p.done
            if p.rest is not None:  # re-planned after an elastic resume: say which items ran
                handed = sorted(p.handed + [i for rank in p.rest for mb in rank[:done] for i in (mb or ())])
        steps, tokens, sequences = self._epoch_start(epoch)
        state = {"version": STATE_VERSION, "epoch": epoch, "step_in_epoch": step, "microbatch": microbatch,
                 "epoch_start_step": steps, "epoch_start_tokens": tokens, "epoch_start_sequences": sequences,
                 "config": self._config()}
        if handed is not None:
            state["handed"] = handed
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position. A state saved under another world size, budget, layout, planner, cost
        model or sequence cap resumes too, each remaining step holding the items it would have held; one whose
        settings decide other steps (dataset, seed, shuffle, step size or ramp, drop_last, groups, longest_first) is
        refused in one line."""
        saved = check_state(state, self._config())
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        self._epoch_starts = {0: (0, 0, 0)}
        if "epoch_start_sequences" in state:  # else (a state saved before sequences were counted) counted again here
            self._epoch_starts[epoch] = (int(state["epoch_start_step"]), int(state["epoch_start_tokens"]),
                                         int(state["epoch_start_sequences"]))
        self._cut_epoch, self._plans, self._counts = None, OrderedDict(), {}
        done, handed = int(state.get("microbatch", 0)), state.get("handed")
        partial = None
        if (done or handed) and step < len(self._cut(epoch)[1]):
            partial = self._resume_mid_step(epoch, step, done, handed, PlanSettings.from_config(saved))
            if partial is None:  # nothing of the step is left
                step += 1
        self._start(epoch, step, partial)

    def _resume_mid_step(self, epoch: int, step: int, done: int, handed: Optional[list],
                         saved: PlanSettings) -> Optional[_Partial]:
        """The rest of a step whose first ``done`` micro-batches ran under ``saved`` settings (``handed``: its items
        that ran, where the saved run had re-planned it); None when nothing is left."""
        members = self._members(epoch, step)
        if handed is None and saved.as_config() == self._settings.as_config():
            return _Partial(epoch, step, done, None, None) if done < len(self.plan(step, epoch).microbatches) else None
        if handed is None:  # the saved run's plan of this step says which items its first micro-batches held
            old = self._schedules(self.lengths[members].tolist(), saved, self._groups_of(members))
            old = self._longest_slot_first(old, members, epoch, step)
            handed = sorted(int(members[i]) for rank in old for mb in rank[:done] for i in (mb or ()))
        ran = set(handed)
        rest = np.array([m for m in members.tolist() if m not in ran], dtype=np.int64)
        if rest.size == 0:
            return None
        plan = self._schedules(self.lengths[rest].tolist(), self._settings, self._groups_of(rest))
        plan = self._longest_slot_first(plan, rest, epoch, step)
        return _Partial(epoch, step, done, [[rest[mb].tolist() if mb else [] for mb in r] for r in plan], handed)


class _MicroBatches:
    """``iter(sampler)``: this rank's micro-batches from a position to the end of its epoch, with a state of its own."""

    def __init__(self, sampler: TokenBudgetSampler, epoch: int, step: int, done: int):
        self._sampler, self._generation = sampler, sampler._generation
        self._at = (epoch, step, done)

    def __iter__(self) -> "_MicroBatches":
        return self

    def __next__(self) -> list[int]:
        sampler = self._sampler
        epoch, step, done = self._at
        n_steps = len(sampler._cut(epoch)[1])
        while step < n_steps:
            microbatches = sampler._step_to_run(epoch, step).microbatches
            if done < len(microbatches):
                self._at = (epoch, step, done + 1) if done + 1 < len(microbatches) else (epoch, step + 1, 0)
                sampler._note_handed(self._generation, self._at)
                return list(microbatches[done])
            step, done = step + 1, 0
        self._at = (epoch, step, 0)
        raise StopIteration

    def state_dict(self) -> dict:
        """The sampler's state at the micro-batch this iterator hands out next."""
        return self._sampler._state(*self._at)

    def load_state_dict(self, state: dict) -> None:
        """Resume the sampler (its training position too) and this iterator at ``state``'s micro-batch."""
        sampler = self._sampler
        sampler.load_state_dict(state)
        self._generation, self._at = sampler._generation, (sampler._epoch, sampler._position, 0)
