"""balance_batch.plan_step, the library's entry point for one batch in memory: what it returns, checked against the
lengths by hand (every index once, equal counts with dummies, the budget, the costs and token totals), and its one-line
refusals."""

from __future__ import annotations

import numpy as np
import pytest

from balance_batch import PLANNERS, CostModel, plan_step
from balance_batch.cost import microbatch_cost, microbatch_tokens
from balance_batch.planners import planner_names

SKEWED = [7000, 6500, 6100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 5000, 3]  # three long ones, many short ones
UNIFORM = [100 + 7 * i for i in range(13)]


@pytest.mark.parametrize("lengths", [SKEWED, UNIFORM], ids=["skewed", "uniform"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("planner,layout", [("balanced", "packed"), ("balanced", "padded"), ("greedy", "padded")])
def test_each_sequence_once_in_equal_counts_within_the_budget(lengths, world, planner, layout):
    budget = 6600
    cost = CostModel(1.0, 1e-3, "test")
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout=layout, planner=planner,
                     cost_model=cost)
    mbs = plan.microbatches
    assert len(mbs) == world and len({len(rank) for rank in mbs}) == 1  # every rank runs as many micro-batches
    flat = sorted(i for rank in mbs for batch in rank for i in batch)
    assert flat == list(range(len(lengths)))
    for rank in mbs:
        for batch in rank:
            assert isinstance(batch, list)  # a dummy is [], never None
            assert microbatch_tokens(batch, lengths, layout) <= budget or len(batch) == 1
    assert plan.stats.n_dummy == [sum(1 for b in rank if not b) for rank in mbs]
    assert plan.cost_per_rank == pytest.approx([sum(microbatch_cost(b, lengths, layout, cost) for b in rank)
                                                for rank in mbs])
    assert plan.real_tokens == plan.loss_tokens == sum(lengths)


def test_dummies_are_marked_empty_and_dropped_for_ranks_that_never_meet():
    lengths = [10, 10, 10]  # three micro-batches of one at a budget of 10: one rank of two gets a dummy
    lock = plan_step(lengths, world_size=2, max_tokens_per_microbatch=10)
    assert sorted(len(rank) for rank in lock.microbatches) == [2, 2]
    assert sorted(sum(1 for b in rank if b == []) for rank in lock.microbatches) == [0, 1]
    free = plan_step(lengths, world_size=2, max_tokens_per_microbatch=10, lockstep=False)
    assert sorted(len(rank) for rank in free.microbatches) == [1, 2] and all(b for r in free.microbatches for b in r)


def test_a_sequence_over_the_budget_runs_alone_and_the_loss_tokens_follow_the_counts_given():
    lengths = np.array([30, 4, 3, 2])  # a numpy array works as a list does
    plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=10, loss_tokens_per_sequence=[29, 0, 2, 1])
    assert [0] in plan.microbatches[0] and plan.stats.over_budget == 1
    assert (plan.real_tokens, plan.loss_tokens) == (39, 32)


def test_every_planner_and_fixed_slices_plan_through_it():
    import harness.peers  # noqa: F401  (registers the peers' planners beside the library's own)

    lengths = [40, 30, 20, 10, 5, 5, 3, 2]
    assert planner_names()[:len(PLANNERS)] == PLANNERS and len(planner_names()) > len(PLANNERS)
    for planner in planner_names():
        plan = plan_step(lengths, world_size=2, max_tokens_per_microbatch=64, planner=planner)
        assert sorted(i for rank in plan.microbatches for b in rank for i in b) == list(range(8)), planner
        assert plan.planner == planner
    sliced = plan_step(lengths, world_size=2, max_tokens_per_microbatch=None, planner="greedy", layout="padded",
                       micro_batch_size=2)
    assert all(len(b) <= 2 for rank in sliced.microbatches for b in rank) and sliced.stats.steps == 2


def test_the_same_arguments_give_the_same_plan():
    kwargs = dict(world_size=3, max_tokens_per_microbatch=6600, cost_model=CostModel(1.0, 1e-3, "test"))
    assert plan_step(SKEWED, **kwargs).microbatches == plan_step(list(SKEWED), **kwargs).microbatches


@pytest.mark.parametrize("change,named", [
    (dict(lengths=[3, -1]), "lengths[1] = -1: a length is a count of tokens"),
    (dict(lengths=[3.5, 2]), "lengths must be a flat sequence of token counts"),
    (dict(lengths=[[3], [2]]), "lengths must be a flat sequence"),
    (dict(world_size=0), "world_size: must be a positive integer"),
    (dict(world_size=True), "world_size: must be a positive integer"),
    (dict(max_tokens_per_microbatch=0), "max_tokens_per_microbatch: must be a positive integer"),
    (dict(max_tokens_per_microbatch=None), "max_tokens_per_microbatch: planner 'balanced' needs a token budget"),
    (dict(layout="rows"), "layout must be one of padded, packed"),
    (dict(planner="best"), "planner must be one of greedy, balanced"),
    (dict(max_seqs_per_microbatch=0), "max_seqs_per_microbatch: must be a positive integer or None"),
    (dict(micro_batch_size=0), "micro_batch_size: must be a positive integer, got 0"),
    (dict(loss_tokens_per_sequence=[1]), "loss_tokens_per_sequence: must be one integer per sequence (2)"),
    (dict(loss_tokens_per_sequence=[4, 1]), "loss_tokens_per_sequence[0] is 4 for a length of 3"),
])
def test_a_bad_argument_is_one_value_error_naming_it(change, named):
    kwargs = dict(lengths=[3, 2], world_size=2, max_tokens_per_microbatch=8)
    kwargs.update(change)
    with pytest.raises(ValueError) as info:
        plan_step(kwargs.pop("lengths"), **kwargs)
    assert named in str(info.value) and "\n" not in str(info.value)
