"""The planners by name, and the settings every plan is made under.

``PLANNERS`` names the library's two: ``"balanced"`` (the fewest lock-step steps, even cost per step and rank) and
``"greedy"`` (the original: sort, deal to ranks like cards, fill each rank's micro-batches greedily). The registry
maps a name to its record (``Planner``); it is the one place a name becomes a function. A program that measures other
frameworks' planners beside ours (the harness does, in ``harness/peers``) adds them with ``register``; they are then
planned by the same pipeline but are not in ``PLANNERS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

from balance_batch.balanced import balanced_schedules
from balance_batch.balanced.multiple import multiple_of_schedules
from balance_batch.cost import CostModel
from balance_batch.greedy import Schedule, cut_multiple_of, deal_to_ranks, length_order, microbatches_for_rank

PLANNERS = ("greedy", "balanced")


class Knobs(NamedTuple):
    """The count knobs, applied after any planner that takes them (``balance_batch.knobs``); None: not set."""

    min_microbatches: Optional[int] = None
    microbatches_multiple_of: Optional[int] = None
    padded_sequences_multiple_of: Optional[int] = None

    def given(self) -> list[str]:
        return [k for k, v in self._asdict().items() if v is not None]


class PlanSettings(NamedTuple):
    """How a step's sequences are planned: validated once, at the public entry that took them.

    ``budget`` is ``max_tokens_per_microbatch`` (None: fixed slices of ``micro_batch_size``, greedy only);
    ``max_seqs`` is ``max_seqs_per_microbatch``. ``lockstep`` keeps the dummies (``None``) that give every rank the
    same count; ``refine`` runs the balanced planner's refinement rounds (a sampler planning every step leaves them
    out).
    """

    budget: Optional[int]
    world_size: int
    layout: str = "packed"
    planner: str = "balanced"
    max_seqs: Optional[int] = None
    cost_model: CostModel = CostModel.tokens()
    knobs: Knobs = Knobs()
    micro_batch_size: int = 1
    lockstep: bool = True
    refine: bool = True


# A planner's function: (lengths, all positive; settings) -> (per rank, micro-batches of indices into lengths, None
# for a step the planner leaves empty; what it wants recorded of this plan, or None).
PlanFunction = Callable[[list[int], PlanSettings], "tuple[list[Schedule], Any]"]


@dataclass(frozen=True)
class Planner:
    """A planner's record: its name, its function, whether it takes the count knobs and groups (ours do; a peer
    keeps its own semantics and refuses them), whether it needs a budget, and hooks for what a plan records."""

    name: str
    plan: PlanFunction
    takes_knobs: bool = False
    needs_budget: bool = True
    record: Optional[Callable[[Any, list[Schedule], bool], dict]] = None  # (its extra, final rows, lockstep) -> dict
    lower_bound_steps: Optional[Callable[[list[int], PlanSettings, dict], int]] = None  # (lengths, settings, record)


_REGISTRY: dict[str, Planner] = {}


def register(planner: Planner) -> None:
    """Make ``planner.name`` a planner every entry point takes (a name already taken is refused)."""
    if planner.name in _REGISTRY and _REGISTRY[planner.name] != planner:
        raise ValueError(f"planner {planner.name!r} is already registered")
    _REGISTRY[planner.name] = planner


def planner_names() -> tuple[str, ...]:
    """Every registered planner's name: ``PLANNERS``, then any a program registered."""
    return tuple(_REGISTRY)


def get_planner(name: str, who: str = "") -> Planner:
    """The record of ``name``, or one ValueError naming the valid ones."""
    if name not in _REGISTRY:
        lead = f"{who}: planner" if who else "planner"
        raise ValueError(f"{lead} must be one of {', '.join(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def _greedy(lengths: list[int], settings: PlanSettings) -> tuple[list[Schedule], None]:
    """The original greedy planner: sorted, dealt to ranks like cards, each rank's micro-batches filled greedily."""
    order, sorted_lengths = length_order(lengths)
    W, k = settings.world_size, settings.knobs.padded_sequences_multiple_of
    if k is not None:  # padded micro-batches of a multiple of k sequences
        return [cut_multiple_of(dealt, lengths, settings.budget, settings.max_seqs, k)
                for dealt in deal_to_ranks(order, W)], None
    sorted_lengths = sorted_lengths.tolist()
    rows = [microbatches_for_rank(indices, lengths, settings.budget, settings.micro_batch_size, settings.layout,
                                  settings.max_seqs, order_lengths=sorted_lengths[r::W])  # the cards r, r+W, ...
            for r, indices in enumerate(deal_to_ranks(order, W))]
    return rows, None


def _balanced(lengths: list[int], settings: PlanSettings) -> tuple[list[Schedule], None]:
    """The balanced planner (``balance_batch.balanced``); without ``refine``, no refinement rounds."""
    k = settings.knobs.padded_sequences_multiple_of
    if k is not None:  # padded micro-batches of a multiple of k sequences
        return multiple_of_schedules(lengths, settings.world_size, settings.budget, settings.max_seqs, k,
                                     settings.layout, settings.cost_model), None
    return balanced_schedules(lengths, settings.world_size, settings.budget, settings.layout, settings.cost_model,
                              settings.max_seqs, work=None if settings.refine else 0), None


register(Planner("greedy", _greedy, takes_knobs=True, needs_budget=False))
register(Planner("balanced", _balanced, takes_knobs=True))
