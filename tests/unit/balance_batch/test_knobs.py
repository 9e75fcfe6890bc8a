"""The peers' planning knobs on plan_step and the sampler: verl's micro-batch counts
(min_microbatches, microbatches_multiple_of), fairseq's bsz_mult (padded_sequences_multiple_of), verl's groups, the
Megatron-LM ramp, and items of zero tokens placed nowhere. The peers' own cases, in our words, beside properties."""

from __future__ import annotations

from fractions import Fraction
from math import floor

import numpy as np
import pytest

import harness.peers  # noqa: F401  (registers the peers' planners, whose refusal of the knobs is checked here)
from balance_batch import TokenBudgetSampler, plan_step
from balance_batch.cost import microbatch_tokens

OURS = [("balanced", "packed"), ("balanced", "padded"), ("greedy", "padded"), ("greedy", "packed")]


def lengths_for(seed: int, n: int = 40, top: int = 900) -> list[int]:
    return np.random.default_rng(seed).integers(1, top, n).tolist()


def flat(plan) -> list[int]:
    return sorted(i for rank in plan.microbatches for mb in rank for i in mb)


def within_budget(plan, lengths, budget, layout) -> bool:
    return all(microbatch_tokens(mb, lengths, layout) <= budget or len(mb) == 1
               for rank in plan.microbatches for mb in rank)


# ---------------------------------------------------------------- verl's counts


@pytest.mark.parametrize("planner,layout", OURS)
@pytest.mark.parametrize("k", [2, 3, 4])
def test_counts_divisible_by_k_on_every_rank_every_item_once_within_budget(planner, layout, k):
    # verl's num_batches_divided_by: the micro-batch count of every rank divisible by k (pipeline stages need it)
    for seed in range(3):
        lengths, world = lengths_for(seed), 1 + seed
        plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=2048, planner=planner, layout=layout,
                         microbatches_multiple_of=k)
        counts = {len(rank) for rank in plan.microbatches}
        assert len(counts) == 1 and counts.pop() % k == 0
        assert flat(plan) == list(range(len(lengths))) and within_budget(plan, lengths, 2048, layout)


@pytest.mark.parametrize("planner,layout", OURS)
def test_at_least_k_micro_batches_even_when_fewer_would_fit(planner, layout):
    # verl's min_num_micro_batch: the whole batch fits one micro-batch, yet each rank runs k, by splitting
    lengths = [30, 20, 25, 10, 40, 15, 35, 5]
    plan = plan_step(lengths, world_size=2, max_tokens_per_microbatch=10_000, planner=planner, layout=layout,
                     min_microbatches=3)
    assert [len(rank) for rank in plan.microbatches] == [3, 3]
    assert all(mb for rank in plan.microbatches for mb in rank)  # items to split: no dummy
    assert flat(plan) == list(range(8))


def test_a_lone_sequence_cannot_split_so_its_rank_gets_dummies():
    plan = plan_step([500, 10, 10, 10], world_size=2, max_tokens_per_microbatch=500, microbatches_multiple_of=2)
    by_size = sorted(plan.microbatches, key=lambda rank: sum(1 for mb in rank if mb))
    assert by_size[0] == [[0], []] and sorted(len(mb) for mb in by_size[1]) == [1, 2]


# ---------------------------------------------------------------- fairseq's bsz_mult


@pytest.mark.parametrize("planner", ["balanced", "greedy"])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_padded_micro_batches_hold_a_multiple_of_k_sequences(planner, k):
    # fairseq batch_by_size's required_batch_size_multiple: every batch a multiple of k sequences, except where k of
    # its longest would not fit the budget, and the last (on each rank dealt, for the greedy)
    for seed in range(4):
        lengths, budget = lengths_for(seed, 60, 400), 1600
        plan = plan_step(lengths, world_size=2, max_tokens_per_microbatch=budget, planner=planner, layout="padded",
                         padded_sequences_multiple_of=k)
        assert flat(plan) == list(range(60)) and within_budget(plan, lengths, budget, "padded")
        odd = [mb for rank in plan.microbatches for mb in rank
               if mb and len(mb) % k and k * max(lengths[i] for i in mb) <= budget]
        assert len(odd) <= (1 if planner == "balanced" else 2), odd  # the shortest sequences' leftover


def test_bsz_mult_rounds_down_what_fits_and_keeps_the_remainder_last():
    lengths = [100] * 20 + [30] * 7  # 10 of 100 fit 1000: 8 taken; then 8; then 4 + 4 of 30 (8); 3 left over
    plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=1000, layout="padded",
                     padded_sequences_multiple_of=4)
    assert sorted(len(mb) for mb in plan.microbatches[0]) == [3, 8, 8, 8]


def test_bsz_mult_with_the_count_knobs_splits_in_multiples_of_k():
    plan = plan_step([50] * 16, world_size=1, max_tokens_per_microbatch=800, layout="padded",
                     padded_sequences_multiple_of=4, min_microbatches=4)
    assert [len(mb) for mb in plan.microbatches[0]] == [4, 4, 4, 4]


# ---------------------------------------------------------------- groups


def random_groups(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed + 100)
    sizes = rng.integers(1, 7, n)
    ids = np.repeat(np.arange(n), sizes)[:n]
    return rng.permutation(ids).tolist()  # a group's items need not be adjacent


@pytest.mark.parametrize("planner,layout", OURS)
def test_a_group_that_fits_shares_one_micro_batch_and_one_that_does_not_one_rank(planner, layout):
    for seed in range(5):
        lengths, groups, budget = lengths_for(seed, 50, 700), random_groups(seed, 50), 2048
        plan = plan_step(lengths, world_size=3, max_tokens_per_microbatch=budget, planner=planner, layout=layout,
                         groups=groups)
        assert flat(plan) == list(range(50)) and within_budget(plan, lengths, budget, layout)
        where = {i: (r, s) for r, rank in enumerate(plan.microbatches) for s, mb in enumerate(rank) for i in mb}
        for g in set(groups):
            items = [i for i in range(50) if groups[i] == g]
            if microbatch_tokens(items, lengths, layout) <= budget:
                assert len({where[i] for i in items}) == 1, (seed, g)
            else:
                assert len({where[i][0] for i in items}) == 1, (seed, g)  # one rank, consecutive micro-batches
                slots = sorted({where[i][1] for i in items})
                assert slots == list(range(slots[0], slots[0] + len(slots)))


def test_a_group_under_the_cap_of_sequences_too():
    plan = plan_step([10] * 6, world_size=1, max_tokens_per_microbatch=1000, max_seqs_per_microbatch=3,
                     groups=[0, 0, 1, 1, 2, 2])
    assert sorted(sorted(mb) for mb in plan.microbatches[0]) == [[0, 1], [2, 3], [4, 5]]


def test_the_sampler_keeps_each_group_in_one_step_and_one_micro_batch():
    lengths, groups = lengths_for(7, 120, 300), [i // 4 for i in range(120)]  # GRPO: 4 responses a prompt
    for world in (1, 2):
        steps = []
        for rank in range(world):
            sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=1200, world_size=world, rank=rank,
                                         tokens_per_step=3000, groups=groups, seed=3)
            steps.append(list(sampler.steps()))
        where = {i: s for per_rank in steps for s, step in enumerate(per_rank) for mb in step.microbatches
                 for i in mb}
        assert sorted(where) == list(range(120))
        assert all(len({where[i] for i in range(g * 4, g * 4 + 4)}) == 1 for g in range(30))
        together = [sorted(mb) for per_rank in steps for step in per_rank for mb in step.microbatches]
        for g in range(30):
            if sum(lengths[g * 4:g * 4 + 4]) <= 1200:
                assert list(range(g * 4, g * 4 + 4)) in together or any(
                    set(range(g * 4, g * 4 + 4)) <= set(mb) for mb in together)


def test_sequences_per_step_in_whole_groups():
    sampler = TokenBudgetSampler([5] * 30, max_tokens_per_microbatch=100, sequences_per_step=8,
                                 groups=[i // 3 for i in range(30)])  # groups of 3: steps of 6 (two groups)
    assert [sum(len(mb) for mb in step.microbatches) for step in sampler.steps()] == [6, 6, 6, 6, 6]


# ---------------------------------------------------------------- Megatron's ramp


def megatron_size(consumed: int, start: int, increment: int, over: int, final: int) -> int:
    if consumed > over:
        return final
    return start + increment * floor(consumed / Fraction(over, (final - start) // increment))


def test_megatron_ramp_in_sequences_starts_grows_and_ends_at_the_final_size():
    sampler = TokenBudgetSampler([9] * 200, max_tokens_per_microbatch=64, sequences_per_step=16, rampup=(4, 4, 40))
    steps = list(sampler.steps())
    sizes = [sum(len(mb) for mb in step.microbatches) for step in steps]
    assert sizes[0] == 4 and sizes[-2] == 16 and set(sizes[:-1]) == {4, 8, 12, 16}
    assert all(size == megatron_size(step.consumed_sequences, 4, 4, 40, 16) for size, step in zip(sizes, steps[:-1]))
    assert sampler.state_dict()["config"]["sequences_per_step"] == [[0, 4], [14, 8], [27, 12], [40, 16]]


def test_megatron_ramp_in_tokens():
    lengths = lengths_for(2, 300, 120)
    sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=256, tokens_per_step=2000,
                                 rampup=(500, 500, 6000))
    steps = list(sampler.steps())
    for step in steps[:-1]:
        size = megatron_size(step.consumed_tokens, 500, 500, 6000, 2000)
        assert size - max(lengths) < step.global_tokens <= size
    assert steps[0].global_tokens <= 500 and steps[-2].global_tokens > 2000 - max(lengths)


def test_sequences_per_step_takes_a_threshold_list_and_resumes_across_it():
    kwargs = dict(max_tokens_per_microbatch=64, sequences_per_step=[(0, 3), (10, 5)], world_size=2, rank=1)
    whole = list(TokenBudgetSampler([7] * 40, **kwargs).steps())
    assert [s.consumed_sequences for s in whole[:5]] == [0, 3, 6, 9, 12]  # 5 a step once 10 are consumed
    first = TokenBudgetSampler([7] * 40, **kwargs)
    taken = [s for _, s in zip(range(3), first.steps())]
    again = TokenBudgetSampler([7] * 40, **kwargs)
    again.load_state_dict(first.state_dict())
    assert [s.microbatches for s in taken + list(again.steps())] == [s.microbatches for s in whole]
    # Megatron's (3, 2, 10) to 5 is this very list, so it resumes the state; (3, 2, 12) would cut other steps
    same = TokenBudgetSampler([7] * 40, max_tokens_per_microbatch=64, sequences_per_step=5, rampup=(3, 2, 10))
    same.load_state_dict(first.state_dict())
    other = TokenBudgetSampler([7] * 40, max_tokens_per_microbatch=64, sequences_per_step=5, rampup=(3, 2, 12))
    with pytest.raises(ValueError, match="sequences_per_step"):
        other.load_state_dict(first.state_dict())


# ---------------------------------------------------------------- zero-length items


@pytest.mark.parametrize("planner", ["balanced", "greedy", "verl", "fairseq"])
def test_plan_step_places_zero_length_items_nowhere_and_says_so(planner):
    lengths = [0, 300, 0, 120, 80, 0, 400, 50, 70]  # six to plan: verl splits them evenly over the ranks
    plan = plan_step(lengths, world_size=2, max_tokens_per_microbatch=512, planner=planner)
    assert plan.empty == [0, 2, 5] and flat(plan) == [1, 3, 4, 6, 7, 8]
    assert plan.real_tokens == sum(lengths) and plan.lengths == lengths


def test_zero_length_items_leave_the_greedy_plan_of_the_rest_as_it_was():
    rest = [300, 120, 80, 400, 50]
    plain = plan_step(rest, world_size=2, max_tokens_per_microbatch=512, planner="greedy", layout="padded")
    mixed = plan_step([0] + rest, world_size=2, max_tokens_per_microbatch=512, planner="greedy", layout="padded")
    assert mixed.microbatches == [[[i + 1 for i in mb] for mb in rank] for rank in plain.microbatches]


def test_the_sampler_places_zero_length_items_in_no_step():
    lengths = [0 if i % 5 == 0 else 3 + i % 17 for i in range(100)]
    sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=40, world_size=1, rank=0, tokens_per_step=150)
    counted = len(sampler)
    steps = list(sampler.steps())
    ids = sorted(i for step in steps for mb in step.microbatches for i in mb)
    assert ids == [i for i in range(100) if lengths[i]]
    assert counted == sum(len(step.microbatches) for step in steps)
    assert sum(step.global_tokens for step in steps) == sum(lengths)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw,named", [
    (dict(planner="verl", groups=[0, 0, 1]), "groups: planner 'verl'"),
    (dict(planner="fairseq", layout="padded", microbatches_multiple_of=2), "microbatches_multiple_of: planner"),
    (dict(padded_sequences_multiple_of=8), "needs layout 'padded'"),
    (dict(layout="padded", padded_sequences_multiple_of=8, groups=[0, 1, 2]), "not with groups"),
    (dict(min_microbatches=2, lockstep=False), "min_microbatches: .* lockstep=True"),
    (dict(groups=[0, 1]), "groups: must be one integer group id per item"),
    (dict(min_microbatches=0), "min_microbatches: must be a positive integer"),
])
def test_plan_step_refuses_a_knob_it_cannot_honour_in_one_line(kw, named):
    with pytest.raises(ValueError, match=named):
        plan_step([3, 4, 5], **{"world_size": 2, "max_tokens_per_microbatch": 10, **kw})


@pytest.mark.parametrize("kw,named", [
    (dict(rampup=(3, 2, 10), sequences_per_step=[(0, 3)]), "rampup: sequences_per_step must then be the final"),
    (dict(rampup=(4, 3, 10), sequences_per_step=8), "rampup must be"),
    (dict(rampup=(9, 1, 10), sequences_per_step=8), "rampup must be"),
    (dict(planner="verl", groups=[0, 1, 1], sequences_per_step=2), "groups: planner 'verl'"),
])
def test_the_sampler_refuses_a_bad_knob_in_one_line(kw, named):
    with pytest.raises(ValueError, match=named):
        TokenBudgetSampler([3, 4, 5], **{"max_tokens_per_microbatch": 10, **kw})

