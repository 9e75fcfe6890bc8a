"""What every peer planner returns, and the one-line refusal a peer's own check becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from balance_batch.errors import UserError
from balance_batch.greedy import Schedule


class PeerRefusal(UserError, ValueError):
    """A peer refuses this input the way its own code does (an assert, a ValueError, a dropped sample the harness
    cannot drop): one line naming the planner, what it met and what would be valid."""


@dataclass
class PeerPlan:
    """A peer's per-rank schedules, before the harness aligns them for lock-step ranks.

    ``schedules``: per rank, the micro-batches in the order the peer runs them; ``None`` is a step the peer itself
    leaves empty (fairseq's fill value, a round TRL closes with a row empty). ``spread`` says in words how the peer
    puts micro-batches on ranks; ``differs`` lists, in words, every place the harness runs something the peer would
    not (it is recorded, never silent); ``knobs`` are the peer's settings this plan used.
    """

    schedules: list[Schedule]
    knobs: dict[str, Any]
    spread: str
    differs: list[str] = field(default_factory=list)
    peer_empty: int = 0  # of the None steps, how many the peer itself runs (fairseq's empty batches)


def budget_of(name: str, budget: Optional[int]) -> int:
    """The token budget a peer needs, or its one-line refusal."""
    if budget is None:
        raise PeerRefusal(f"planner: {name} needs a token budget (set mtpm=<tokens>)")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise PeerRefusal(f"mtpm: must be a positive integer for planner {name}, got {budget!r}")
    return budget


def refuse_over(name: str, lengths: Sequence[int], limit: int, what: str, peer_does: str) -> None:
    """Refuse, in one line, the first sequence longer than ``limit`` (``what`` the limit is, ``peer_does`` with it)."""
    for i, n in enumerate(lengths):
        if n > limit:
            raise PeerRefusal(f"planner: {name} refuses example {i} of {n} tokens, over {what} {limit} ({peer_does}); "
                              f"raise mtpm to at least {max(lengths)} or use planner=balanced, which runs it alone")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    return ceil_div(n, multiple) * multiple


def deal_round_robin(batches: Sequence[Optional[list[int]]], world_size: int) -> list[Schedule]:
    """Micro-batch i to rank i mod W, in order (NeMo-RL's bins, fairseq's ShardedIterator); a short rank is left short
    (the caller says what fills it)."""
    return [list(batches[r::world_size]) for r in range(world_size)]
