"""TRL's AsyncGRPO batchers (``trl/experimental/async_grpo/async_grpo_trainer.py``), written here from their published
algorithms. Both take samples in arrival order (here: the request's order) and emit one micro-batch per step as W
rows, row i on rank i; rows are packed (the padding-free collator).

- ``trl_fixed`` (``FixedCountBatcher``, ``token_budget <= 0``): a fixed count, ``per_device_train_batch_size`` × W
  samples, split over the W rows longest first, each into the row with the least Σ L² so far. No token budget.
- ``trl_budget`` (``TokenBudgetBatcher``): each sample into the row with the least Σ L² among those it still fits
  (row tokens ≤ ``token_budget``); when it fits none, the micro-batch is emitted and a new one started. TRL drops a
  sample longer than the budget; the harness runs every example, so it refuses instead.

TRL's stream never ends, so it never emits a partial last buffer; the harness runs it (recorded in ``differs``), and
a rank whose row is empty there runs a dummy step.
"""

from __future__ import annotations

from typing import Optional, Sequence

from balance_batch.greedy import Schedule
from harness.peers.common import PeerPlan, PeerRefusal, budget_of

FIXED, BUDGET = "trl_fixed", "trl_budget"
LAYOUT = "packed"
SOURCE = "huggingface/trl trl/experimental/async_grpo/async_grpo_trainer.py at f2cd577 (2026-07-24)"
PER_DEVICE_TRAIN_BATCH_SIZE = 8  # transformers' TrainingArguments default, which AsyncGRPOConfig keeps
SPREAD = "each micro-batch is W rows, row i on rank i (one step)"


def balance_by_squared_length(indices: Sequence[int], lengths: Sequence[int], rows: int) -> list[list[int]]:
    """Longest first, each into the row with the least Σ L² so far (the first such row on a tie)."""
    out: list[list[int]] = [[] for _ in range(rows)]
    loads = [0] * rows
    for i in sorted(indices, key=lambda j: lengths[j], reverse=True):
        r = min(range(rows), key=loads.__getitem__)
        out[r].append(i)
        loads[r] += lengths[i] ** 2
    return out


def _as_schedules(steps: Sequence[Sequence[list[int]]], world_size: int) -> list[Schedule]:
    """Micro-batch steps of W rows into per-rank schedules; an empty row is an empty step (None)."""
    return [[list(step[r]) or None for step in steps] for r in range(world_size)]


def _flush_note(leftover: int, what: str) -> list[str]:
    return [(f"TRL waits for more samples before emitting the last {what} ({leftover} sequences); the harness runs "
            "it")] if leftover else []


def plan_fixed(lengths: Sequence[int], world_size: int, budget: Optional[int] = None,
               per_device: int = PER_DEVICE_TRAIN_BATCH_SIZE) -> PeerPlan:
    """TRL's fixed-count plan: buffers of ``per_device`` × W samples, each split over the rows by Σ L²."""
    size = per_device * world_size
    buffers = [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)]
    steps = [balance_by_squared_length(b, lengths, world_size) for b in buffers]
    knobs = {"per_device_train_batch_size": per_device, "microbatch_size": size, "token_budget": None}
    differs = _flush_note(len(buffers[-1]) if buffers and len(buffers[-1]) < size else 0, "buffer")
    if budget is not None:
        differs.append(f"a fixed count bounds no tokens: mtpm={budget} is not used to plan (over_budget counts the "
                       "micro-batches above it)")
    return PeerPlan(_as_schedules(steps, world_size), knobs, SPREAD, differs)


def plan_budget(lengths: Sequence[int], world_size: int, budget: Optional[int]) -> PeerPlan:
    """TRL's token-budget plan: rows of at most ``budget`` real tokens, balanced by Σ L²."""
    budget = budget_of(BUDGET, budget)
    for i, n in enumerate(lengths):
        if n > budget:
            raise PeerRefusal(f"planner: {BUDGET} refuses example {i} of {n} tokens, over token_budget {budget} (TRL "
                              f"drops it with a warning; the harness runs every example); raise mtpm to at least "
                              f"{max(lengths)} or use planner=balanced")
    steps: list[list[list[int]]] = []
    rows: list[list[int]] = [[] for _ in range(world_size)]
    loads, tokens = [0] * world_size, [0] * world_size
    for i, n in enumerate(lengths):
        fits = [r for r in range(world_size) if tokens[r] + n <= budget]
        if not fits:
            steps.append(rows)
            rows = [[] for _ in range(world_size)]
            loads, tokens = [0] * world_size, [0] * world_size
            fits = list(range(world_size))
        r = min(fits, key=loads.__getitem__)
        rows[r].append(i)
        loads[r] += n * n
        tokens[r] += n
    leftover = sum(len(r) for r in rows)
    if leftover:
        steps.append(rows)
    knobs = {"token_budget": budget, "balance": "sum of L^2"}
    return PeerPlan(_as_schedules(steps, world_size), knobs, SPREAD, _flush_note(leftover, "micro-batch"))
