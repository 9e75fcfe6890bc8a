"""One pass's plan: which rank runs which examples in which step, by the chosen planner and layout (``plan_step``, the
library's entry point); its plan.json and the check of one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from balance_batch.balanced import balanced_schedules
from balance_batch.cost import LAYOUTS, CostModel
from balance_batch.errors import check_choice, positive_int
from balance_batch.greedy import Schedule, align_schedules, deal_to_ranks, length_order, microbatches_for_rank
from balance_batch.knobs import Knobs, check_knobs, checked_groups, plan_with_knobs
from balance_batch.peers import PEER_NAMES, PEERS, peer_record, plan_peer
from balance_batch.stats import PlanStats, lower_bound_steps, plan_stats

PLANNERS = ("greedy", "balanced") + PEER_NAMES  # the two of this harness, then the peers (balance_batch/peers/)
PLAN_JSON_VERSION = 1
PLAN_FILE = "plan.json"  # a point's plan, in its output folder (Plan.to_json; read back by reports/)


@dataclass
class Plan:
    """Per-rank schedules for one pass and what they cost."""

    schedules: list[Schedule]
    stats: PlanStats = field(repr=False)
    max_tokens_per_microbatch: Optional[int] = None
    micro_batch_size: int = 1
    layout: str = "padded"
    planner: str = "greedy"
    cost_model: CostModel = field(default_factory=CostModel.tokens)
    lengths: list[int] = field(default_factory=list, repr=False)
    lockstep: bool = False
    max_seqs_per_microbatch: Optional[int] = None  # at most this many sequences per micro-batch (None: no cap)
    peer: Optional[dict] = None  # a peer planner's record (balance_batch/peers/peer_record); None for ours
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
        """results.json's ``plan``: the statistics, and a peer planner's record under ``peer``."""
        return {**self.stats.as_dict(), **({"peer": self.peer} if self.peer else {})}

    def to_json(self, **extra) -> dict:
        """The plan.json document; ``extra`` adds keys such as ``backend``.

        Keys: ``version``, ``world_size``, ``lockstep`` (step s of every rank runs
        together), ``planner``, ``layout``, ``max_tokens_per_microbatch``,
        ``micro_batch_size``, ``max_seqs_per_microbatch`` (null: no cap), ``cost_model`` ({a, b, source}: a sequence of
        length L costs a*L + b*L**2), ``lengths`` (per example) and
        ``schedules``: per rank, per step, a list of example indices or null
        (a dummy step of zero loss weight).
        """
        doc = {
            "version": PLAN_JSON_VERSION,
            "world_size": len(self.schedules),
            "lockstep": self.lockstep,
            "planner": self.planner,
            "layout": self.layout,
            "max_tokens_per_microbatch": self.max_tokens_per_microbatch,
            "micro_batch_size": self.micro_batch_size,
            "max_seqs_per_microbatch": self.max_seqs_per_microbatch,
            "cost_model": self.cost_model.as_dict(),
            "lengths": list(self.lengths),
            "schedules": [[None if b is None else list(b) for b in s] for s in self.schedules],
        }
        if self.peer:
            doc["peer"] = self.peer
        return {"version": doc.pop("version"), **extra, **doc}


def check_plan_json(doc) -> None:
    """Raise ValueError naming the first thing that makes ``doc`` no plan.json document (the format of
    ``Plan.to_json``)."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    version = doc.get("version")
    if type(version) is not int or version != PLAN_JSON_VERSION:  # type(): true is no version 1
        import json

        found = "missing" if version is None else json.dumps(version)  # as the file spells it: 2, "1", true
        raise ValueError(f"'version' is {found}; this code reads version {PLAN_JSON_VERSION} of plan.json")
    for key in ("lengths", "schedules"):
        if not isinstance(doc.get(key), list):
            raise ValueError(f"'{key}' is missing or not a list")
    lengths, schedules = doc["lengths"], doc["schedules"]
    if not all(isinstance(n, int) and n >= 0 for n in lengths):
        raise ValueError("'lengths' must be non-negative integers")
    if not schedules or not all(isinstance(s, list) for s in schedules):
        raise ValueError("'schedules' must be a non-empty list of per-rank lists")
    if doc.get("world_size") is not None and doc["world_size"] != len(schedules):
        raise ValueError(f"'world_size' is {doc['world_size']} but there are {len(schedules)} schedules")
    layout = doc.get("layout", "padded")
    if layout not in LAYOUTS:
        raise ValueError(f"'layout' is {layout!r} (valid: {', '.join(LAYOUTS)})")
    for r, schedule in enumerate(schedules):
        for s, batch in enumerate(schedule):
            if batch is None:
                continue
            indices_ok = isinstance(batch, list) and all(isinstance(i, int) and 0 <= i < len(lengths) for i in batch)
            if not batch or not indices_ok:
                raise ValueError(f"schedules[{r}][{s}] must be null or a non-empty list of indices into 'lengths'")
    if doc.get("lockstep", True) and len({len(s) for s in schedules}) > 1:
        raise ValueError("'lockstep' is true but the ranks' schedules differ in length")
    cap = doc.get("max_seqs_per_microbatch")
    if cap is not None and not (type(cap) is int and cap > 0):
        raise ValueError("'max_seqs_per_microbatch' must be null or a positive integer")
    cm = doc.get("cost_model")
    if cm is not None and not (isinstance(cm, dict) and all(isinstance(cm.get(k), (int, float)) for k in ("a", "b"))):
        raise ValueError("'cost_model' must be {\"a\": number, \"b\": number, \"source\": text}")


def given_plan(
    schedules: Sequence[Schedule],
    lengths: Sequence[int],
    align: bool = False,
    layout: str = "padded",
    cost_model: Optional[CostModel] = None,
) -> Plan:
    """A plan given whole, per rank and step (harness/calibration.py's shapes): no planner runs, only the statistics.

    With ``align`` (lock-step ranks) shorter schedules are padded with ``None``; without it ``None`` entries are
    dropped, as ``plan_batch`` does for ranks that run independently.
    """
    check_choice("layout", layout, LAYOUTS)
    lengths = [int(n) for n in lengths]
    cost_model = cost_model or CostModel.tokens()
    for r, schedule in enumerate(schedules):
        for batch in schedule:
            if batch is not None and (not batch or any(not 0 <= i < len(lengths) for i in batch)):
                raise ValueError(f"a given plan's rank {r} has a micro-batch that is empty or indexes past the "
                                 f"{len(lengths)} examples: {batch!r}")
    rows = [[None if b is None else list(b) for b in s] for s in schedules]
    rows = align_schedules(rows) if align else [[b for b in s if b is not None] for s in rows]
    stats = plan_stats(rows, lengths, layout=layout, cost_model=cost_model, lockstep=align, planner="given")
    return Plan(schedules=rows, stats=stats, layout=layout, planner="given", cost_model=cost_model, lengths=lengths,
                lockstep=align)


def _greedy_schedules(lengths: list[int], world_size: int, max_tokens: Optional[int], micro_batch_size: int,
                      layout: str, cap: Optional[int], align: bool) -> list[Schedule]:
    """The original greedy planner: sorted, dealt to ranks like cards, each rank's micro-batches filled greedily; with
    ``align`` shorter schedules padded with ``None``."""
    order, sorted_lengths = length_order(lengths)
    sorted_lengths = sorted_lengths.tolist()
    dealt = deal_to_ranks(order, world_size)
    per_rank = [
        microbatches_for_rank(indices, lengths, max_tokens, micro_batch_size, layout, cap,
                              order_lengths=sorted_lengths[r::world_size])  # deal_to_ranks's cards, r, r+W, ...
        for r, indices in enumerate(dealt)
    ]
    return align_schedules(per_rank) if align else [list(s) for s in per_rank]


def plan_batch(
    lengths: Sequence[int],
    world_size: int = 1,
    max_tokens_per_microbatch: Optional[int] = None,
    micro_batch_size: int = 1,
    align: bool = False,
    layout: str = "padded",
    planner: str = "greedy",
    cost_model: Optional[CostModel] = None,
    max_seqs_per_microbatch: Optional[int] = None,
) -> Plan:
    """Plan one pass over ``lengths`` for ``world_size`` ranks.

    ``planner="greedy"`` is the original greedy planner: sort, deal to ranks like cards, form
    each rank's micro-batches greedily (``count * longest <= budget`` padded,
    sum of lengths packed), and for lock-step backends (``align=True``) pad
    shorter schedules with ``None``. ``planner="balanced"`` plans globally for
    the fewest steps and even modeled cost (see balance_batch/balanced/);
    it needs a budget. With ``align=False`` (ranks run independently) its
    empty slots are dropped. The FSDP backend agrees on the step count with a
    collective; computing it here from the same inputs gives the same answer.
    ``max_seqs_per_microbatch`` caps the sequences of every micro-batch, for
    both planners and layouts (None: no cap; with it unset the greedy planner
    is the original, bit for bit).
    """
    check_choice("layout", layout, LAYOUTS)
    check_choice("planner", planner, PLANNERS)
    if world_size <= 0:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    cap = max_seqs_per_microbatch
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
        raise ValueError(f"max_seqs_per_microbatch must be a positive integer or None, got {cap!r}")
    lengths = [int(n) for n in lengths]
    if cost_model is None:
        cost_model = CostModel.tokens()
    record = None
    if planner == "balanced":
        if max_tokens_per_microbatch is None:
            raise ValueError("planner 'balanced' needs max_tokens_per_microbatch (fixed-size slices have no budget to "
                             "balance)")
        if max_tokens_per_microbatch <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens_per_microbatch}")
        grid = balanced_schedules(lengths, world_size, max_tokens_per_microbatch, layout, cost_model, cap)
        schedules = grid if align else [[b for b in s if b is not None] for s in grid]
    elif planner in PEER_NAMES:
        peer = plan_peer(planner, lengths, world_size, max_tokens_per_microbatch, layout, cap)
        rows = [list(s) for s in peer.schedules]
        schedules = align_schedules(rows) if align else [[b for b in s if b is not None] for s in rows]
        record = peer_record(planner, peer, schedules, align)
    else:
        schedules = _greedy_schedules(lengths, world_size, max_tokens_per_microbatch, micro_batch_size, layout, cap,
                                      align)
    stats = plan_stats(
        schedules,
        lengths,
        layout=layout,
        cost_model=cost_model,
        max_tokens=max_tokens_per_microbatch,
        micro_batch_size=micro_batch_size,
        lockstep=align,
        planner=planner,
        max_seqs=cap,
    )
    if record is not None and not PEERS[planner].needs_budget:
        # a fixed count plans without the budget (over_budget still counts what exceeds it): the fewest steps such a
        # planner can take follow from its count per rank, not from a budget it never reads
        stats.lower_bound_steps = lower_bound_steps(lengths, world_size, None,
                                                    record["knobs"]["per_device_train_batch_size"], cap)
    return Plan(
        schedules=schedules,
        stats=stats,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        micro_batch_size=micro_batch_size,
        layout=layout,
        planner=planner,
        cost_model=cost_model,
        lengths=lengths,
        lockstep=align,
        max_seqs_per_microbatch=cap,
        peer=record,
    )


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
    """Plan one optimizer step over a batch already in memory: which rank runs which sequences, in which micro-batches.

    ``lengths``: each sequence's token count (non-negative integers; a list or a numpy array; a sequence of 0 tokens
    is placed in no micro-batch, and ``Plan.empty`` lists it). ``world_size`` ranks
    share the step; every micro-batch holds at most ``max_tokens_per_microbatch`` tokens (``layout="packed"``: the
    sum of its lengths, sequences laid end to end in one row; ``"padded"``: count × longest), but a sequence longer
    than the budget, which gets a micro-batch of its own. ``planner``: ``"balanced"`` (the fewest lock-step steps,
    with every step's micro-batches of about equal modeled cost), ``"greedy"`` (sort, deal to ranks like cards, fill
    greedily) or a peer framework's planner (``balance_batch.PLANNERS``). ``max_seqs_per_microbatch`` caps the
    sequences of any micro-batch (None: no cap). ``max_tokens_per_microbatch=None`` (greedy only) cuts fixed slices
    of ``micro_batch_size`` sequences instead.

    ``cost_model`` prices a sequence of length L as a·L + b·L² (default: its token count; ``CostModel(a, b,
    source)`` or ``cost_model_from_config(model_config, source)`` for a model's attention term).
    ``loss_tokens_per_sequence``: how many of each sequence's tokens the loss counts (a prompt masked out, or L − 1
    for shifted labels); default: all of them.

    The peers' knobs (planners ``"balanced"`` and ``"greedy"``; a peer's planner refuses them):

    - ``groups``: a group id (int) per sequence (a GRPO prompt's responses, a DPO pair: verl's ``force_group_size``).
      A group's sequences share one micro-batch where they fit it together (the budget and the cap); a group that
      does not fit one runs on one rank, in consecutive micro-batches of its own.
    - ``min_microbatches=k`` (verl's ``min_num_micro_batch``) and ``microbatches_multiple_of=k`` (verl's
      ``num_batches_divided_by``, for pipeline parallelism): every rank runs at least k micro-batches, or a multiple
      of k (both given: at least the one, then rounded up to the other). Micro-batches are split (the costliest
      first, never inside a group that fits one) to reach the count; a dummy only where nothing is left to split.
      Needs ``lockstep=True``.
    - ``padded_sequences_multiple_of=k`` (``layout="padded"``, fairseq's ``bsz_mult``, for tensor cores): every
      micro-batch holds a multiple of k sequences, except where k of its longest do not fit the budget (then fewer,
      one over the budget alone) and the one holding the step's shortest sequences, which takes what is left. The
      budget still bounds count × longest. Not with ``groups``.

    Returns a ``Plan``:

    - ``microbatches``: per rank, its micro-batches in order, each a list of indices into ``lengths``; every rank
      gets the same number, an empty list being a dummy the rank still runs (zero loss weight) so lock-step ranks
      (FSDP, any collective per micro-batch) never wait on each other. ``lockstep=False`` (ranks that never meet
      inside a step) drops the dummies instead.
    - ``cost_per_rank``: each rank's modeled cost; ``stats`` holds the rest (pad efficiency, critical path, ...).
    - ``real_tokens`` and ``loss_tokens``: the step's totals over every rank, known before the step runs, so a
      loss summed per token and divided by ``loss_tokens`` needs no all-reduce of the denominator.

    The plan is a pure function of its arguments: every rank computes the same one with no collective. A bad
    argument raises one ``ValueError`` naming it and what would be valid.
    """
    n = _checked_lengths(lengths)
    world_size = positive_int("world_size", world_size)
    check_choice("layout", layout, LAYOUTS)
    check_choice("planner", planner, PLANNERS)
    if max_tokens_per_microbatch is None and planner == "balanced":
        raise ValueError("max_tokens_per_microbatch: planner 'balanced' needs a token budget (a positive integer); "
                         "None (fixed slices of micro_batch_size sequences) is for planner 'greedy'")
    budget = positive_int("max_tokens_per_microbatch", max_tokens_per_microbatch, none_ok=True)
    cap = positive_int("max_seqs_per_microbatch", max_seqs_per_microbatch, none_ok=True)
    mbs = positive_int("micro_batch_size", micro_batch_size)
    loss = _checked_loss_tokens(loss_tokens_per_sequence, n)
    knobs = Knobs(checked_groups(groups, len(n)), positive_int("min_microbatches", min_microbatches, none_ok=True),
                  positive_int("microbatches_multiple_of", microbatches_multiple_of, none_ok=True),
                  positive_int("padded_sequences_multiple_of", padded_sequences_multiple_of, none_ok=True))
    check_knobs(knobs, planner=planner, layout=layout, budget=budget, lockstep=bool(lockstep))
    kept = [i for i, x in enumerate(n) if x > 0]
    if len(kept) == len(n) and not knobs.given():  # the planners as they are (the greedy bit-exact)
        plan = plan_batch(n, world_size, budget, mbs, align=bool(lockstep), layout=layout, planner=planner,
                          cost_model=cost_model, max_seqs_per_microbatch=cap)
    else:
        plan = _plan_kept(n, kept, knobs, world_size, budget, mbs, bool(lockstep), layout, planner, cost_model, cap)
    plan.loss_tokens = plan.stats.real_tokens if loss is None else loss
    return plan


def _plan_kept(n: list[int], kept: list[int], knobs: Knobs, world_size: int, budget: Optional[int], mbs: int,
               lockstep: bool, layout: str, planner: str, cost_model: Optional[CostModel], cap: Optional[int]) -> Plan:
    """``plan_step`` over the sequences of positive length (``kept``) under the peers' knobs; the zero-length ones
    in ``Plan.empty``."""
    sub = [n[i] for i in kept]
    cost_model = cost_model or CostModel.tokens()
    if knobs.given():
        groups = None if knobs.groups is None else [knobs.groups[i] for i in kept]

        def base(unit_lengths: list[int], unit_cap: Optional[int]) -> list[Schedule]:
            return plan_batch(unit_lengths, world_size, budget, mbs, align=True, layout=layout, planner=planner,
                              cost_model=cost_model, max_seqs_per_microbatch=unit_cap).schedules

        rows = plan_with_knobs(sub, knobs._replace(groups=groups), world_size=world_size, budget=budget, layout=layout,
                               planner=planner, cost_model=cost_model, cap=cap, base=base)
        rows = rows if lockstep else [[b for b in s if b is not None] for s in rows]
        stats = plan_stats(rows, sub, layout=layout, cost_model=cost_model, max_tokens=budget, micro_batch_size=mbs,
                           lockstep=lockstep, planner=planner, max_seqs=cap)
        plan = Plan(schedules=rows, stats=stats, max_tokens_per_microbatch=budget, micro_batch_size=mbs, layout=layout,
                    planner=planner, cost_model=cost_model, lockstep=lockstep, max_seqs_per_microbatch=cap)
    else:
        plan = plan_batch(sub, world_size, budget, mbs, align=lockstep, layout=layout, planner=planner,
                          cost_model=cost_model, max_seqs_per_microbatch=cap)
    plan.schedules = [[None if b is None else [kept[j] for j in b] for b in s] for s in plan.schedules]
    plan.lengths = list(n)
    plan.empty = [i for i, x in enumerate(n) if x == 0]
    return plan


def _checked_lengths(lengths) -> list[int]:
    """``lengths`` as a list of ints, or one ValueError saying what is wrong with it."""
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"lengths: must be a sequence of non-negative integers ({exc})") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"lengths: must be a flat sequence of non-negative integers, got {_shown(lengths)}")
    if arr.size and int(arr.min()) < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"lengths: every length must be a non-negative integer; lengths[{i}] is {int(arr[i])}")
    return arr.tolist()


def _checked_loss_tokens(loss_tokens, lengths: list[int]) -> Optional[int]:
    """The step's loss tokens from per-sequence counts (None: not given), or one ValueError."""
    if loss_tokens is None:
        return None
    arr = np.asarray(loss_tokens)
    if arr.ndim != 1 or len(arr) != len(lengths) or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"loss_tokens_per_sequence: must be one integer per sequence ({len(lengths)}), got "
                         f"{_shown(loss_tokens)}")
    bad = np.flatnonzero((arr < 0) | (arr > np.asarray(lengths, dtype=np.int64)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"loss_tokens_per_sequence: each count must be between 0 and its sequence's length; "
                         f"loss_tokens_per_sequence[{i}] is {int(arr[i])} for a length of {lengths[i]}")
    return int(arr.sum())


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
