"""Other frameworks' ways of cutting a batch into micro-batches, as planners the harness measures beside the
library's: each written here from the peer's published algorithm and defaults, with the peer's own layout, budget
semantics, refusals and spread over ranks. ``PEERS`` names them; importing this package registers each with the
library (``balance_batch.planners.register``), so ``plan_step(planner=...)`` plans it through the one pipeline and
``Plan.peer`` holds its record. They are not in ``balance_batch.PLANNERS``, the library's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from balance_batch.planners import Planner, PlanSettings, register
from balance_batch.stats import lower_bound_steps
from harness.peers import automodel, fairseq, nemo_rl, trl, verl
from harness.peers.common import PeerPlan, PeerRefusal


@dataclass(frozen=True)
class Peer:
    """One peer planner: its name, its own layout, the code it follows, whether it takes a cap on sequences per
    micro-batch (and under which of its names) and its plan function ``(lengths, world_size, budget, cap)``."""

    name: str
    layout: str
    source: str
    plan: Callable[[Sequence[int], int, Optional[int], Optional[int]], PeerPlan]
    cap_knob: Optional[str] = None  # the peer's name for max_seqs_per_microbatch; None: it has none
    needs_budget: bool = True  # False: plans without a token budget (TRL's fixed count)


def _no_cap(fn):
    return lambda lengths, world_size, budget, cap: fn(lengths, world_size, budget)


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer(verl.NAME, verl.LAYOUT, verl.SOURCE, _no_cap(verl.plan)),
    Peer(nemo_rl.PACKING, "packed", nemo_rl.SOURCE, _no_cap(nemo_rl.plan_packing)),
    Peer(nemo_rl.DYNAMIC, "padded", nemo_rl.SOURCE, _no_cap(nemo_rl.plan_dynamic)),
    Peer(fairseq.NAME, fairseq.LAYOUT, fairseq.SOURCE,
         lambda lengths, world_size, budget, cap: fairseq.plan(lengths, world_size, budget, max_sentences=cap),
         cap_knob="max_sentences"),
    Peer(trl.FIXED, trl.LAYOUT, trl.SOURCE, _no_cap(trl.plan_fixed), needs_budget=False),
    Peer(trl.BUDGET, trl.LAYOUT, trl.SOURCE, _no_cap(trl.plan_budget)),
    Peer(automodel.NAME, automodel.LAYOUT, automodel.SOURCE,
         lambda lengths, world_size, budget, cap: automodel.plan(lengths, world_size, budget, max_batch_size=cap),
         cap_knob="max_batch_size"),
)}
PEER_NAMES: tuple[str, ...] = tuple(PEERS)


def peer_layout(planner: Optional[str]) -> Optional[str]:
    """The layout a peer runs by default (None: not a peer)."""
    peer = PEERS.get(planner or "")
    return peer.layout if peer else None


def plan_peer(name: str, lengths: Sequence[int], world_size: int, budget: Optional[int], layout: str,
              cap: Optional[int] = None) -> PeerPlan:
    """``name``'s plan; a cap the peer has no knob for is refused, and a layout other than the peer's is noted."""
    peer = PEERS[name]
    if cap is not None and peer.cap_knob is None:
        raise PeerRefusal(f"max_seqs_per_microbatch: {name} has no cap on sequences per micro-batch, so {cap} would be "
                          "ignored; drop it (the peers that take one: "
                          f"{', '.join(p.name for p in PEERS.values() if p.cap_knob)})")
    result = peer.plan(lengths, world_size, budget, cap)
    if cap is not None:
        result.knobs[peer.cap_knob] = cap
    if layout != peer.layout:
        result.differs.append(f"planned by {name}'s own budget ({peer.layout} rows), run {layout}")
    return result


def peer_record(name: str, result: PeerPlan, schedules: Sequence[Sequence[Optional[list[int]]]],
                lockstep: bool) -> dict:
    """What results.json and plan.json record of a peer's plan: who, which code, its knobs, how it spreads over
    ranks, the empty steps it runs itself, the dummies the harness adds for lock-step ranks, and every difference."""
    steps_run = sum(1 for s in schedules for b in s if b is None)
    peer_nones = sum(1 for s in result.schedules for b in s if b is None)
    return {
        "name": name,
        "source": PEERS[name].source,
        "layout": PEERS[name].layout,
        "knobs": dict(result.knobs),
        "spread": result.spread,
        "peer_empty_steps": result.peer_empty if lockstep else 0,
        "harness_dummies": steps_run - (result.peer_empty if lockstep else 0),
        "dropped_empty_steps": 0 if lockstep else peer_nones,
        "differs": list(result.differs),
    }


def _plan(name: str):
    def plan(lengths: list[int], settings: PlanSettings) -> tuple[list, PeerPlan]:
        result = plan_peer(name, lengths, settings.world_size, settings.budget, settings.layout, settings.max_seqs)
        return [list(s) for s in result.schedules], result
    return plan


def _record(name: str):
    return lambda result, schedules, lockstep: peer_record(name, result, schedules, lockstep)


def _count_bound(lengths: list[int], settings: PlanSettings, record: dict) -> int:
    """The fewest steps a planner of a fixed count can take follow from its count per rank, not from a budget it
    never reads (over_budget still counts what exceeds it)."""
    return lower_bound_steps(lengths, settings.world_size, None, record["knobs"]["per_device_train_batch_size"],
                             settings.max_seqs)


for _peer in PEERS.values():  # each refuses a missing budget itself, in its own words
    register(Planner(_peer.name, _plan(_peer.name), needs_budget=False, record=_record(_peer.name),
                     lower_bound_steps=None if _peer.needs_budget else _count_bound))

__all__ = ["PEERS", "PEER_NAMES", "Peer", "PeerPlan", "PeerRefusal", "peer_layout", "peer_record", "plan_peer"]
