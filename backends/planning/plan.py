"""One pass's plan: which rank runs which examples in which step, by the chosen planner and layout; its plan.json and
the check of one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from backends.planning.balanced import balanced_schedules
from backends.planning.cost import LAYOUTS, CostModel
from backends.planning.greedy import Schedule, align_schedules, deal_to_ranks, length_order, microbatches_for_rank
from backends.planning.peers import PEER_NAMES, PEERS, peer_record, plan_peer
from backends.planning.stats import PlanStats, lower_bound_steps, plan_stats

PLANNERS = ("greedy", "balanced") + PEER_NAMES  # the two of this harness, then the peers (backends/planning/peers/)
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
    peer: Optional[dict] = None  # a peer planner's record (backends/planning/peers/peer_record); None for ours

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


def check_choice(key: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(f"{key} must be one of {', '.join(valid)}, got {value!r}")


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
    the fewest steps and even modeled cost (see backends/planning/balanced/);
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
