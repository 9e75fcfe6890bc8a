"""The peer planners (harness/peers/): small hand-computed plans, each peer's edges (a sequence over the
budget, no sequences, one, all equal), what plan_step records of them, and the published workload's step counts."""

from __future__ import annotations

import pytest

from balance_batch import PLANNERS, plan_step
from balance_batch.planners import planner_names
from harness.data.workload import mixed_lengths
from harness.peers import PEER_NAMES, PEERS, PeerRefusal, automodel, fairseq, nemo_rl, peer_layout, trl, verl
from reports.plan_json import check_plan_json, plan_json

SEED = mixed_lengths(128, 64, 32768, 42)  # the published workload's generator, as the balanced planner's tests


def _covers(schedules, n):
    seen = sorted(i for s in schedules for b in s if b for i in b)
    return seen == list(range(n))


# --- verl ---------------------------------------------------------------------------------------------------------

def test_karmarkar_karp_differences_into_balanced_sums():
    parts = verl.karmarkar_karp([1, 2, 3, 4, 5, 6], 2, equal_size=False)
    assert sorted(sum(i + 1 for i in p) for p in parts) == [10, 11]
    equal = verl.karmarkar_karp([1, 2, 3, 4, 5, 6], 2, equal_size=True)
    assert sorted(len(p) for p in equal) == [3, 3] and sorted(sum(i + 1 for i in p) for p in equal) == [10, 11]


def test_verl_counts_micro_batches_from_the_total_and_runs_the_heaviest_first_of_two():
    # 15 tokens, budget 8: ceil(15/8) = 2 micro-batches; KK puts 8 alone and 5 with 2; the heavier runs first.
    # The rank's share is ordered light/heavy alternately (2, 8, 5), so 5 and 2 sit in that share's order: 2 first
    assert verl.plan([8, 5, 2], 1, 8).schedules == [[[0], [2, 1]]]
    # all equal: each of 2 ranks holds 4 of 4 tokens, 16 tokens at budget 8 -> 2 micro-batches of 2 per rank
    result = verl.plan([4] * 8, 2, 8)
    assert [[len(b) for b in s] for s in result.schedules] == [[2, 2], [2, 2]] and _covers(result.schedules, 8)


def test_verl_strict_budget_adds_micro_batches_until_none_is_over():
    # the strict-budget change's own example: eight 7s at 8 tokens start from ceil(56/8) = 7 micro-batches
    loose = verl.plan([7] * 8, 1, 8, strict=False)
    assert len(loose.schedules[0]) == 7 and max(len(b) for b in loose.schedules[0]) == 2
    strict = verl.plan([7] * 8, 1, 8)
    assert len(strict.schedules[0]) == 8 and strict.knobs["micro_batches_per_rank"] == 8


def test_verl_edges():
    with pytest.raises(PeerRefusal, match="verl refuses example 1 of 30 tokens"):
        verl.plan([5, 30], 1, 20)
    with pytest.raises(PeerRefusal, match="3 examples do not divide over 2 ranks"):
        verl.plan([5, 5, 5], 2, 20)
    assert verl.plan([], 2, 20).schedules == [[], []]
    assert verl.plan([5], 1, 20).schedules == [[[0]]]
    with pytest.raises(PeerRefusal, match="needs a token budget"):
        verl.plan([5], 1, None)


# --- NeMo-RL ------------------------------------------------------------------------------------------------------

def test_nemo_rl_packers_on_hand_computed_bins():
    lengths = [6, 4, 3, 3, 2, 1, 1]
    # MFFD: 6 is large and takes the medium 4; the rest spill, largest first, into one bin of 10
    assert nemo_rl.modified_first_fit_decreasing(lengths, 10) == [[0, 1], [2, 3, 4, 5, 6]]
    # FFD sorts (length, index) descending, so of equal lengths the later index goes first
    assert nemo_rl.first_fit_decreasing(lengths, 10) == [[0, 1], [3, 2, 4, 6, 5]]
    # concatenative: NeMo-RL's documented example
    assert nemo_rl.concatenative([4, 1, 3, 2, 1, 3, 4, 5], 5) == [[0, 1], [2, 3], [4, 5], [6], [7]]
    assert nemo_rl.concatenative([4, 1, 3, 2, 1, 3, 4, 5], 8) == [[0, 1, 2], [3, 4, 5], [6], [7]]
    # all equal (medium): two to a bin
    assert nemo_rl.modified_first_fit_decreasing([5] * 4, 10) == [[0, 1], [2, 3]]
    shuffled = nemo_rl.first_fit_shuffle(lengths, 10, seed=3)
    assert sorted(i for b in shuffled for i in b) == list(range(7))


def test_nemo_rl_bin_count_rises_to_a_multiple_of_the_ranks_by_moving_single_sequences():
    assert nemo_rl.adjust_bin_count([[0, 1, 2], [3]], 4, 4) == [[0], [3], [2], [1]]
    result = nemo_rl.plan_packing([6, 4, 3, 3, 2, 1, 1], 2, 10)
    assert result.schedules == [[[0, 1]], [[2, 3, 4, 5, 6]]]
    assert result.knobs["algorithm"] == "modified_first_fit_decreasing"


def test_nemo_rl_packing_edges():
    with pytest.raises(PeerRefusal, match="sequence length 30 exceeds bin capacity 20"):
        nemo_rl.plan_packing([5, 30], 1, 20)
    with pytest.raises(PeerRefusal, match="cannot make 2 bins"):
        nemo_rl.plan_packing([], 2, 20)
    with pytest.raises(PeerRefusal, match="cannot make 2 bins"):
        nemo_rl.plan_packing([5], 2, 20)
    assert nemo_rl.plan_packing([5], 1, 20).schedules == [[[0]]]
    with pytest.raises(PeerRefusal, match="not a NeMo-RL packing algorithm"):
        nemo_rl.plan_packing([5], 1, 20, algorithm="best_fit")


def test_nemo_rl_dynamic_cuts_every_rank_at_the_positions_the_rounded_cross_rank_maximum_allows():
    # sorted 10, 20, 50, 100 dealt to 2 ranks: [10, 50] and [20, 100]; position maxima 20 -> 64 and 100 (the width)
    assert nemo_rl.plan_dynamic([100, 10, 50, 20], 2, 256).schedules == [[[1, 2]], [[3, 0]]]
    assert nemo_rl.plan_dynamic([100, 10, 50, 20], 2, 150).schedules == [[[1], [2]], [[3], [0]]]
    assert nemo_rl.plan_dynamic([8] * 4, 1, 16, round_to=1).schedules == [[[0, 1], [2, 3]]]


def test_nemo_rl_dynamic_edges():
    # the advice names the budget that plans every position (100), not the first position over it (64): a user
    # following it is not walked up one refusal at a time
    with pytest.raises(PeerRefusal, match="padded \\(64\\) sequence lengths up to 100, .* at least 100$"):
        nemo_rl.plan_dynamic([100, 10, 50, 20], 2, 60)
    assert nemo_rl.plan_dynamic([100, 10, 50, 20], 2, 100).schedules == [[[1], [2]], [[3], [0]]]
    with pytest.raises(PeerRefusal, match="3 examples do not divide over 2 ranks"):
        nemo_rl.plan_dynamic([1, 2, 3], 2, 100)
    assert nemo_rl.plan_dynamic([], 2, 100).schedules == [[], []]
    assert nemo_rl.plan_dynamic([7], 1, 100).schedules == [[[0]]]


# --- fairseq ------------------------------------------------------------------------------------------------------

def test_fairseq_batch_by_size_keeps_whole_multiples():
    assert fairseq.batch_by_size(list(range(10)), [1] * 10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # under budget, batches are still cut at multiples of 8 (required_batch_size_multiple's default)
    assert fairseq.batch_by_size(list(range(10)), [1] * 10, 100, multiple=8) == [list(range(8)), [8, 9]]
    # at 6 sentences over a budget of 5 the running batch keeps its last even count; the tail starts the next
    assert fairseq.batch_by_size(list(range(10)), [1] * 10, 5, multiple=2) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # count x longest: the 3s do not join the 1s
    assert fairseq.batch_by_size(list(range(5)), [1, 1, 1, 3, 3], 6) == [[0, 1, 2], [3, 4]]
    assert fairseq.batch_by_size(list(range(4)), [1] * 4, 100, max_sentences=3) == [[0, 1, 2], [3]]


def test_fairseq_shards_shuffled_batches_and_pads_a_short_rank_with_an_empty_batch():
    result = fairseq.plan([1] * 10, 2, 4, multiple=1)
    sizes = sorted(len(b) for s in result.schedules for b in s if b)
    assert sizes == [2, 4, 4] and _covers(result.schedules, 10)
    assert sum(b is None for s in result.schedules for b in s) == 1 == result.peer_empty
    assert fairseq.plan([1] * 10, 2, 4, multiple=1).schedules == result.schedules  # seeded: the same every time


def test_fairseq_edges():
    with pytest.raises(PeerRefusal, match="over max_tokens 20"):
        fairseq.plan([5, 30], 1, 20)
    assert fairseq.plan([], 2, 20).schedules == [[], []]
    one = fairseq.plan([5], 2, 20)
    assert one.schedules == [[[0]], [None]] and one.peer_empty == 1
    assert [len(b) for b in fairseq.plan([3] * 16, 1, 24).schedules[0]] == [8, 8]


# --- TRL ----------------------------------------------------------------------------------------------------------

def test_trl_fixed_splits_each_buffer_longest_first_by_squared_length():
    result = trl.plan_fixed([1, 2, 3, 4, 5, 6, 7, 8], 2, per_device=2)
    assert result.schedules == [[[3], [7, 4]], [[2, 1, 0], [6, 5]]]
    partial = trl.plan_fixed([1, 2, 3, 4, 5], 2, per_device=2)
    assert partial.schedules[1][-1] is None and "TRL waits for more samples" in partial.differs[0]
    assert "not used to plan" in trl.plan_fixed([1, 2], 1, budget=10).differs[-1]


def test_trl_budget_fills_the_lightest_row_that_fits_and_closes_when_none_does():
    assert trl.plan_budget([5, 5, 5, 5, 5], 2, 10).schedules == [[[0, 2], [4]], [[1, 3], None]]
    assert trl.plan_budget([4] * 4, 1, 8).schedules == [[[0, 1], [2, 3]]]


def test_trl_edges():
    with pytest.raises(PeerRefusal, match="TRL drops it"):
        trl.plan_budget([5, 30], 1, 20)
    assert trl.plan_budget([], 2, 20).schedules == [[], []]
    assert trl.plan_fixed([], 2).schedules == [[], []]
    assert trl.plan_budget([5], 2, 20).schedules == [[[0]], [None]]


# --- Automodel ----------------------------------------------------------------------------------------------------

def test_automodel_fills_a_padded_budget_and_runs_an_oversize_sequence_alone():
    assert automodel.token_budget_batches([0, 1, 2, 3], [4, 4, 2, 9], 8) == [[0, 1], [2], [3]]
    assert automodel.token_budget_batches([0, 1, 2, 3], [4, 4, 2, 9], 8, max_batch_size=1) == [[0], [1], [2], [3]]


def test_automodel_strides_whole_rounds_and_the_harness_runs_the_remainder_the_peer_drops():
    result = automodel.plan([4, 9, 2, 7], 2, 9)  # sorted longest first: [9], [7], [4, 2]
    assert result.schedules == [[[1], [0, 2]], [[3]]]
    assert any("drops the last 1 of 3 batches" in d for d in result.differs)


def test_automodel_edges():
    assert automodel.plan([], 2, 20).schedules == [[], []]
    assert automodel.plan([30], 1, 20).schedules == [[[0]]]  # over the budget: alone, as the peer warns and does
    assert [len(b) for b in automodel.plan([5] * 8, 1, 20).schedules[0]] == [4, 4]


# --- through plan_step --------------------------------------------------------------------------------------------

def test_every_peer_is_a_planner_with_its_own_layout():
    # importing harness.peers registers them with the library's planners; they are not the library's own PLANNERS
    assert PLANNERS == ("greedy", "balanced") and not set(PEER_NAMES) & set(PLANNERS)
    assert set(PEER_NAMES) <= set(planner_names()) and planner_names()[:2] == PLANNERS
    assert {name: peer_layout(name) for name in PEER_NAMES} == {
        "verl": "packed", "nemo_rl_packing": "packed", "nemo_rl_dynamic": "padded", "fairseq": "padded",
        "trl_fixed": "packed", "trl_budget": "packed", "automodel": "padded"}
    assert peer_layout("balanced") is None


def test_plan_step_records_the_peer_and_the_dummies_it_adds_for_lock_step_ranks():
    plan = plan_step([4, 9, 2, 7], world_size=2, max_tokens_per_microbatch=9, layout="padded", planner="automodel")
    assert plan.schedules == [[[1], [0, 2]], [[3], None]]
    record = plan.record()
    assert record["peer"]["harness_dummies"] == 1 and record["peer"]["peer_empty_steps"] == 0
    assert record["peer"]["knobs"]["max_tokens_per_batch"] == 9 and "Automodel" in record["peer"]["source"]
    assert record["steps"] == 2 and record["n_dummy"] == [0, 1]
    doc = plan_json(plan, backend="fsdp2")
    check_plan_json(doc)
    assert doc["peer"] == record["peer"]
    # fairseq's own empty batch is its dummy, not the harness's; ranks that run independently drop it
    kw = dict(world_size=2, max_tokens_per_microbatch=20, layout="padded", planner="fairseq")
    lock = plan_step([5], **kw).record()["peer"]
    assert (lock["peer_empty_steps"], lock["harness_dummies"]) == (1, 0)
    free = plan_step([5], lockstep=False, **kw)
    assert free.schedules == [[[0]], []] and free.peer["dropped_empty_steps"] == 1


def test_plan_step_notes_another_layout_and_refuses_a_cap_the_peer_has_no_knob_for():
    plan = plan_step([4, 9, 2, 7], world_size=2, max_tokens_per_microbatch=9, layout="packed", planner="automodel")
    assert "planned by automodel's own budget (padded rows), run packed" in plan.peer["differs"]
    with pytest.raises(PeerRefusal, match="verl has no cap on sequences per micro-batch"):
        plan_step([4, 4], world_size=1, max_tokens_per_microbatch=9, layout="packed", planner="verl", lockstep=False,
                  max_seqs_per_microbatch=2)
    capped = plan_step([1] * 6, world_size=1, max_tokens_per_microbatch=100, layout="padded", planner="fairseq",
                       lockstep=False, max_seqs_per_microbatch=4)
    assert capped.peer["knobs"]["max_sentences"] == 4 and capped.stats.max_microbatch_size <= 4
    assert plan_step([3, 3], world_size=1, max_tokens_per_microbatch=9, layout="padded", planner="greedy",
                     lockstep=False).peer is None


# --- the published workload ---------------------------------------------------------------------------------------

# Lock-step steps on 4 ranks at 32,768 / 65,536 / 131,072 tokens (docs/measurements/2026-12-03-peers.md); at 16,384
# every peer but trl_fixed and automodel refuses the workload's longer sequences, as the peer itself does.
PUBLISHED_STEPS = {
    "verl": (15, 7, 4), "nemo_rl_packing": (13, 7, 4), "nemo_rl_dynamic": (18, 9, 5), "fairseq": (18, 9, 5),
    "trl_fixed": (4, 4, 4), "trl_budget": (20, 8, 4), "automodel": (18, 8, 4),
}


@pytest.mark.parametrize("name", PEER_NAMES)
def test_published_workload_keeps_its_documented_step_counts(name):
    def plan(budget):
        return plan_step(SEED, world_size=4, max_tokens_per_microbatch=budget, layout=PEERS[name].layout, planner=name)

    steps = tuple(plan(budget).stats.steps for budget in (32768, 65536, 131072))
    assert steps == PUBLISHED_STEPS[name]
    if name in ("trl_fixed", "automodel"):  # a fixed count; a lone batch over the budget (with the peer's warning)
        stats = plan(16384).stats
        assert stats.steps == {"trl_fixed": 4, "automodel": 23}[name]
        # the bound is the planner's own: TRL's fixed count never reads the budget, so the budget bounds nothing
        assert stats.lower_bound_steps == {"trl_fixed": 4, "automodel": 20}[name] <= stats.steps
    else:
        with pytest.raises(PeerRefusal, match=f"planner: {name} refuses"):
            plan(16384)


def test_the_peers_preset_sweeps_every_planner():
    import yaml

    from tests.conftest import CONF

    preset = yaml.safe_load((CONF / "batching" / "peers.yaml").read_text())
    assert preset["batching"] == {"name": "peers"}
    assert tuple(preset["hydra"]["sweeper"]["params"]["planner"].split(",")) == planner_names()  # ours, the peers'


def test_the_harness_runs_a_peer_in_its_own_layout_unless_one_is_set_and_refuses_one_without_its_budget():
    from backends.errors import UserError
    from harness.app.batching import asked
    from tests.unit.test_batching import _resolved

    assert _resolved("planner=fairseq", "mtpm=4096").backend.layout == "padded"
    assert _resolved("planner=verl", "mtpm=4096").backend.layout == "packed"
    assert _resolved("planner=fairseq", "mtpm=4096", "layout=packed").backend.layout == "packed"
    assert _resolved("planner=trl_fixed").backend.max_tokens_per_microbatch is None  # a fixed count needs no budget
    with pytest.raises(UserError, match="mtpm: auto searches the token budget, and planner=trl_fixed takes none"):
        _resolved("planner=trl_fixed", "mtpm=auto")  # every budget would plan alike: no "set mtpm=256" answer
    with pytest.raises(UserError, match="planner: verl needs a budget"):
        _resolved("planner=verl")
    values = {"mtpm": 4096, "planner": "automodel"}
    assert asked(values.get)["layout"] == "padded"  # results.json's first record says the peer's layout too
