"""What the batching knobs mean when left unset: a leaf module (no harness imports), read by the config's resolution
and by results.json's first write, which must say what a point was asked to run even when its config is invalid."""

from __future__ import annotations

AUTO = "auto"  # mtpm=auto: search the budget (harness/auto.py)


def batching_by_budget(has_budget: bool) -> tuple[str, str]:
    """The planner and layout a null knob means: the balanced planner's packed rows with a token budget, the
    original greedy padded slices without one (mbs=1 rows read as they always did)."""
    return ("balanced", "packed") if has_budget else ("greedy", "padded")
