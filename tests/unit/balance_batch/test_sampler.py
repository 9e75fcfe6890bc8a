"""balance_batch.TokenBudgetSampler: every index once per epoch over all ranks, equal micro-batch counts, budgets,
step sizes and ramps, determinism across processes, exact resume, refused states and arguments."""

import json
import subprocess
import sys

import numpy as np
import pytest

from balance_batch import TokenBudgetSampler
from balance_batch.plan import planned_rows
from balance_batch.planners import planner_names
from harness.peers import peer_layout

B = 256


def skewed(n=300, seed=0):
    """Mostly short sequences, a few over the budget."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(40), 1.2, n)), 1, 3 * B).astype(int)
    lengths[:3] = [B + 1, 2 * B, 3 * B]
    return lengths.tolist()


def uniform(n=300):
    return [50] * n


def epoch_steps(lengths, world, epoch=0, **kw):
    """Per step, per rank, the Step; all ranks' samplers built alike."""
    samplers = [TokenBudgetSampler(lengths, max_tokens_per_microbatch=B, world_size=world, rank=r, **kw)
                for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s.steps()) for s in samplers]
    return list(zip(*per_rank))


def used(steps):
    return [i for step in steps for rank_step in step for mb in rank_step.microbatches for i in mb]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("make", [skewed, uniform])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_index_once_equal_counts_within_budget(world, make, drop_last):
    lengths = make()
    steps = epoch_steps(lengths, world, tokens_per_step=2000, drop_last=drop_last)
    seen = used(steps)
    assert len(seen) == len(set(seen))
    if drop_last:
        dropped = set(range(len(lengths))) - set(seen)
        assert len(dropped) < 2000  # at most the last step's sequences
    else:
        assert sorted(seen) == list(range(len(lengths)))
    for step in steps:
        assert len({len(rs.microbatches) for rs in step}) == 1  # every rank runs the same number
        assert len({(rs.global_tokens, rs.global_loss_tokens, rs.step, rs.consumed_tokens) for rs in step}) == 1
        for rs in step:
            for mb in rs.microbatches:
                tokens = sum(lengths[i] for i in mb)
                assert tokens <= B or len(mb) == 1  # only a lone oversize sequence passes the budget
        mine = [i for rs in step for mb in rs.microbatches for i in mb]
        assert step[0].global_tokens == sum(lengths[i] for i in mine)
        assert step[0].global_loss_tokens == sum(lengths[i] - 1 for i in mine)


def test_padded_layout_budget_is_count_times_longest():
    lengths = skewed()
    for step in epoch_steps(lengths, 2, layout="padded", sequences_per_step=64):
        for rs in step:
            for mb in rs.microbatches:
                assert len(mb) * max((lengths[i] for i in mb), default=0) <= B or len(mb) == 1


def test_tokens_per_step_band_and_ramp_thresholds():
    lengths = skewed(2000)
    longest = max(lengths)
    ramp = [(0, 1000), (8000, 3000), (20000, 6000)]
    steps = [s[0] for s in epoch_steps(lengths, 2, tokens_per_step=ramp)]
    consumed = 0
    for k, step in enumerate(steps):
        assert step.consumed_tokens == consumed and step.step == k
        target = [t for c, t in ramp if consumed >= c][-1]
        if k < len(steps) - 1:  # the last step is what is left
            assert target - longest <= step.global_tokens <= target
        consumed += step.global_tokens
    sizes = {[t for c, t in ramp if s.consumed_tokens >= c][-1] for s in steps}
    assert sizes == {1000, 3000, 6000}
    assert consumed == sum(lengths)


def test_sequences_per_step_and_last_partial_step():
    lengths = uniform(100)
    kept = [s[0] for s in epoch_steps(lengths, 3, sequences_per_step=32)]
    assert [s.global_tokens // 50 for s in kept] == [32, 32, 32, 4]
    dropped = [s[0] for s in epoch_steps(lengths, 3, sequences_per_step=32, drop_last=True)]
    assert len(dropped) == 3


def test_more_ranks_than_sequences_gives_dummies():
    steps = epoch_steps([10, 20, 30], 8, sequences_per_step=3)
    (step,) = steps
    assert all(len(rs.microbatches) == 1 for rs in step)
    assert sum(rs.microbatches == [[]] for rs in step) == 5


def test_new_order_each_epoch_and_no_shuffle():
    lengths = uniform(200)
    e0, e1 = (used(epoch_steps(lengths, 2, epoch=e, sequences_per_step=20)) for e in (0, 1))
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert used(epoch_steps(lengths, 2, epoch=0, sequences_per_step=20)) == e0
    fixed = TokenBudgetSampler(lengths, max_tokens_per_microbatch=B, shuffle=False, sequences_per_step=20)
    first = next(fixed.steps())
    assert sorted(i for mb in first.microbatches for i in mb) == list(range(20))


def test_same_seed_same_plan_in_another_process():
    lengths = skewed(400)
    kw = dict(max_tokens_per_microbatch=B, world_size=3, rank=1, seed=7, tokens_per_step=1500)
    here = [s.microbatches for s in TokenBudgetSampler(lengths, **kw).steps()]
    code = ("import json, sys; from balance_batch import TokenBudgetSampler; a = json.load(sys.stdin); "
            "print(json.dumps([s.microbatches for s in TokenBudgetSampler(a['lengths'], **a['kw']).steps()]))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps({"lengths": lengths, "kw": kw}),
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert json.loads(out) == here
    other = [s.microbatches for s in TokenBudgetSampler(lengths, **{**kw, "seed": 8}).steps()]
    assert other != here


@pytest.mark.parametrize("world", [1, 3])
def test_state_dict_round_trip_mid_epoch_across_a_ramp(world):
    lengths = skewed(700)
    kw = dict(max_tokens_per_microbatch=B, world_size=world, rank=world - 1, seed=7,
              tokens_per_step=[(0, 1000), (5000, 4000)])
    whole = TokenBudgetSampler(lengths, **kw)
    run = []
    for epoch in range(2):
        whole.set_epoch(epoch)
        run += list(whole.steps())
    thresholds = [k for k, s in enumerate(run) if s.consumed_tokens >= 5000]
    crossing = thresholds[0]
    for stop in (crossing - 1, crossing + 1, len(run) // 2 + 2):
        first = TokenBudgetSampler(lengths, **kw)
        taken = []
        for epoch in range(2):
            first.set_epoch(epoch)
            for step in first.steps():
                taken.append(step)
                if len(taken) == stop:
                    break
            if len(taken) == stop:
                break
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would keep it
        resumed = TokenBudgetSampler(lengths, **kw)
        resumed.load_state_dict(state)
        rest = []
        for epoch in range(state["epoch"], 2):
            resumed.set_epoch(epoch)  # the resumed epoch keeps its position
            rest += list(resumed.steps())
        assert taken + rest == run


def test_iter_yields_the_steps_microbatches_and_keeps_the_position():
    lengths = skewed()
    s = TokenBudgetSampler(lengths, max_tokens_per_microbatch=B, world_size=2, rank=1, tokens_per_step=3000)
    n = len(s)
    flat = list(s)
    assert n == len(flat)
    assert flat == [mb for step in s.steps() for mb in step.microbatches]  # steps() keeps its own position


@pytest.mark.parametrize("change, named", [
    ({"seed": 1}, "seed=0"),
    ({"lengths": uniform(301)}, "dataset='300 items"),
    ({"sequences_per_step": 31}, "sequences_per_step=30"),
    ({"shuffle": False}, "shuffle=True"),
    ({"drop_last": True}, "drop_last=False"),
])
def test_a_state_whose_settings_decide_other_steps_is_refused_in_one_line(change, named):
    kw = dict(lengths=uniform(300), max_tokens_per_microbatch=B, world_size=2, rank=0, seed=0, sequences_per_step=30)
    saved = TokenBudgetSampler(**kw)
    next(saved.steps())
    other = TokenBudgetSampler(**{**kw, **change})
    with pytest.raises(ValueError) as err:
        other.load_state_dict(saved.state_dict())
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kw, named", [
    ({"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch"),
    ({"sequences_per_step": 4, "tokens_per_step": 100}, "both"),
    ({"tokens_per_step": None}, "neither"),
    ({"tokens_per_step": [(0, 100), (50, 200), (50, 300)]}, "increasing"),
    ({"tokens_per_step": [(10, 100)]}, "starting at 0"),
    ({"rank": 2, "world_size": 2}, "rank"),
    ({"layout": "flat"}, "layout"),
    ({"planner": "best"}, "planner"),
    ({"lengths": [3, -1]}, "lengths"),
    ({"lengths": [0, 0]}, "at least one positive"),
])
def test_bad_arguments_are_one_clear_value_error(kw, named):
    args = dict(lengths=[3, 4], max_tokens_per_microbatch=B, tokens_per_step=100)
    with pytest.raises(ValueError, match=named):
        TokenBudgetSampler(**{**args, **kw})


@pytest.mark.parametrize("planner", [p for p in planner_names() if p != "balanced"])  # ours, and the registered peers
def test_every_registered_planner_plans_the_steps(planner):
    lengths = [min(n, B) for n in skewed(120)]  # some peers refuse a sequence over the budget
    layout = peer_layout(planner) or "packed"
    # steps of 21 sequences, 15 in the last: verl and NeMo-RL's dynamic batching split a step evenly over the ranks
    steps = epoch_steps(lengths, 3, sequences_per_step=21, planner=planner, layout=layout)
    assert sorted(used(steps)) == list(range(len(lengths)))
    assert all(len({len(rs.microbatches) for rs in step}) == 1 for step in steps)


@pytest.mark.parametrize("world", [2, 8])
def test_a_single_process_dataloader_follows_the_loop_started_before_it(world):
    from torch.utils.data import DataLoader

    lengths = skewed()
    sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=B, world_size=world, rank=0, tokens_per_step=3000)
    batches = iter(DataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=list))  # fetched lazily
    dummies = 0
    for step in sampler.steps():  # the loop's first step is taken before the loader fetches anything
        for microbatch in step.microbatches:
            assert next(batches) == microbatch  # a dummy ([]) passes through the loader too
            dummies += microbatch == []
    assert next(batches, None) is None
    assert dummies > 0 or world == 2


def test_one_ranks_state_resumes_another_rank():
    kw = dict(max_tokens_per_microbatch=B, world_size=3, seed=3, tokens_per_step=1000)
    lengths = skewed()
    saver = TokenBudgetSampler(lengths, rank=0, **kw)
    steps = saver.steps()
    next(steps), next(steps)
    other = TokenBudgetSampler(lengths, rank=2, **kw)
    other.load_state_dict(saver.state_dict())
    assert list(other.steps()) == list(TokenBudgetSampler(lengths, rank=2, **kw).steps())[2:]


def test_an_epoch_started_directly_counts_the_steps_and_tokens_before_it():
    kw = dict(lengths=skewed(), max_tokens_per_microbatch=B, world_size=2, rank=0,
              tokens_per_step=[(0, 1000), (9000, 3000)], drop_last=True)
    sequential = TokenBudgetSampler(**kw)
    for epoch in range(3):
        sequential.set_epoch(epoch)
        run = list(sequential.steps())
    direct = TokenBudgetSampler(**kw)
    direct.set_epoch(2)
    assert list(direct.steps()) == run and run[0].step > 0 and run[0].consumed_tokens > 9000


def crowded(n=120):
    """The longest item (130 tokens) is under the budget and packs with short ones into 250 tokens, while pairs of
    128-token items fill micro-batches of 256: the planner runs costlier micro-batches before the longest item's."""
    rng = np.random.default_rng(1)
    lengths = [128] * (n // 2) + [60] * (n // 2 - 1) + [130]
    return [lengths[i] for i in rng.permutation(n)]


def fewer_skewed():
    return skewed(150)


def longest_runs_first(steps, lengths):
    """Per epoch's steps (per step, per rank, the Step): where the longest item runs, as (step, rank, micro-batch)."""
    longest = max(lengths)
    return [(k, r, m) for k, step in enumerate(steps) for r, rs in enumerate(step)
            for m, mb in enumerate(rs.microbatches) if any(lengths[i] == longest for i in mb)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("make, kw", [
    (crowded, dict(tokens_per_step=1200)),
    (crowded, dict(sequences_per_step=17, layout="padded")),
    (fewer_skewed, dict(tokens_per_step=[(0, 600), (2000, 2500)])),
    (fewer_skewed, dict(sequences_per_step=[(0, 8), (40, 24)], drop_last=True)),
    (fewer_skewed, dict(rampup=(500, 500, 3000), tokens_per_step=2500)),
    (fewer_skewed, dict(sequences_per_step=12, groups=[(i * 7) % 50 for i in range(150)])),
])
def test_longest_first_runs_the_epochs_longest_item_in_the_first_microbatch_of_the_first_step(world, make, kw):
    lengths = make()
    for epoch in range(2):
        steps = epoch_steps(lengths, world, epoch=epoch, longest_first=True, **kw)
        seen = used(steps)
        assert len(seen) == len(set(seen))
        if not kw.get("drop_last"):
            assert sorted(seen) == list(range(len(lengths)))
        where = longest_runs_first(steps, lengths)
        assert where[0][0] == 0 and where[0][2] == 0  # step 0; on its rank, that step's first micro-batch
        for step in steps:
            assert len({len(rs.microbatches) for rs in step}) == 1
            assert len({(rs.global_tokens, rs.global_loss_tokens, rs.step, rs.consumed_tokens) for rs in step}) == 1
        if "groups" in kw:  # the longest item's whole group is in the first step
            group = kw["groups"][int(np.argmax(lengths))]
            assert {i for i, g in enumerate(kw["groups"]) if g == group} <= set(used(steps[:1]))
        # the crowded lengths: the planner alone runs the longest item's slot later; it moves first on every rank
        if make is crowded:
            sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=B, world_size=world, rank=0,
                                         longest_first=True, **kw)
            members = sampler._epochs.members(epoch, 0)
            raw = planned_rows(sampler.lengths[members].tolist(), sampler._settings)[0]
            lead = int(np.argmax(sampler.lengths[members]))
            slot = next(k for rank in raw for k, mb in enumerate(rank) if mb and lead in mb)
            assert slot > 0 or world > 1
            moved = [[rank[slot], *rank[:slot], *rank[slot + 1:]] for rank in raw]
            assert [rs.microbatches for rs in steps[0]] == [
                [members[mb].tolist() if mb else [] for mb in rank] for rank in moved]


@pytest.mark.parametrize("world", [1, 3])
def test_longest_first_resumes_exactly_and_iter_agrees_with_steps(world):
    lengths = crowded()
    kw = dict(max_tokens_per_microbatch=B, world_size=world, rank=world - 1, seed=2, tokens_per_step=900,
              longest_first=True)
    whole = TokenBudgetSampler(lengths, **kw)
    n = len(whole)
    flat = list(whole)
    assert n == len(flat) and flat == [mb for step in TokenBudgetSampler(lengths, **kw).steps()
                                       for mb in step.microbatches]
    run = list(TokenBudgetSampler(lengths, **kw).steps())
    for stop in (1, 3):
        first = TokenBudgetSampler(lengths, **kw)
        steps = first.steps()
        taken = [next(steps) for _ in range(stop)]
        resumed = TokenBudgetSampler(lengths, **kw)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert taken + list(resumed.steps()) == run
    it = iter(TokenBudgetSampler(lengths, **kw))  # mid-way into the first step, after its first micro-batch
    assert next(it) == run[0].microbatches[0]
    resumed = TokenBudgetSampler(lengths, **kw)
    resumed.load_state_dict(it.state_dict())
    rest = list(resumed.steps())
    assert rest[0].first_microbatch == 1 and rest[0].microbatches == run[0].microbatches[1:]
    assert rest[1:] == run[1:]


def test_longest_first_elastic_resume_mid_first_step_keeps_every_item_once():
    lengths = crowded()
    kw = dict(max_tokens_per_microbatch=B, seed=2, tokens_per_step=1500, longest_first=True)
    before = [TokenBudgetSampler(lengths, world_size=3, rank=r, **kw) for r in range(3)]
    its = [iter(s) for s in before]
    ran = [i for it in its for i in next(it)]  # the first micro-batch of the first step, every rank
    assert max(lengths) in [lengths[i] for i in ran]
    state = its[0].state_dict()
    assert (state["step_in_epoch"], state["microbatch"]) == (0, 1)
    after = [TokenBudgetSampler(lengths, world_size=2, rank=r, **{**kw, "max_tokens_per_microbatch": 2 * B})
             for r in range(2)]
    for s in after:
        s.load_state_dict(state)
    rest = [i for s in after for step in s.steps() for mb in step.microbatches for i in mb]
    assert sorted(ran + rest) == list(range(len(lengths)))


def test_longest_first_is_a_setting_a_resume_must_share_and_a_bool():
    kw = dict(lengths=skewed(), max_tokens_per_microbatch=B, world_size=2, rank=0, tokens_per_step=1000)
    saved = TokenBudgetSampler(**kw, longest_first=True)
    next(saved.steps())
    with pytest.raises(ValueError) as err:
        TokenBudgetSampler(**kw).load_state_dict(saved.state_dict())
    assert "longest_first=True, this sampler has False" in str(err.value) and "\n" not in str(err.value)
    plain = TokenBudgetSampler(**kw)
    next(plain.steps())
    older = plain.state_dict()
    del older["config"]["longest_first"]  # a state saved before the setting existed: saved without it
    resumed = TokenBudgetSampler(**kw)
    resumed.load_state_dict(older)
    assert list(resumed.steps()) == list(TokenBudgetSampler(**kw).steps())[1:]
    with pytest.raises(ValueError, match="longest_first=False, this sampler has True"):
        TokenBudgetSampler(**kw, longest_first=True).load_state_dict(older)
    with pytest.raises(ValueError, match=r"^TokenBudgetSampler: longest_first must be True or False, got 'yes'$"):
        TokenBudgetSampler(**kw, longest_first="yes")
