"""plan.json documents (the format harness writes) for the plan-figure tests: from today's greedy planner, or by
hand."""

from __future__ import annotations

from typing import Optional

from balance_batch import plan_step

# Roughly the benchmark model's shape: a ≈ 2 × 3e9 active parameters per token,
# b from its full-attention layers; what matters for the figure is b/a.
COST_MODEL = {"a": 6.0e9, "b": 1.6e5, "source": "tests: hand-made, Qwen3.5-35B-A3B-like"}


def plan_doc(
    lengths: list[int],
    schedules: list,
    *,
    lockstep: bool = True,
    layout: str = "padded",
    planner: str = "greedy",
    backend: Optional[str] = None,
    max_tokens: Optional[int] = None,
    micro_batch_size: int = 1,
    cost_model: Optional[dict] = None,
) -> dict:
    return {
        "version": 1,
        "backend": backend or ("fsdp2" if lockstep else "megatron_ddp"),
        "world_size": len(schedules),
        "lockstep": lockstep,
        "planner": planner,
        "layout": layout,
        "max_tokens_per_microbatch": max_tokens,
        "micro_batch_size": micro_batch_size,
        "cost_model": dict(cost_model or COST_MODEL),
        "lengths": list(lengths),
        "schedules": [[None if b is None else list(b) for b in s] for s in schedules],
    }


def greedy_doc(lengths: list[int], world_size: int, max_tokens: Optional[int], *, lockstep: bool = True,
               micro_batch_size: int = 1, layout: str = "padded", cost_model: Optional[dict] = None):
    """(plan.json document, today's Plan) for the original greedy planner.

    ``layout="packed"`` keeps the greedy micro-batches and marks them packed: a valid
    packed plan (Σ lengths ≤ count × longest ≤ the budget), with no padding.
    """
    plan = plan_step(lengths, world_size=world_size, max_tokens_per_microbatch=max_tokens,
                     micro_batch_size=micro_batch_size, layout="padded", planner="greedy", lockstep=lockstep)
    doc = plan_doc(lengths, plan.schedules, lockstep=lockstep, layout=layout, max_tokens=max_tokens,
                   micro_batch_size=micro_batch_size, cost_model=cost_model)
    return doc, plan
