"""What a plan.json costs, rank by rank and step by step: the data behind the plan figure (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from balance_batch.cost import CostModel, microbatch_cost, microbatch_tokens
from reports.plan_json import check_plan_json

# Above this many columns a figure's blocks get too thin to read: consecutive
# steps (or micro-batches) are drawn summed in groups instead.
MAX_COLUMNS = 32


@dataclass(frozen=True)
class Block:
    """One rank's micro-batch at one step (lock-step) or at one position of its own schedule (independent ranks)."""

    rank: int
    step: int
    n_sequences: int
    real_tokens: int
    padding_tokens: int  # count × longest − Σ lengths when padded; 0 when packed
    real_cost: float  # Σ a·L + b·L² over its sequences: what the same sequences cost with no padding
    padding_cost: float  # what the padding adds: count × cost(longest) − real_cost when padded; 0 when packed
    idle_cost: float  # lock-step: the step's slowest rank's cost − this one's (a dummy idles the whole step); else 0
    dummy: bool

    @property
    def cost(self) -> float:
        return self.real_cost + self.padding_cost


@dataclass
class PlanBlocks:
    """Every block of a plan and the totals the plan is judged by."""

    backend: Optional[str]
    planner: Optional[str]
    layout: str
    lockstep: bool
    budget: Optional[int]
    micro_batch_size: Optional[int]
    cost_model: dict
    n_sequences: int
    blocks: list[list[Block]]  # [rank][step]
    step_cost: list[float]  # lock-step: the slowest rank's cost per step; independent ranks: []
    rank_cost: list[float] = field(default_factory=list)
    rank_real_tokens: list[int] = field(default_factory=list)
    rank_padded_tokens: list[int] = field(default_factory=list)
    max_seqs_per_microbatch: Optional[int] = None  # the plan's cap on sequences per micro-batch (None: none)

    @property
    def world_size(self) -> int:
        return len(self.blocks)

    @property
    def n_steps(self) -> int:
        return max((len(b) for b in self.blocks), default=0)

    @property
    def real_tokens(self) -> int:
        return sum(self.rank_real_tokens)

    @property
    def padded_tokens(self) -> int:
        return sum(self.rank_padded_tokens)

    @property
    def pad_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def mean_rank_cost(self) -> float:
        return sum(self.rank_cost) / len(self.rank_cost) if self.rank_cost else 0.0

    @property
    def ideal_cost(self) -> float:
        """The pass with no padding and no waiting: Σ over sequences of a·L + b·L², spread evenly over the ranks."""
        real = sum(b.real_cost for row in self.blocks for b in row)
        return real / self.world_size if self.world_size else 0.0

    @property
    def makespan(self) -> float:
        """Modeled time of the pass: Σ steps of the slowest rank (lock-step), else the slowest rank's total."""
        return sum(self.step_cost) if self.lockstep else max(self.rank_cost, default=0.0)

    @property
    def critical_path(self) -> float:
        """Makespan ÷ mean per-rank cost: 1 when no rank ever waits."""
        mean = self.mean_rank_cost
        return self.makespan / mean if mean > 0 else 1.0

    @property
    def n_microbatches(self) -> list[int]:
        return [sum(not b.dummy for b in row) for row in self.blocks]

    @property
    def n_dummy(self) -> list[int]:
        return [sum(b.dummy for b in row) for row in self.blocks]


def plan_blocks(doc: dict) -> PlanBlocks:
    """The blocks and totals of a plan.json document (raises ValueError when it is not one)."""
    check_plan_json(doc)
    lengths: list[int] = doc["lengths"]
    layout = doc.get("layout", "padded")
    lockstep = bool(doc.get("lockstep", True))
    model = CostModel.from_dict(doc.get("cost_model"))  # none recorded: cost = computed tokens

    # per rank, per step: (count, real tokens, padding tokens, real cost, padding cost, dummy)
    raw: list[list[tuple]] = []
    for schedule in doc["schedules"]:
        row = []
        for batch in schedule:
            if batch is None:
                row.append((0, 0, 0, 0.0, 0.0, True))
                continue
            real = sum(lengths[i] for i in batch)
            real_cost = microbatch_cost(batch, lengths, "packed", model)  # the sequences' own cost, no padding
            padding = microbatch_tokens(batch, lengths, layout) - real
            padding_cost = max(0.0, microbatch_cost(batch, lengths, layout, model) - real_cost)  # max(): rounding only
            row.append((len(batch), real, padding, real_cost, padding_cost, False))
        raw.append(row)

    n_steps = max((len(r) for r in raw), default=0)
    step_cost = [max(r[s][3] + r[s][4] for r in raw) for s in range(n_steps)] if lockstep else []
    blocks = [
        [
            Block(
                rank=rank,
                step=s,
                n_sequences=count,
                real_tokens=real,
                padding_tokens=padding,
                real_cost=real_cost,
                padding_cost=padding_cost,
                idle_cost=(step_cost[s] - (real_cost + padding_cost)) if lockstep else 0.0,
                dummy=dummy,
            )
            for s, (count, real, padding, real_cost, padding_cost, dummy) in enumerate(row)
        ]
        for rank, row in enumerate(raw)
    ]
    return PlanBlocks(
        backend=doc.get("backend"),
        planner=doc.get("planner"),
        layout=layout,
        lockstep=lockstep,
        budget=doc.get("max_tokens_per_microbatch"),
        micro_batch_size=doc.get("micro_batch_size"),
        cost_model=model.as_dict(),
        n_sequences=sum(b.n_sequences for row in blocks for b in row),
        blocks=blocks,
        step_cost=step_cost,
        rank_cost=[sum(b.cost for b in row) for row in blocks],
        rank_real_tokens=[sum(b.real_tokens for b in row) for row in blocks],
        rank_padded_tokens=[sum(b.real_tokens + b.padding_tokens for b in row) for row in blocks],
        max_seqs_per_microbatch=doc.get("max_seqs_per_microbatch"),  # absent from plans written before the cap
    )


def measured_blocks(pb: PlanBlocks, timeline: dict) -> Optional[PlanBlocks]:
    """``pb`` with every block's cost replaced by its measured busy seconds (mean over the timed repeats), from a
    pass's ``timeline`` in results.json (harness/metrics/balance.py); None when the timeline's steps are not the plan's.

    A block's measured time is split between its real tokens and its padding as the model splits it; a dummy
    step's time (a lock-step rank's one-token step) counts as real work of no sequence. Waiting is what the step's
    (lock-step) or the pass's (independent ranks) busiest rank spent beyond it.
    """
    reps = timeline.get("busy_s") or []
    if not reps or len(reps[0]) != pb.world_size:
        return None
    busy = [[sum(rep[r][k] for rep in reps) / len(reps) for k in range(len(reps[0][r]))] for r in range(pb.world_size)]
    rows = []
    for r, row in enumerate(pb.blocks):
        ran = row if pb.lockstep else [b for b in row if not b.dummy]
        if len(ran) != len(busy[r]):
            return None
        times = iter(busy[r])
        out = []
        for b in row:
            if b.dummy and not pb.lockstep:
                out.append(b)  # an independent rank skips it: no time
                continue
            t = next(times)
            share = b.real_cost / b.cost if b.cost > 0 else 1.0
            out.append((b, t * share, t * (1 - share)))
        rows.append(out)
    n_steps = max((len(r) for r in rows), default=0)
    def cost(x) -> float:
        return 0.0 if isinstance(x, Block) else x[1] + x[2]

    step_cost = [max(cost(r[s]) for r in rows if s < len(r)) for s in range(n_steps)] if pb.lockstep else []
    blocks = []
    for row in rows:
        new = []
        for s, x in enumerate(row):
            if isinstance(x, Block):
                new.append(x)
                continue
            b, real, padding = x
            idle = (step_cost[s] - real - padding) if pb.lockstep else 0.0
            new.append(
                Block(b.rank, b.step, b.n_sequences, b.real_tokens, b.padding_tokens, real, padding, idle, b.dummy)
            )
        blocks.append(new)
    return PlanBlocks(
        backend=pb.backend, planner=pb.planner, layout=pb.layout, lockstep=pb.lockstep, budget=pb.budget,
        micro_batch_size=pb.micro_batch_size, cost_model=pb.cost_model, n_sequences=pb.n_sequences, blocks=blocks,
        step_cost=step_cost, rank_cost=[sum(b.cost for b in row) for row in blocks],
        rank_real_tokens=pb.rank_real_tokens, rank_padded_tokens=pb.rank_padded_tokens,
        max_seqs_per_microbatch=pb.max_seqs_per_microbatch,
    )


# --- what the figure draws ---------------------------------------------------

KINDS = ("real", "padding", "idle", "dummy")


@dataclass(frozen=True)
class Rect:
    """One drawn bar segment, in units of the ideal pass (no padding, no waiting: ``PlanBlocks.ideal_cost``).

    One unit for every plan of the same workload and cost model, so two plans drawn
    side by side share a scale; a row ends at makespan ÷ ideal.
    """

    rank: int
    x: float
    width: float
    kind: str  # real | padding | idle (waiting for the slowest rank) | dummy (a dummy step, idle in full)
    n_sequences: int = 0  # the sequences a real segment holds (for its label)
    n_dummy: int = 0  # the dummy steps a dummy segment stands for


@dataclass(frozen=True)
class Column:
    """A lock-step step (or a group of consecutive steps) as one column of the figure."""

    first_step: int
    last_step: int
    x: float
    width: float


@dataclass
class Layout:
    """Everything the figure draws: segments, columns (lock-step), boundaries between micro-batches, the grouping."""

    rects: list[Rect]
    columns: list[Column]
    boundaries: list[tuple[int, float]]  # (rank, x): where one drawn micro-batch (or group) ends and the next starts
    group: int  # steps (lock-step) or micro-batches (independent) summed into one drawn block; 1 = none
    unit: float  # the cost one x unit stands for (the ideal pass)
    total: float  # the longest row's length: makespan ÷ ideal


def _groups(n: int, max_columns: int) -> tuple[int, list[range]]:
    k = max(1, math.ceil(n / max_columns))
    return k, [range(i, min(i + k, n)) for i in range(0, n, k)]


def plan_layout(pb: PlanBlocks, max_columns: int = MAX_COLUMNS) -> Layout:
    """The figure's rectangles: each kind's widths sum to that kind's cost in the plan (÷ the ideal pass)."""
    unit = pb.ideal_cost or 1.0
    rects: list[Rect] = []
    columns: list[Column] = []
    boundaries: list[tuple[int, float]] = []
    if pb.lockstep:
        group, ranges = _groups(pb.n_steps, max_columns)
        x = 0.0
        for steps in ranges:
            width = sum(pb.step_cost[s] for s in steps) / unit
            columns.append(Column(steps[0], steps[-1], x, width))
            for rank, row in enumerate(pb.blocks):
                mine = [row[s] for s in steps]
                dummies = [b for b in mine if b.dummy]
                parts = [
                    ("real", sum(b.real_cost for b in mine), sum(b.n_sequences for b in mine), 0),
                    ("padding", sum(b.padding_cost for b in mine), 0, 0),
                    ("idle", sum(b.idle_cost for b in mine if not b.dummy), 0, 0),
                    ("dummy", sum(b.idle_cost for b in dummies), 0, len(dummies)),
                ]
                at = x
                for kind, c, n_seq, n_dummy in parts:
                    if c > 0 or n_dummy:
                        rects.append(Rect(rank, at, c / unit, kind, n_seq, n_dummy))
                        at += c / unit
            x += width
        total = x
    else:
        group, _ = _groups(pb.n_steps, max_columns)
        slowest = max(pb.rank_cost, default=0.0) / unit
        for rank, row in enumerate(pb.blocks):
            ran = [b for b in row if not b.dummy]  # independent ranks skip null entries
            at = 0.0
            for i in range(0, len(ran), group):
                mine = ran[i : i + group]
                real = sum(b.real_cost for b in mine) / unit
                padding = sum(b.padding_cost for b in mine) / unit
                rects.append(Rect(rank, at, real, "real", sum(b.n_sequences for b in mine)))
                if padding > 0:
                    rects.append(Rect(rank, at + real, padding, "padding"))
                at += real + padding
                if i + group < len(ran):
                    boundaries.append((rank, at))
            if slowest - at > 0:
                rects.append(Rect(rank, at, slowest - at, "idle"))
            skipped = len(row) - len(ran)
            if skipped:
                rects.append(Rect(rank, slowest, 0.0, "dummy", n_dummy=skipped))
        total = slowest
    return Layout(rects, columns, boundaries, group, unit, total)


def kind_totals(layout: Layout, ranks: Optional[Sequence[int]] = None) -> dict[str, float]:
    """Σ drawn width per kind (over ``ranks``, default all), in units of the ideal pass."""
    out = {k: 0.0 for k in KINDS}
    for r in layout.rects:
        if ranks is None or r.rank in ranks:
            out[r.kind] += r.width
    return out
