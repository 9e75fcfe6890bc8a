"""What a sampler's state holds and which saved settings a resume must share: those that decide which items form each
step (refused when they differ) and those that only decide how a step's items are planned (accepted: an elastic
resume on another world size, budget, layout, planner or cost model keeps every step's items)."""

from __future__ import annotations

from typing import NamedTuple, Optional

from balance_batch.cost import CostModel

STATE_VERSION = 2
READ_VERSIONS = (1, 2)  # a version-1 state (no micro-batch position) resumes at its step's start

# Which items form each step: the dataset (lengths and loss tokens), the order (seed, shuffle), the step size or ramp,
# and whether a short last step is dropped. A resume that changed one of these would not train the same items.
# A ramp (a threshold list, or Megatron's rampup triple as the list it makes) is in sequences_per_step or
# tokens_per_step; groups keep a group's items in one step, so they decide the steps too, and so does longest_first
# (it moves the epoch's longest item to the front of the order).
STEP_KEYS = ("dataset", "seed", "shuffle", "sequences_per_step", "tokens_per_step", "drop_last", "groups",
             "longest_first")
# A state saved before a key existed lacks it: it was saved with the value that keeps the steps as they were then.
STEP_DEFAULTS = {"longest_first": False}


class PlanSettings(NamedTuple):
    """How a step's items are planned into micro-batches per rank (an elastic resume may change every one)."""

    max_tokens_per_microbatch: int
    world_size: int
    layout: str
    planner: str
    max_seqs_per_microbatch: Optional[int]
    cost_model: CostModel
    # the peers' count knobs (balance_batch/knobs.py), last: the sampler hands these three on as they are
    min_microbatches: Optional[int] = None
    microbatches_multiple_of: Optional[int] = None
    padded_sequences_multiple_of: Optional[int] = None

    def as_config(self) -> dict:
        cm = self.cost_model
        return {"max_tokens_per_microbatch": self.max_tokens_per_microbatch, "world_size": self.world_size,
                "layout": self.layout, "planner": self.planner,
                "max_seqs_per_microbatch": self.max_seqs_per_microbatch,
                "cost_model": [cm.a, cm.b, cm.c, cm.fixed], "min_microbatches": self.min_microbatches,
                "microbatches_multiple_of": self.microbatches_multiple_of,
                "padded_sequences_multiple_of": self.padded_sequences_multiple_of}

    @classmethod
    def from_config(cls, config: dict) -> "PlanSettings":
        a, b, c, fixed = config["cost_model"]
        return cls(int(config["max_tokens_per_microbatch"]), int(config["world_size"]), config["layout"],
                   config["planner"], config["max_seqs_per_microbatch"],
                   CostModel(float(a), float(b), "a resumed state's", float(c), float(fixed)),
                   config.get("min_microbatches"), config.get("microbatches_multiple_of"),
                   config.get("padded_sequences_multiple_of"))


def check_state(state: object, mine: dict) -> dict:
    """``state``'s config, or one ValueError: not a sampler state, or saved with settings that decide other steps."""
    who = "TokenBudgetSampler.load_state_dict"
    if not isinstance(state, dict) or state.get("version") not in READ_VERSIONS:
        raise ValueError(f"{who}: not a sampler state (version {' or '.join(map(str, READ_VERSIONS))})")
    saved = state.get("config", {})
    saved_keys = {k: saved.get(k, STEP_DEFAULTS.get(k)) for k in STEP_KEYS}
    differ = [k for k in STEP_KEYS if saved_keys[k] != mine[k]]
    if differ:
        raise ValueError(f"{who}: the state was saved with "
                         + "; ".join(f"{k}={saved_keys[k]!r}, this sampler has {mine[k]!r}" for k in differ)
                         + " (these decide which items form each step; the budget, world size, layout, planner and "
                           "cost model may change)")
    try:
        PlanSettings.from_config(saved)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{who}: the state's plan settings are incomplete: {saved!r}") from None
    return saved
