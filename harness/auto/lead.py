"""mtpm=auto's two leading budgets, when their speedups cannot be told apart: more pairs, then a stated rule.

The search measures each candidate once (one pair beside mbs=1), so its ranking is by single ratios. The two
leaders are then brought to ``bench.repeat`` pairs each, and while their 95% intervals overlap, more pairs are
measured for both (``bench.repeat`` at a time, up to ``bench.max_repeats``): on a quiet machine the intervals part
after a few, on a noisy one the search stops at the cap and says the two tie, choosing by
``harness.metrics.spread.TIE_RULE`` rather than by whichever median the noise put first.

Pure Python, no torch: ``settle`` takes the measuring as a function, as ``harness.auto.model.search`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from harness.metrics.spread import choose, summary


@dataclass
class Leader:
    """A leading candidate: its budget, its measured peak (per rank max, the largest of every pass it ran: what its
    record shows, kept current by ``more``), and its pair ratios so far."""

    mtpm: int
    peak_bytes: Optional[int]
    pairs: list[float] = field(default_factory=list)

    def option(self) -> dict:
        s = summary(self.pairs)
        return {"median": s["median"], "ci": s["ci"], "peak_bytes": self.peak_bytes, "budget": self.mtpm}


@dataclass
class Settled:
    chosen: Leader
    tied: list[Leader]  # the leaders it could not be told apart from (empty: it leads clearly)
    rule: Optional[str]  # what chose it among the tied (None: no tie)
    pairs: int  # pairs each leader ended with

    def as_dict(self) -> Optional[dict]:
        """results.json's ``auto.tie`` (None when the chosen budget leads clearly)."""
        if not self.tied:
            return None
        return {"with": [t.mtpm for t in self.tied], "rule": self.rule, "pairs": self.pairs,
                "peaks": {str(lead.mtpm): lead.peak_bytes for lead in [self.chosen, *self.tied]}}


def settle(leaders: Sequence[Leader], more: Callable[[Leader, int], list[float]], repeat: int,
           max_repeats: Optional[int]) -> Settled:
    """Choose between ``leaders`` (two, or one: nothing to settle); ``more(leader, n)`` measures n more pairs of
    it and returns all its pair ratios so far. A leader with fewer than ``repeat`` pairs is topped up first."""
    leaders = list(leaders)
    most = max(repeat, max_repeats or repeat)
    for lead in leaders:
        if len(lead.pairs) < repeat:
            lead.pairs = more(lead, repeat - len(lead.pairs))
    while True:
        pick, tied, rule = choose([lead.option() for lead in leaders], floor=1.0)
        n = min(len(lead.pairs) for lead in leaders)
        if not tied or n >= most:
            break
        for lead in leaders:
            n_more = min(max(1, repeat), most - len(lead.pairs))
            if n_more > 0:
                lead.pairs = more(lead, n_more)
    return Settled(leaders[pick], [leaders[i] for i in tied], rule, min(len(lead.pairs) for lead in leaders))


def settle_ranked(ranked: Sequence[Leader], more: Callable[[Leader, int], list[float]], repeat: int,
                  max_repeats: Optional[int]) -> tuple[Settled, list[int]]:
    """``settle`` the two first of ``ranked`` (every measured budget, fastest first by its one pair), then bring in
    each other budget whose single ratio is not below the chosen one's 95% interval: one noisy pair ranked it, and
    the leaders' medians, settled over more pairs, may have fallen to it. Returns what was settled and the budgets
    measured again (the leaders, then those brought in). Without an interval (one pair each: ``bench.repeat=1``)
    nothing is brought in; the ranking rests on single pairs, which the answer says."""
    contested = [lead.mtpm for lead in ranked[:2]]
    settled = settle(ranked[:2], more, repeat, max_repeats)
    for other in ranked[2:]:
        ci = settled.chosen.option()["ci"]
        if ci is None or other.option()["median"] < ci[0] or other.mtpm in contested:
            continue
        contested.append(other.mtpm)
        challenge = settle([settled.chosen, other], more, repeat, max_repeats)
        if challenge.tied or challenge.chosen is not settled.chosen:
            settled = challenge
    return settled, contested


__all__ = ["Leader", "Settled", "settle", "settle_ranked"]
