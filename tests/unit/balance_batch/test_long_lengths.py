"""Lengths and budgets of any size: planning works per sequence and per distinct length, never per token value, so a
length of 2**40 plans as fast as a length of 40 (a count per token value, as np.bincount keeps, is 8 TiB there; and
best-fit decreasing's bit sets of budget / 1,024 words give way to a sorted list above a budget of 2**20)."""

from __future__ import annotations

import random

import pytest

from balance_batch import plan_step
from balance_batch.balanced.packed import _Rooms
from balance_batch.cost import microbatch_tokens
from balance_batch.stats import lower_bound_bins

HUGE = 2**40
CASES = [("balanced", "packed"), ("balanced", "padded"), ("greedy", "packed"), ("greedy", "padded")]
# verl's test shape, where LPT misses the bound and best-fit decreasing and the exact search run
TIGHT = [71, 88, 77, 77, 79, 81, 58, 90, 87, 79, 63, 51, 73, 83, 54, 80, 90, 56, 76, 70]


def _checked(plan, lengths: list[int], budget: int) -> list[list[int]]:
    """The plan's micro-batches, checked: every index once, within the budget or alone."""
    batches = [b for rank in plan.microbatches for b in rank if b]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert microbatch_tokens(b, lengths, plan.layout) <= budget or len(b) == 1, b
    return batches


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("planner,layout", CASES)
def test_a_sequence_of_2_to_the_40_tokens_over_the_budget_runs_alone(planner, layout, world):
    # the budget fits a billion tokens, so 10**9 is among the lengths the lower bound counts; 2**40 is over it
    budget = 2 * 10**9
    lengths = [HUGE, 10**9, 300, 10**9 - 7, 5, 40, 10**9 + 1]
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout=layout, planner=planner)
    batches = _checked(plan, lengths, budget)
    assert [0] in batches and plan.stats.over_budget == 1
    assert plan.real_tokens == sum(lengths)
    assert lower_bound_bins(lengths, budget) == 3  # 2**40 alone; 3·10**9 + 346 tokens need two more


@pytest.mark.parametrize("planner,layout", CASES)
def test_sequences_of_2_to_the_40_tokens_within_a_budget_of_2_to_the_41(planner, layout):
    budget = 2 * HUGE
    lengths = [HUGE, HUGE - 1, HUGE // 2, 10**9, 3, HUGE + 1]
    plan = plan_step(lengths, world_size=2, max_tokens_per_microbatch=budget, layout=layout, planner=planner)
    _checked(plan, lengths, budget)
    assert plan.stats.over_budget == 0
    assert lower_bound_bins(lengths, budget) == 2  # 3.5·2**40 + 10**9 + 4 tokens: two micro-batches of 2**41
    assert plan.stats.lower_bound_steps == 1  # over two ranks
    assert plan.real_tokens == sum(lengths)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("planner,layout", CASES)
def test_lengths_and_budget_scaled_by_2_to_the_33_give_the_same_plan(planner, layout, world):
    # on verl's shape the balanced packed planner runs best-fit decreasing and the exact search: at a budget of
    # 300 · 2**33 tokens both plan as they do at 300
    scale = 2**33
    lengths = TIGHT + [400]  # one over the budget too
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=300, layout=layout, planner=planner)
    scaled = plan_step([n * scale for n in lengths], world_size=world, max_tokens_per_microbatch=300 * scale,
                       layout=layout, planner=planner)
    assert scaled.microbatches == plan.microbatches
    assert scaled.stats.lower_bound_steps == plan.stats.lower_bound_steps


def test_rooms_answer_alike_in_bit_sets_and_in_a_sorted_list():
    small, large = _Rooms(5000), _Rooms(HUGE)  # bit sets for the one, a sorted list for the other
    assert small.rooms is None and large.rooms is not None and len(large.low) == 0
    rng = random.Random(0)
    for j in range(3000):
        if rng.random() < 0.55:
            room = rng.randint(0, 5000)
            small.add(room, j)
            large.add(room, j)
        else:
            x = rng.randint(0, 5200)
            assert small.take_at_least(x) == large.take_at_least(x)
