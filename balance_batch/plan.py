"""One step's plan: which rank runs which sequences in which micro-batch (``plan_step``, the library's entry point),
and the pipeline every entry point plans through (``planned_rows``: ``plan_step``, ``TokenBudgetSampler``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from balance_batch.cost import LAYOUTS, CostModel
from balance_batch.errors import check_choice, checked_lengths, checked_loss_tokens, positive_int
from balance_batch.greedy import Schedule, lockstep_schedules
from balance_batch.knobs import check_knobs, checked_groups, plan_with_knobs
from balance_batch.planners import PLANNERS, Knobs, PlanSettings, get_planner
from balance_batch.stats import PlanStats, plan_stats

__all__ = ["PLANNERS", "Plan", "PlanSettings", "Schedule", "plan_step", "planned_rows"]


@dataclass
class Plan:
    """Per-rank micro-batches for one step and what they cost (``plan_step``'s result).

    ``schedules`` holds them as planned: per rank, lists of indices into ``lengths``, ``None`` for a dummy;
    ``microbatches`` is the same with ``[]`` for a dummy.
    """

    schedules: list[Schedule]
    stats: PlanStats = field(repr=False)
    max_tokens_per_microbatch: Optional[int] = None
    micro_batch_size: int = 1
    layout: str = "packed"
    planner: str = "balanced"
    cost_model: CostModel = field(default_factory=CostModel.tokens)
    lengths: list[int] = field(default_factory=list, repr=False)
    lockstep: bool = True
    max_seqs_per_microbatch: Optional[int] = None  # at most this many sequences per micro-batch (None: no cap)
    peer: Optional[dict] = None  # what a registered (peer) planner records of its plan; None for ours
    loss_tokens: Optional[int] = None  # the tokens the loss counts, over every rank (None given: every real token)
    empty: list[int] = field(default_factory=list)  # indices of zero-length sequences, placed in no micro-batch

    def __post_init__(self):
        if self.loss_tokens is None:
            self.loss_tokens = self.stats.real_tokens

    @property
    def microbatches(self) -> list[list[list[int]]]:
        """Per rank, its micro-batches in order: lists of indices into the lengths; an empty list is a dummy (a
        lock-step rank runs it, with zero loss weight, so every rank takes the same number of steps)."""
        return [[[] if b is None else list(b) for b in s] for s in self.schedules]

    @property
    def cost_per_rank(self) -> list[float]:
        """Each rank's modeled cost: the sum of its micro-batches' costs under ``cost_model``."""
        return list(self.stats.cost_per_rank)

    @property
    def real_tokens(self) -> int:
        """The tokens of every sequence planned, pad excluded."""
        return self.stats.real_tokens

    def record(self) -> dict:
        """The statistics as a dict, and a registered planner's record under ``peer``."""
        return {**self.stats.as_dict(), **({"peer": self.peer} if self.peer else {})}


def plan_step(
    lengths: Sequence[int],
    *,
    world_size: int,
    max_tokens_per_microbatch: Optional[int],
    layout: str = "packed",
    planner: str = "balanced",
    max_seqs_per_microbatch: Optional[int] = None,
    loss_tokens_per_sequence: Optional[Sequence[int]] = None,
    cost_model: Optional[CostModel] = None,
    micro_batch_size: int = 1,
    lockstep: bool = True,
    groups: Optional[Sequence[int]] = None,
    min_microbatches: Optional[int] = None,
    microbatches_multiple_of: Optional[int] = None,
    padded_sequences_multiple_of: Optional[int] = None,
) -> Plan:
    """Plan one optimizer step over a batch in memory: which rank runs which sequences, in which micro-batches.

    The plan is a pure function of the arguments, so every rank computes the same one with no collective. Design
    and the knobs at length: docs/library.md and docs/planning.md.

    Args:
        lengths: each sequence's token count (non-negative integers, a list or numpy array). A sequence of 0 tokens
            is placed in no micro-batch (``Plan.empty`` lists it).
        world_size: ranks that share the step.
        max_tokens_per_microbatch: the budget of one micro-batch: the sum of its lengths (``layout="packed"``) or
            count × longest (``"padded"``). A longer sequence gets a micro-batch of its own. None (greedy only):
            fixed slices of ``micro_batch_size`` sequences.
        layout: ``"packed"`` (sequences end to end in one row) or ``"padded"``.
        planner: ``"balanced"`` (the fewest lock-step steps, each step's micro-batches of about equal cost) or
            ``"greedy"`` (sort, deal to ranks like cards, fill greedily); ``balance_batch.PLANNERS``.
        max_seqs_per_microbatch: at most this many sequences in a micro-batch (None: no cap).
        loss_tokens_per_sequence: per sequence, the tokens its loss counts (default: all of them).
        cost_model: what the planner balances, a·L + b·L² per sequence (default: tokens).
        micro_batch_size: the slice size when the budget is None.
        lockstep: keep the dummies that give every rank the same count (FSDP2, any collective per micro-batch);
            False drops them.
        groups: a group id per sequence (a GRPO prompt's responses): a group shares one micro-batch where it fits.
        min_microbatches: every rank runs at least this many micro-batches (split, else dummies).
        microbatches_multiple_of: every rank runs a multiple of this many.
        padded_sequences_multiple_of: padded micro-batches hold a multiple of this many sequences.

    Returns:
        A ``Plan``: ``microbatches`` (per rank, lists of indices into ``lengths``; ``[]`` a dummy to run with zero
        loss weight), ``cost_per_rank``, ``real_tokens`` and ``loss_tokens`` (the step's totals over every rank,
        known before it runs: the loss denominator) and ``stats``.

    Raises:
        ValueError: one line naming the first bad argument and what would be valid.

    Example:
        >>> plan = plan_step([900, 300, 300, 200, 100], world_size=2, max_tokens_per_microbatch=1000)
        >>> plan.microbatches  # rank 0 runs sequences 1-4 in one row, rank 1 sequence 0
        [[[1, 2, 3, 4]], [[0]]]
        >>> plan.loss_tokens
        1800
    """
    arr = checked_lengths(lengths)
    n = arr.tolist()
    settings = checked_settings(world_size=world_size, budget=max_tokens_per_microbatch, layout=layout,
                                planner=planner, max_seqs=max_seqs_per_microbatch, cost_model=cost_model,
                                micro_batch_size=micro_batch_size, lockstep=bool(lockstep),
                                knobs=(min_microbatches, microbatches_multiple_of, padded_sequences_multiple_of),
                                groups=groups is not None)
    group_ids = checked_groups(groups, len(n))
    loss = None if loss_tokens_per_sequence is None else int(checked_loss_tokens(loss_tokens_per_sequence, arr).sum())
    return planned(n, settings, group_ids, loss)


def checked_settings(*, world_size, budget, layout, planner, max_seqs=None, cost_model=None, micro_batch_size=1,
                     lockstep=True, knobs=(None, None, None), groups: bool = False, budget_required: bool = False,
                     who: str = "") -> PlanSettings:
    """The plan settings from a public entry's arguments, each checked once here; one ValueError naming the first bad
    one (``who``: the entry, e.g. ``TokenBudgetSampler``; ``budget_required``: the entry takes no None budget)."""
    key = "max_tokens_per_microbatch"
    spec = get_planner(planner, who)
    if budget is None and spec.needs_budget and not budget_required:
        raise ValueError(f"{who + ': ' if who else ''}{key}: planner {planner!r} needs a token budget (a positive "
                         "integer); None (fixed slices of micro_batch_size sequences) is for planner 'greedy'")
    check_choice("layout", layout, LAYOUTS, who=who)
    knob_names = Knobs._fields
    settings = PlanSettings(
        budget=positive_int(key, budget, none_ok=not budget_required, who=who),
        world_size=positive_int("world_size", world_size, who=who), layout=layout, planner=planner,
        max_seqs=positive_int("max_seqs_per_microbatch", max_seqs, none_ok=True, who=who),
        cost_model=cost_model or CostModel.tokens(),
        knobs=Knobs(*(positive_int(k, v, none_ok=True, who=who) for k, v in zip(knob_names, knobs))),
        micro_batch_size=positive_int("micro_batch_size", micro_batch_size, who=who), lockstep=lockstep)
    check_knobs(settings, groups=groups, takes_knobs=spec.takes_knobs, who=who)
    return settings


def planned_rows(lengths: list[int], settings: PlanSettings, groups: Optional[list[int]] = None
                 ) -> tuple[list[Schedule], Optional[dict]]:
    """The pipeline every entry point plans through, on lengths all positive and settings already checked: the
    planner the registry names, then the knobs (groups, counts) where given, then the dummies (kept for lock-step
    ranks, dropped otherwise). Returns per rank the micro-batches (``None`` a dummy) and what a registered planner
    records (None for ours)."""
    spec = get_planner(settings.planner)
    if groups is None and not settings.knobs.given():
        rows, extra = spec.plan(lengths, settings)
    else:  # the knobs around the planner; ours take them (checked_settings refused them for any other)
        rows, extra = plan_with_knobs(lengths, groups, settings, lambda unit, cap: lockstep_schedules(spec.plan(
            unit, settings._replace(max_seqs=cap))[0])), None
    rows = lockstep_schedules(rows) if settings.lockstep else [[b for b in s if b is not None] for s in rows]
    record = spec.record(extra, rows, settings.lockstep) if spec.record and extra is not None else None
    return rows, record


def planned(lengths: list[int], settings: PlanSettings, groups: Optional[list[int]] = None,
            loss_tokens: Optional[int] = None) -> Plan:
    """``planned_rows`` over the sequences of positive length, with the statistics, as a ``Plan`` (indices into
    ``lengths``; the zero-length ones in ``Plan.empty``)."""
    kept = [i for i, x in enumerate(lengths) if x > 0]
    whole = len(kept) == len(lengths)
    sub = lengths if whole else [lengths[i] for i in kept]
    rows, record = planned_rows(sub, settings, groups if groups is None or whole else [groups[i] for i in kept])
    s = settings
    stats = plan_stats(rows, sub, layout=s.layout, cost_model=s.cost_model, budget=s.budget,
                       micro_batch_size=s.micro_batch_size, lockstep=s.lockstep, planner=s.planner, max_seqs=s.max_seqs)
    bound = get_planner(s.planner).lower_bound_steps
    if bound is not None and record is not None:
        stats.lower_bound_steps = bound(sub, s, record)
    if not whole:
        rows = [[None if b is None else [kept[j] for j in b] for b in r] for r in rows]
    return Plan(schedules=rows, stats=stats, max_tokens_per_microbatch=s.budget, micro_batch_size=s.micro_batch_size,
                layout=s.layout, planner=s.planner, cost_model=s.cost_model, lengths=list(lengths),
                lockstep=s.lockstep, max_seqs_per_microbatch=s.max_seqs, peer=record,
                loss_tokens=loss_tokens, empty=[] if whole else [i for i, x in enumerate(lengths) if x == 0])
