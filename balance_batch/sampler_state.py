"""What a sampler's state holds and which saved settings a resume must share: those that decide which items form each
step (refused when they differ) and those that only decide how a step's items are planned (accepted: an elastic
resume on another world size, budget, layout, planner or cost model keeps every step's items)."""

from __future__ import annotations

from balance_batch.cost import CostModel
from balance_batch.planners import Knobs, PlanSettings

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


def settings_config(settings: PlanSettings) -> dict:
    """A state's record of how steps are planned (the keys a saved state has always had)."""
    cm, knobs = settings.cost_model, settings.knobs
    return {"max_tokens_per_microbatch": settings.budget, "world_size": settings.world_size,
            "layout": settings.layout, "planner": settings.planner, "max_seqs_per_microbatch": settings.max_seqs,
            "cost_model": [cm.a, cm.b, cm.c, cm.fixed], **knobs._asdict()}


def settings_from_config(config: dict) -> PlanSettings:
    """The plan settings a state was saved under (a sampler plans every step without the refinement rounds)."""
    a, b, c, fixed = config["cost_model"]
    return PlanSettings(int(config["max_tokens_per_microbatch"]), int(config["world_size"]), config["layout"],
                        config["planner"], config["max_seqs_per_microbatch"],
                        CostModel(float(a), float(b), "a resumed state's", float(c), float(fixed)),
                        Knobs(*(config.get(k) for k in Knobs._fields)), refine=False)


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
        settings_from_config(saved)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{who}: the state's plan settings are incomplete: {saved!r}") from None
    return saved
