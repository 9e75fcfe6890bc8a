"""The planner's invariants, as properties over arbitrary lengths and budgets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from balance_batch import plan_step
from balance_batch.greedy import (
    deal_to_ranks,
    lockstep_schedules,
    make_fixed_size_microbatches,
    make_token_balanced_microbatches,
    sort_by_length,
)
from balance_batch.stats import plan_stats

lengths_st = st.lists(st.integers(min_value=1, max_value=5000), min_size=0, max_size=80)
budget_st = st.integers(min_value=1, max_value=20000)


@st.composite
def lengths_and_budgets(draw):
    """Lengths and a budget; half the time one the greedy rule meets with equality.

    ``budget = c × L`` with L a drawn length (often the longest, the first
    micro-batch's): then some micro-batch has ``(count + 1) × longest == budget``,
    where ``>`` keeps going and ``>=`` would wrongly close it.
    """
    lengths = draw(lengths_st)
    if lengths and draw(st.booleans()):
        longest = max(lengths) if draw(st.booleans()) else draw(st.sampled_from(lengths))
        return lengths, longest * draw(st.integers(1, 12))
    return lengths, draw(budget_st)


def _seqs(lengths):
    return [[0] * n for n in lengths]


@given(lengths_and_budgets())
def test_every_index_once_in_order(case):
    lengths, budget = case
    order = sort_by_length(lengths)
    batches = make_token_balanced_microbatches(order, _seqs(lengths), budget)
    assert [i for b in batches for i in b] == order
    assert all(b for b in batches)


@given(lengths_and_budgets())
def test_no_microbatch_over_budget_unless_alone(case):
    lengths, budget = case
    batches = make_token_balanced_microbatches(sort_by_length(lengths), _seqs(lengths), budget)
    for b in batches:
        cost = len(b) * max(lengths[i] for i in b)
        assert cost <= budget or len(b) == 1


@given(lengths_and_budgets())
def test_greedy_closes_a_batch_only_when_the_next_sequence_does_not_fit(case):
    lengths, budget = case
    batches = make_token_balanced_microbatches(sort_by_length(lengths), _seqs(lengths), budget)
    for cur, nxt in zip(batches, batches[1:]):
        longest = max(max(lengths[i] for i in cur), lengths[nxt[0]])
        assert (len(cur) + 1) * longest > budget


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=60), st.integers(1, 5000))
def test_any_given_order_is_walked_as_given(lengths, budget):
    order = list(range(len(lengths)))[::-1]  # not sorted: the function must not reorder
    batches = make_token_balanced_microbatches(order, _seqs(lengths), budget)
    assert [i for b in batches for i in b] == order


def test_a_micro_batch_that_exactly_fills_the_budget_is_kept_whole():
    """count x longest == budget fits (<=): the boundary a random search rarely draws, pinned here."""
    lengths = [100, 100, 100, 100]
    batches = make_token_balanced_microbatches(sort_by_length(lengths), _seqs(lengths), 300)
    assert [len(b) for b in batches] == [3, 1]


def test_oversized_sequence_sits_alone_and_is_kept():
    lengths = [100, 5000, 80, 90]
    batches = make_token_balanced_microbatches(sort_by_length(lengths), _seqs(lengths), 300)
    assert [1] in batches
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3]
    assert batches == [[1], [0, 3, 2]]


def test_seed_semantics_on_a_known_case():
    # (len+1) * max(current_max, n) > budget starts a new micro-batch
    lengths = [10, 10, 10, 10, 10]
    assert make_token_balanced_microbatches(range(5), _seqs(lengths), 30) == [[0, 1, 2], [3, 4]]
    assert make_token_balanced_microbatches(range(5), _seqs(lengths), 29) == [[0, 1], [2, 3], [4]]


@given(lengths_st, st.integers(1, 9))
def test_fixed_size_slices(lengths, mbs):
    order = sort_by_length(lengths)
    batches = make_fixed_size_microbatches(order, mbs)
    assert [i for b in batches for i in b] == order
    assert all(len(b) == mbs for b in batches[:-1])
    assert not batches or 1 <= len(batches[-1]) <= mbs


@given(lengths_st, st.integers(1, 8))
def test_dealing_covers_every_example_once_and_balances_counts(lengths, world):
    order = sort_by_length(lengths)
    shares = deal_to_ranks(order, world)
    assert len(shares) == world
    assert sorted(i for s in shares for i in s) == sorted(order)
    counts = [len(s) for s in shares]
    assert max(counts) - min(counts) <= 1
    for s in shares:  # each rank keeps the sorted order
        assert [lengths[i] for i in s] == sorted((lengths[i] for i in s), reverse=True)
    for rank, s in enumerate(shares):  # like cards: rank r holds sorted positions r, r+W, r+2W, ...
        assert [order.index(i) for i in s] == list(range(rank, len(order), world))


def test_greedy_hits_the_budget_exactly():
    """The property tests above draw such budgets; this one names the case: (count + 1) × longest == budget fits."""
    lengths = [40, 30, 40, 10, 40]
    assert make_token_balanced_microbatches(sort_by_length(lengths), _seqs(lengths), 120) == [[0, 2, 4], [1, 3]]
    assert plan_step(lengths, world_size=1, max_tokens_per_microbatch=120, layout="padded", planner="greedy",
                     lockstep=False).stats.n_microbatches == [2]


@given(st.lists(st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=3), max_size=6), min_size=1, max_size=5))
def test_lockstep_pads_with_dummies_to_the_longest(schedules):
    aligned = lockstep_schedules(schedules)
    longest = max(len(s) for s in schedules)
    for orig, al in zip(schedules, aligned):
        assert len(al) == longest
        assert al[: len(orig)] == orig
        assert all(x is None for x in al[len(orig) :])


@settings(max_examples=60)
@given(lengths_st, st.one_of(st.none(), budget_st), st.integers(1, 5), st.integers(1, 4), st.booleans())
def test_plan_statistics_are_consistent(lengths, budget, mbs, world, align):
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, micro_batch_size=mbs,
                     layout="padded", planner="greedy", lockstep=align)
    stats = plan.stats
    assert stats.real_tokens == sum(lengths)
    assert stats.real_tokens <= stats.padded_tokens
    assert 0 < stats.pad_efficiency <= 1.0
    assert sum(stats.real_tokens_per_rank) == stats.real_tokens
    assert sum(stats.padded_tokens_per_rank) == stats.padded_tokens
    seen = [i for s in plan.schedules for b in s if b is not None for i in b]
    assert sorted(seen) == list(range(len(lengths)))
    if align:
        assert len({len(s) for s in plan.schedules}) <= 1
        assert [m + d for m, d in zip(stats.n_microbatches, stats.n_dummy)] == [len(s) for s in plan.schedules]
    else:
        assert stats.n_dummy == [0] * world
    padded = [len(b) * max(lengths[i] for i in b) for s in plan.schedules for b in s if b]
    assert stats.max_microbatch_padded_tokens == max(padded, default=0)


def test_stats_on_a_hand_computed_plan():
    lengths = [4, 2, 2, 1]
    stats = plan_stats([[[0, 1], [2, 3]], [None, [3]]], lengths)
    assert stats.padded_tokens == 2 * 4 + 2 * 2 + 1
    assert stats.real_tokens_per_rank == [9, 1]
    assert stats.n_microbatches == [2, 1]
    assert stats.n_dummy == [0, 1]
    assert stats.max_microbatch_padded_tokens == 8


def test_seed_greedy_outputs_are_pinned():
    """The original greedy planner's plans, exactly as it always computed them (the defaults must never drift)."""
    from harness.data.workload import mixed_lengths

    small = mixed_lengths(16, 64, 512, 42)
    plan = plan_step(small, world_size=2, max_tokens_per_microbatch=700, layout="padded", planner="greedy")
    assert plan.schedules == [[[7], [4], [3], [6, 1], [11, 14], [9]], [[13], [10], [12, 0], [8, 5], [15, 2], None]]
    assert plan.stats.n_dummy == [0, 1]
    assert plan_step(small, world_size=3, max_tokens_per_microbatch=None, micro_batch_size=2, layout="padded",
                     planner="greedy", lockstep=False).schedules == [
        [[7, 10], [6, 8], [14, 2]], [[13, 3], [0, 11], [15]], [[4, 12], [1, 5], [9]]
    ]
    seed = mixed_lengths(128, 64, 32768, 42)
    expected = {  # budget: (steps per rank, pad efficiency, padded tokens, rank 0's first two micro-batches)
        16384: (23, 0.971048, 1719328, [[79], [126]]),
        32768: (18, 0.939152, 1777721, [[79], [126]]),
        65536: (9, 0.885227, 1886014, [[79, 126], [88, 37]]),
        131072: (5, 0.80369, 2077355, [[79, 126, 88, 37], [71, 127, 75, 6]]),
    }
    for budget, (steps, eff, padded, head) in expected.items():
        plan = plan_step(seed, world_size=4, max_tokens_per_microbatch=budget, layout="padded", planner="greedy")
        assert [len(s) for s in plan.schedules] == [steps] * 4 and plan.stats.n_dummy == [0] * 4
        assert round(plan.stats.pad_efficiency, 6) == eff and plan.stats.padded_tokens == padded
        assert plan.schedules[0][:2] == head
        assert (plan.layout, plan.planner) == ("padded", "greedy")
