"""The balanced planner, the packed layout and the cost model: properties over random inputs, and the published
workload's targets."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from backends.model.configs import QWEN3_5_35B_A3B_TEXT_CONFIG, SHIPPED_CONFIGS, cost_model_for
from backends.specs import ModelSpec
from balance_batch import CostModel, plan_step
from balance_batch.cost import (
    active_matmul_params,
    cost_model_from_config,
    layer_types,
    microbatch_cost,
    microbatch_tokens,
)
from balance_batch.greedy import deal_to_ranks, sort_by_length
from balance_batch.stats import critical_path_lower_bound, lower_bound_bins, lower_bound_steps
from harness.data.workload import mixed_lengths
from reports.plan_json import plan_json

QWEN = cost_model_for(ModelSpec(name="qwen3_5_35b_a3b", path="/nonexistent/Qwen3.5-35B-A3B"))
SEED = mixed_lengths(128, 64, 32768, 42)
BUDGETS = (16384, 32768, 65536, 131072)

lengths_st = st.lists(st.integers(min_value=1, max_value=5000), min_size=0, max_size=60)
cost_st = st.sampled_from([CostModel.tokens(), CostModel(1.0, 1e-3, "test"), QWEN])


@st.composite
def cases(draw):
    """Lengths, ranks 1-16, a budget (often exactly a length, twice one, or a sum of two), a layout."""
    lengths = draw(lengths_st)
    world = draw(st.integers(1, 16))
    if lengths and draw(st.booleans()):
        a, b = draw(st.sampled_from(lengths)), draw(st.sampled_from(lengths))
        budget = draw(st.sampled_from([a, 2 * a, a + b, max(1, a - 1), a // 2 or 1]))
    else:
        budget = draw(st.integers(1, 20000))
    return lengths, world, budget, draw(st.sampled_from(["padded", "packed"])), draw(cost_st)


def _microbatches(plan):
    return [b for s in plan.schedules for b in s if b is not None]


@settings(max_examples=150, deadline=None)
@given(cases(), st.booleans())
def test_balanced_plans_every_example_once_within_the_budget(case, align):
    lengths, world, budget, layout, cm = case
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, lockstep=align, layout=layout,
                     planner="balanced", cost_model=cm)
    assert len(plan.schedules) == world
    seen = sorted(i for b in _microbatches(plan) for i in b)
    assert seen == list(range(len(lengths)))
    for b in _microbatches(plan):
        assert b, "an empty micro-batch is a dummy (None), never []"
        assert microbatch_tokens(b, lengths, layout) <= budget or len(b) == 1
    st_ = plan.stats
    assert st_.over_budget == sum(1 for b in _microbatches(plan) if microbatch_tokens(b, lengths, layout) > budget)
    assert st_.over_budget == sum(1 for n in lengths if n > budget)  # only the lone over-long ones
    assert st_.steps >= lower_bound_steps(lengths, world, budget) == st_.lower_bound_steps
    if align:
        assert len({len(s) for s in plan.schedules}) <= 1
        assert st_.steps == len(plan.schedules[0])
    else:
        assert all(b is not None for s in plan.schedules for b in s)
    assert math.isclose(
        sum(st_.cost_per_rank), sum(microbatch_cost(b, lengths, layout, cm) for b in _microbatches(plan))
    )


@settings(max_examples=150, deadline=None)
@given(cases())
def test_balanced_steps_against_the_bounds(case):
    lengths, world, budget, layout, cm = case
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout=layout, planner="balanced",
                     cost_model=cm)
    if layout == "padded":
        greedy = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout="padded",
                           planner="greedy", cost_model=cm)
        assert plan.stats.steps <= greedy.stats.steps
        return
    # Any-fit packing (ours falls back to best fit) can only fail to seat a sequence of length x
    # in K micro-batches when each has less than x room; when the total leaves room for that,
    # the lower bound is reached for sure.
    bound = lower_bound_steps(lengths, world, budget)
    rest = [n for n in lengths if n <= budget]
    n_rest_bins = bound * world - (len(lengths) - len(rest))
    if not rest or sum(rest) - max(rest) <= n_rest_bins * (budget - max(rest)):
        assert plan.stats.steps == bound
    if lengths:
        assert plan.stats.critical_path >= critical_path_lower_bound(lengths, world, budget, cm) - 1e-9


def _packs_into(lengths: list[int], budget: int, bins: int) -> bool:
    """Exact search: do these sequences (each within the budget) fit in ``bins`` micro-batches?"""
    room = [budget] * bins
    order = sorted(lengths, reverse=True)

    def place(i: int) -> bool:
        if i == len(order):
            return True
        tried = set()
        for j in range(bins):
            if room[j] >= order[i] and room[j] not in tried:
                tried.add(room[j])
                room[j] -= order[i]
                if place(i + 1):
                    return True
                room[j] += order[i]
        return False

    return place(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=9), st.integers(1, 5), st.integers(10, 100))
@example([20, 20, 21, 21, 21, 23], 1, 63)  # two exact fills (21+21+21, 20+20+23) that LPT misses: found by hypothesis
def test_balanced_packed_reaches_the_bound_whenever_a_plan_can(lengths, world, budget):
    """On small inputs an exact search says whether any plan has the lower-bound step count; then ours has it."""
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout="packed", planner="balanced")
    bound = lower_bound_steps(lengths, world, budget)
    rest = [n for n in lengths if n <= budget]
    if _packs_into(rest, budget, bound * world - (len(lengths) - len(rest))):
        assert plan.stats.steps == bound
    else:
        assert plan.stats.steps > bound


@settings(max_examples=60, deadline=None)
@given(cases())
def test_balanced_is_deterministic_and_puts_the_costliest_step_first(case):
    lengths, world, budget, layout, cm = case
    a = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout=layout, planner="balanced",
                  cost_model=cm)
    b = plan_step(list(lengths), world_size=world, max_tokens_per_microbatch=budget, layout=layout,
                  planner="balanced", cost_model=cm)
    assert a.schedules == b.schedules
    steps = [max(microbatch_cost(s[k], lengths, layout, cm) for s in a.schedules) for k in range(a.stats.steps)]
    assert steps == sorted(steps, reverse=True)


@pytest.mark.parametrize("lengths, budget, bins", [
    ([], 100, 0),
    ([10, 10, 10], 30, 1),
    ([10, 10, 10], 29, 2),
    ([60, 60, 60], 100, 3),  # none of those over half the budget can share
    ([50, 50, 50, 50], 100, 2),  # exactly half: two fit
    ([150, 40, 40, 30], 100, 3),  # one alone over budget, then 110 tokens need two
    ([150, 250, 60, 10], 100, 3),
])
def test_lower_bound_by_hand(lengths, budget, bins):
    assert lower_bound_bins(lengths, budget) == bins
    assert lower_bound_steps(lengths, 2, budget) == math.ceil(bins / 2)


def test_seed_workload_lower_bounds_match_the_published_table():
    assert [lower_bound_steps(SEED, 4, b) for b in BUDGETS] == [20, 13, 7, 4]
    assert [lower_bound_steps(SEED, 8, b) for b in BUDGETS] == [10, 7, 4, 2]
    assert [lower_bound_steps(SEED, 1, b) for b in BUDGETS] == [79, 52, 26, 13]


@settings(max_examples=100, deadline=None)
@given(lengths_st, st.integers(1, 8), st.integers(1, 20000))
def test_greedy_packed_sorts_deals_and_fills_to_the_sum(lengths, world, budget):
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout="packed", planner="greedy",
                     lockstep=False)
    dealt = deal_to_ranks(sort_by_length(lengths), world)
    for rank, schedule in enumerate(plan.schedules):
        assert [i for b in schedule for i in b] == dealt[rank]  # the original planner's order, cut differently
        for cur, nxt in zip(schedule, schedule[1:]):
            assert sum(lengths[i] for i in cur) + lengths[nxt[0]] > budget  # closed only when the next one does not fit
        for b in schedule:
            assert sum(lengths[i] for i in b) <= budget or len(b) == 1
    assert plan.stats.pad_efficiency == 1.0 and plan.stats.real_tokens == plan.stats.padded_tokens


def test_packed_greedy_without_a_budget_is_fixed_slices():
    lengths = [5, 9, 1, 7, 3]
    kw = dict(world_size=2, max_tokens_per_microbatch=None, micro_batch_size=2, planner="greedy", lockstep=False)
    packed = plan_step(lengths, layout="packed", **kw)
    padded = plan_step(lengths, layout="padded", **kw)
    assert packed.schedules == padded.schedules
    assert packed.stats.pad_efficiency == 1.0 and padded.stats.pad_efficiency < 1.0


def test_bad_choices_are_refused():
    kw = dict(world_size=1, lockstep=False)
    with pytest.raises(ValueError, match="layout"):
        plan_step([1], max_tokens_per_microbatch=None, layout="zigzag", planner="greedy", **kw)
    with pytest.raises(ValueError, match="planner"):
        plan_step([1], max_tokens_per_microbatch=None, layout="padded", planner="magic", **kw)
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_step([1], max_tokens_per_microbatch=None, layout="padded", planner="balanced", **kw)


@pytest.mark.parametrize("world", [1, 4, 8])
def test_balanced_packed_meets_its_targets_on_the_seed_workload(world):
    """Fewest steps, only lone sequences over budget, ranks within 0.5%, the critical path near its bound."""
    for budget in BUDGETS:
        plan = plan_step(SEED, world_size=world, max_tokens_per_microbatch=budget, layout="packed", planner="balanced",
                         cost_model=QWEN)
        st_ = plan.stats
        assert st_.steps == st_.lower_bound_steps, (world, budget)
        assert st_.over_budget == sum(1 for n in SEED if n > budget)
        assert st_.cost_imbalance <= 1.005, (world, budget, st_.cost_imbalance)
        bound = critical_path_lower_bound(SEED, world, budget, QWEN)
        assert bound <= st_.critical_path
        if world == 4:
            assert st_.critical_path <= 1.02, (budget, st_.critical_path)
        elif world == 8 and budget > 16384:
            assert st_.critical_path <= 1.05, (budget, st_.critical_path)
        elif world == 8:
            # 52 sequences of 16,385-32,730 tokens sit alone, 8 to a step: no plan beats 1.0505
            # with this cost model, so 1.05 cannot be met; stay within 0.3% of the bound.
            assert bound > 1.05 and st_.critical_path <= bound + 0.003, (bound, st_.critical_path)


@pytest.mark.parametrize("world", [1, 4, 8])
def test_balanced_padded_evens_the_ranks_on_the_seed_workload(world):
    """Padded, ranks within 0.5% of each other, in no more steps than the original greedy planner."""
    for budget in BUDGETS:
        kw = dict(world_size=world, max_tokens_per_microbatch=budget, layout="padded", cost_model=QWEN)
        greedy = plan_step(SEED, planner="greedy", **kw).stats
        st_ = plan_step(SEED, planner="balanced", **kw).stats
        assert st_.steps <= greedy.steps, (world, budget)
        assert st_.over_budget == sum(1 for n in SEED if n > budget)
        assert st_.cost_imbalance <= 1.005, (world, budget, st_.cost_imbalance)


@pytest.mark.parametrize("world", [4, 8])
def test_balanced_beats_greedy_on_the_seed_workload(world):
    for layout in ("padded", "packed"):
        for budget in BUDGETS:
            kw = dict(world_size=world, max_tokens_per_microbatch=budget, layout=layout, cost_model=QWEN)
            greedy = plan_step(SEED, planner="greedy", **kw).stats
            balanced = plan_step(SEED, planner="balanced", **kw).stats
            assert balanced.steps <= greedy.steps
            assert balanced.critical_path < greedy.critical_path, (layout, budget)
            assert balanced.cost_imbalance < greedy.cost_imbalance, (layout, budget)


def test_plan_json_document():
    plan = plan_step([300, 20, 500], world_size=2, max_tokens_per_microbatch=400, layout="packed", planner="balanced",
                     cost_model=QWEN)
    doc = plan_json(plan, backend="fsdp2")
    assert list(doc)[:2] == ["version", "backend"] and doc["version"] == 1
    assert doc["world_size"] == 2 and doc["lockstep"] is True
    assert (doc["planner"], doc["layout"], doc["max_tokens_per_microbatch"], doc["micro_batch_size"]) == (
        "balanced",
        "packed",
        400,
        1,
    )
    assert doc["cost_model"] == QWEN.as_dict() and doc["lengths"] == [300, 20, 500]
    assert doc["schedules"] == plan.schedules


# --- the cost model -------------------------------------------------------------------------


def test_qwen_cost_model_counts_the_active_weights_and_only_full_attention_pairs():
    kinds = layer_types(QWEN3_5_35B_A3B_TEXT_CONFIG)
    assert kinds.count("full_attention") == 10 and kinds[3] == "full_attention" and kinds[0] == "linear_attention"
    assert QWEN.b == 10 * 2 * 16 * 256  # 10 full-attention layers, 16 heads of 256, causal
    active = active_matmul_params(QWEN3_5_35B_A3B_TEXT_CONFIG)
    assert 2.8e9 < active < 3.1e9  # "A3B": about 3B active weights (the LM head included, the embedding not)
    assert 2 * active < QWEN.a < 2 * active * 1.05  # plus the linear-attention state updates and the causal diagonal
    assert "qwen3_5_35b_a3b" in QWEN.source


def test_a_checkpoint_config_on_disk_wins(tmp_path):
    import json

    config = {"architectures": ["X"], "text_config": {**QWEN3_5_35B_A3B_TEXT_CONFIG, "num_hidden_layers": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cm = cost_model_for(ModelSpec(name="qwen3_5_35b_a3b", path=str(tmp_path)))
    assert cm.source == str(tmp_path / "config.json")
    assert cm.b == 2 * 2 * 16 * 256  # 8 layers: 2 of them full attention


def test_without_linear_attention_every_layer_is_full_attention():
    dense = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, vocab_size=100)
    cm = cost_model_from_config(dense, "dense")
    assert cm.b == 3 * 2 * 4 * 16
    assert active_matmul_params(dense) == 3 * (4 * 64 * 64 + 3 * 64 * 128) + 64 * 100


def test_unknown_models_fall_back_to_counting_tokens():
    assert cost_model_for(ModelSpec(name="someone_elses", path="/nonexistent")) == CostModel.tokens()
    tiny = cost_model_for(ModelSpec())
    assert tiny.source.endswith("TINY_CONFIG") and tiny.b > 0
    assert cost_model_for(ModelSpec(vocab_size=4096)).a > tiny.a  # a bigger LM head


def test_tiny_cost_model_counts_the_real_models_weights():
    """The formula's active weights equal those of the Hugging Face model built from the same config."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from backends.model.configs import TINY_CONFIG

    config = SHIPPED_CONFIGS["tiny"]
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY_CONFIG))
    per_token = 0
    for module in model.modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            per_token += module.weight.numel()
        elif kind.endswith("Experts"):  # every expert's weights, of which top-k are used per token
            total = sum(p.numel() for p in module.parameters(recurse=False))
            per_token += total * config["num_experts_per_tok"] // config["num_experts"]
        elif kind.endswith("TopKRouter"):
            per_token += module.weight.numel()
    assert active_matmul_params(config) == per_token
