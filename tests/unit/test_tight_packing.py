"""The fewest micro-batches on small, tight steps: plan_step and pack against a brute-force optimum."""

from __future__ import annotations

import math
import random

import pytest

from balance_batch import pack, plan_step


def fewest_bins(lengths: list[int], budget: int) -> int:
    """The optimum by dynamic programming over subsets: for each set of items placed, the fewest full bins and the
    least fill of the open one (lexicographically), the classic exact recurrence for bin packing."""
    n = len(lengths)
    best = [(math.inf, 0)] * (1 << n)
    best[0] = (0, budget)  # no open bin: count the next item as opening one
    for mask in range(1 << n):
        bins, fill = best[mask]
        if bins == math.inf:
            continue
        for i in range(n):
            if mask >> i & 1:
                continue
            x = lengths[i]
            step = (bins, fill + x) if fill + x <= budget else (bins + 1, x)
            if step < best[mask | 1 << i]:
                best[mask | 1 << i] = step
    return best[-1][0]


def microbatches(plan) -> list[list[int]]:
    return [b for schedule in plan.microbatches for b in schedule if b]


def check_plan(lengths: list[int], budget: int, world_size: int = 1) -> int:
    plan = plan_step(lengths, world_size=world_size, max_tokens_per_microbatch=budget, layout="packed")
    bins = microbatches(plan)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    return len(bins)


def check_pack(lengths: list[int], budget: int) -> int:
    rows = pack(lengths, budget)
    assert sorted(rows.indices.tolist()) == list(range(len(lengths)))
    assert rows.row_tokens().max() <= budget
    return rows.rows


# (low, high) of the lengths as fractions of the budget: near a quarter, near a third, and mixed
SHAPES = {"quarter": (0.2, 0.3), "third": (0.27, 0.4), "mixed": (0.05, 0.7)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_small_steps_take_the_fewest_microbatches(shape):
    low, high = SHAPES[shape]
    budget = 100
    for seed in range(12):
        rng = random.Random(f"{shape}-{seed}")
        lengths = [rng.randint(int(low * budget), int(high * budget)) for _ in range(rng.randint(6, 12))]
        optimum = fewest_bins(lengths, budget)
        assert check_plan(lengths, budget) == optimum, lengths
        assert check_pack(lengths, budget) == optimum, lengths


def test_verl_shaped_step_reaches_the_bound():
    # verl's test shape: 1,483 tokens fit 5 micro-batches of 300; best-fit decreasing takes 6
    lengths = [71, 88, 77, 77, 79, 81, 58, 90, 87, 79, 63, 51, 73, 83, 54, 80, 90, 56, 76, 70]
    assert check_plan(lengths, 300) == 5
    assert check_pack(lengths, 300) == 5


def test_lock_step_counts_where_a_microbatch_less_saves_a_step():
    # two ranks: 5 micro-batches are 3 steps, 6 would be 3 too, so only the micro-batch count of the bound matters
    lengths = [71, 88, 77, 77, 79, 81, 58, 90, 87, 79, 63, 51, 73, 83, 54, 80, 90, 56, 76, 70]
    plan = plan_step(lengths, world_size=2, max_tokens_per_microbatch=300, layout="packed")
    assert max(len(s) for s in plan.microbatches) == 3
    plan = plan_step(lengths + [300] * 3, world_size=4, max_tokens_per_microbatch=300, layout="packed")
    assert max(len(s) for s in plan.microbatches) == 2  # 8 micro-batches: the 5 above beside three full ones


def test_the_cap_on_sequences_is_kept():
    lengths = [71, 88, 77, 77, 79, 81, 58, 90, 87, 79, 63, 51, 73, 83, 54, 80, 90, 56, 76, 70]
    plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=300, layout="packed",
                     max_seqs_per_microbatch=4)
    assert len(microbatches(plan)) == 5 and all(len(b) <= 4 for b in microbatches(plan))
    rows = pack(lengths, 300, max_seqs_per_row=4)
    assert rows.rows == 5 and max(len(rows.row(r)) for r in range(rows.rows)) <= 4
