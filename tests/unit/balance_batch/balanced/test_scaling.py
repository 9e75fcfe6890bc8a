"""The planner at corpus scale: a cap on sequences per micro-batch, the histogram packers, packing efficiency,
growth."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance_batch import plan_step
from balance_batch.balanced.packed import _Packer
from balance_batch.greedy import sort_by_length
from balance_batch.stats import lower_bound_bins

_SPEC = importlib.util.spec_from_file_location(
    "bench_planner", Path(__file__).resolve().parents[4] / "scripts" / "bench_planner.py"
)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

CASES = [("greedy", "padded"), ("greedy", "packed"), ("balanced", "padded"), ("balanced", "packed")]


@st.composite
def capped_cases(draw):
    lengths = draw(st.lists(st.integers(1, 600), min_size=1, max_size=80))
    budget = draw(st.sampled_from([max(lengths), 2 * max(lengths), 512, 1000, 3000]))
    return lengths, draw(st.integers(1, 8)), budget, draw(st.integers(1, 6)), draw(st.sampled_from(CASES))


@settings(max_examples=150, deadline=None)
@given(capped_cases(), st.booleans())
def test_the_cap_holds_in_both_planners_and_layouts(case, align):
    lengths, world, budget, cap, (planner, layout) = case
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, lockstep=align, layout=layout,
                     planner=planner, max_seqs_per_microbatch=cap)
    batches = [b for s in plan.schedules for b in s if b]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every example once
    assert max(len(b) for b in batches) <= cap == plan.max_seqs_per_microbatch
    for b in batches:  # the budget still holds (a sequence over it alone)
        tokens = sum(lengths[i] for i in b) if layout == "packed" else len(b) * max(lengths[i] for i in b)
        assert len(b) == 1 or tokens <= budget
    assert plan.stats.lower_bound_steps == math.ceil(lower_bound_bins(lengths, budget, max_seqs=cap) / world)
    assert plan.stats.steps >= plan.stats.lower_bound_steps
    assert lower_bound_bins(lengths, budget, max_seqs=cap) >= math.ceil(sum(n <= budget for n in lengths) / cap)


def test_the_cap_is_part_of_the_lower_bound_and_the_balanced_planner_reaches_it():
    lengths = [10] * 100  # 1,000 tokens: one micro-batch of 1,024, or 25 of at most 4 sequences
    assert lower_bound_bins(lengths, 1024) == 1
    assert lower_bound_bins(lengths, 1024, max_seqs=4) == 25
    for layout in ("packed", "padded"):
        plan = plan_step(lengths, world_size=5, max_tokens_per_microbatch=1024, planner="balanced", layout=layout,
                         max_seqs_per_microbatch=4)
        assert plan.stats.steps == plan.stats.lower_bound_steps == 5
        assert plan.stats.max_microbatch_size == 4


def test_without_a_budget_the_cap_limits_the_fixed_slices():
    plan = plan_step([5] * 10, world_size=1, max_tokens_per_microbatch=None, micro_batch_size=4, layout="padded",
                     planner="greedy", lockstep=False, max_seqs_per_microbatch=3)
    assert [len(b) for b in plan.schedules[0]] == [3, 3, 3, 1]
    assert plan.stats.lower_bound_steps == 4


@pytest.mark.parametrize("planner,layout", [("greedy", "padded"), ("greedy", "packed")])
def test_a_cap_no_micro_batch_reaches_leaves_the_greedy_planner_as_it_was(planner, layout):
    lengths = bench.DISTRIBUTIONS["mixed"][0](500)
    for world in (1, 3, 8):
        plain = plan_step(lengths, world_size=world, max_tokens_per_microbatch=65536, layout=layout, planner=planner)
        capped = plan_step(lengths, world_size=world, max_tokens_per_microbatch=65536, layout=layout, planner=planner,
                           max_seqs_per_microbatch=10**6)
        assert capped.schedules == plain.schedules


def test_bad_caps_are_refused():
    for bad in (0, -1, True, 2.5, "3"):
        with pytest.raises(ValueError, match="max_seqs_per_microbatch"):
            plan_step([1, 2], world_size=1, max_tokens_per_microbatch=10, layout="padded", planner="greedy",
                      lockstep=False, max_seqs_per_microbatch=bad)


def _item_bfd(lengths, budget, cap):
    """Best-fit decreasing one sequence at a time (the textbook form): the histogram packer must match its count."""
    rooms = []  # (room, count) per micro-batch
    for n in sorted(lengths, reverse=True):
        fits = [j for j, (room, count) in enumerate(rooms) if room >= n and count < cap]
        if fits:
            j = min(fits, key=lambda j: rooms[j][0])
            rooms[j] = (rooms[j][0] - n, rooms[j][1] + 1)
        else:
            rooms.append((budget - n, 1))
    return len(rooms)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 100), min_size=1, max_size=120), st.integers(100, 400), st.sampled_from([None, 1, 2, 3, 7])
)
def test_histogram_best_fit_decreasing_packs_as_the_one_at_a_time_form(lengths, budget, cap):
    order = sort_by_length(lengths)
    pools: dict[int, list[int]] = {}
    for i in order:
        pools.setdefault(lengths[i], []).append(i)
    packer = _Packer([(n, len(ids)) for n, ids in pools.items()], budget, cap or math.inf, {n: float(n) for n in pools})
    packer.bfd()
    groups = packer.groups(pools)
    assert packer.n_bins() == len(groups) == _item_bfd(lengths, budget, cap or math.inf)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= budget and len(g) <= (cap or len(g)) for g in groups)
    for g in groups:  # longest first, ties by index: what the rest of the planner expects
        assert g == sorted(g, key=lambda i: (-lengths[i], i))


def test_short_sequences_pack_within_a_tenth_of_a_percent_of_the_bound():
    lengths = bench.short_lengths(100_000)
    plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=512, planner="balanced", layout="packed")
    bound = lower_bound_bins(lengths, 512)
    efficiency = sum(lengths) / (sum(plan.stats.n_microbatches) * 512)
    assert efficiency >= 0.999 * sum(lengths) / (bound * 512), (sum(plan.stats.n_microbatches), bound)


def test_the_cap_holds_where_a_few_cheap_micro_batches_take_many_short_sequences():
    """Two long sequences leave two of the four micro-batches empty and cheapest; ten short ones must still go three at
    most."""
    lengths = [100, 100] + [1] * 10
    plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=1000, planner="balanced", layout="packed",
                     max_seqs_per_microbatch=3)
    assert plan.stats.lower_bound_steps == plan.stats.steps == 4
    assert plan.stats.max_microbatch_size == 3
