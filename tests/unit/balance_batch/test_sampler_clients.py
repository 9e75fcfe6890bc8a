"""TokenBudgetSampler where users run it: rank and world size from the initialised process group (and never a silent
rank 0 of 1 under a launcher), an epoch consumed without set_epoch, an elastic resume on another world size and
budget, torchdata's StatefulDataLoader resumed mid-step, accelerate's prepare, and a length that is cheap twice."""

import datetime

import numpy as np
import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader

from balance_batch import TokenBudgetSampler

B = 256


def lengths_of(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(40), 1.1, n)), 2, 3 * B).astype(int).tolist()


KW = dict(max_tokens_per_microbatch=B, tokens_per_step=[(0, 1500), (6000, 3000)], seed=5)


def ranks(world, lengths, **kw):
    return [TokenBudgetSampler(lengths, **{**KW, **kw}, world_size=world, rank=r) for r in range(world)]


def items(step):
    return [i for mb in step.microbatches for i in mb]


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank, in this process."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_world_and_rank_default_to_the_initialised_group_and_a_contradiction_is_one_line(one_rank_group):
    sampler = TokenBudgetSampler(lengths_of(), **KW)
    assert (sampler.world_size, sampler.rank) == (1, 0)
    with pytest.raises(ValueError) as err:
        TokenBudgetSampler(lengths_of(), **KW, world_size=4, rank=1)
    assert "contradict the initialised process group (world size 1, rank 0)" in str(err.value)
    assert "process_group=" in str(err.value) and "\n" not in str(err.value)


def test_a_launched_process_without_a_group_is_refused_not_planned_as_rank_0_of_1(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets in each process it starts
    with pytest.raises(ValueError, match="WORLD_SIZE=2.*init_process_group"):
        TokenBudgetSampler(lengths_of(), **KW)
    assert TokenBudgetSampler(lengths_of(), **KW, world_size=2, rank=1).rank == 1
    with pytest.raises(ValueError, match="rank= is needed with world_size=2"):
        TokenBudgetSampler(lengths_of(), **KW, world_size=2)


@pytest.mark.parametrize("through", ["steps", "iter"])
def test_a_consumed_epoch_moves_on_to_the_next_never_silently_empty(through):
    lengths = lengths_of()
    sampler = TokenBudgetSampler(lengths, **KW)
    reference = TokenBudgetSampler(lengths, **KW)
    epochs = []
    for epoch in range(3):  # no set_epoch: each pass is the next epoch, as set_epoch(epoch) would give
        reference.set_epoch(epoch)
        expected = [mb for step in reference.steps() for mb in step.microbatches]
        if through == "steps":
            got = [mb for step in sampler.steps() for mb in step.microbatches]
        else:
            n = len(sampler)
            got = list(sampler)
            assert n == len(got)
        assert got == expected and sorted(i for mb in got for i in mb) == list(range(len(lengths)))
        epochs.append(got)
    assert epochs[0] != epochs[1] and sampler.epoch == 2


def test_elastic_resume_from_4_ranks_at_4096_to_8_ranks_at_8192_keeps_every_item_once():
    lengths = lengths_of(3000, seed=1)
    kw = dict(max_tokens_per_microbatch=4096, tokens_per_step=[(0, 20000), (100000, 40000)], seed=2)
    before = [TokenBudgetSampler(lengths, **kw, world_size=4, rank=r) for r in range(4)]
    iters = [s.steps() for s in before]
    taken = []
    for _ in range(4):
        for it in iters:
            taken += items(next(it))
    state = before[0].state_dict()
    assert state["config"]["world_size"] == 4
    after = [TokenBudgetSampler(lengths, **{**kw, "max_tokens_per_microbatch": 8192}, world_size=8, rank=r)
             for r in range(8)]
    for s in after:
        s.load_state_dict(state)
    rest = [list(s.steps()) for s in after]
    assert len({len(r) for r in rest}) == 1  # every rank resumes at the same step
    for per_rank in zip(*rest):
        assert len({len(s.microbatches) for s in per_rank}) == 1
        for s in per_rank:
            assert all(sum(lengths[i] for i in mb) <= 8192 or len(mb) == 1 for mb in s.microbatches)
    rest_items = [i for r in rest for s in r for i in items(s)]
    assert sorted(taken + rest_items) == list(range(len(lengths)))
    # the remaining steps hold exactly the items the uninterrupted run's steps held
    whole = [list(s.steps()) for s in ranks(4, lengths, **kw)]
    expected = [sorted(i for r in range(4) for i in items(whole[r][k])) for k in range(4, len(whole[0]))]
    got = [sorted(i for r in range(8) for i in items(rest[r][k])) for k in range(len(rest[0]))]
    assert got == expected


def test_elastic_resume_mid_step_runs_the_rest_of_that_step_once():
    lengths = lengths_of(600, seed=3)
    before = ranks(4, lengths)
    its = [iter(s) for s in before]
    for _ in range(5):  # every rank hands out 5 micro-batches: mid-way into some step
        handed = [next(it) for it in its]
    state = its[0].state_dict()
    assert state["microbatch"] > 0 or state["step_in_epoch"] > 0
    taken = [i for s in before for step_i in range(state["step_in_epoch"]) for i in items(s.plan(step_i))]
    taken += [i for s in before for mb in s.plan(state["step_in_epoch"]).microbatches[:state["microbatch"]]
              for i in mb]
    after = ranks(2, lengths, max_tokens_per_microbatch=2 * B)
    for s in after:
        s.load_state_dict(state)
    rest = [[mb for step in s.steps() for mb in step.microbatches] for s in after]
    assert sorted(taken + [i for r in rest for mb in r for i in mb]) == list(range(len(lengths)))
    assert handed  # (each rank's fifth micro-batch was handed out before the state)


def test_len_plans_each_step_once_and_a_second_call_costs_nothing():
    lengths = lengths_of(20000, seed=4)
    sampler = TokenBudgetSampler(lengths, **KW, world_size=8, rank=3)
    calls = []
    plan = sampler._plans.rows
    sampler._plans.rows = lambda *a: calls.append(1) or plan(*a)
    n = len(sampler)
    first = len(calls)
    assert first == sampler.steps_in_epoch
    assert len(sampler) == n and len(calls) == first  # the counts are kept
    assert n == sum(len(step.microbatches) for step in sampler.steps())


def test_accelerates_prepare_would_reshard_the_plan_and_is_refused_in_one_line():
    from accelerate.data_loader import prepare_data_loader

    lengths = lengths_of()
    sampler = TokenBudgetSampler(lengths, **KW, world_size=2, rank=0)
    with pytest.raises(ValueError) as err:
        prepare_data_loader(DataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=list),
                            num_processes=2, process_index=0, put_on_device=False)
    assert "send_to_device" in str(err.value) and "\n" not in str(err.value)
    single = TokenBudgetSampler(lengths, **KW)  # one process: prepare leaves the batch sampler's plan as it is
    loader = prepare_data_loader(DataLoader(range(len(lengths)), batch_sampler=single, collate_fn=list),
                                 num_processes=1, process_index=0, put_on_device=False)
    assert list(loader) == [mb for step in TokenBudgetSampler(lengths, **KW).steps() for mb in step.microbatches]


def _pairs(sampler, loader, epochs=2):
    """(step, micro-batch planned, micro-batch the loader handed) over ``epochs`` of the docs' loop."""
    out = []
    for _ in range(epochs):
        batches = loader()
        for step in sampler.steps():
            out += [(step.step, mb, next(batches)) for mb in step.microbatches]
    return out


def test_a_loader_started_lazily_trains_each_steps_own_microbatches():
    """The docs' loop with a loader whose iterator starts at its first ``next`` (accelerate's prepared loader on one
    process, a user's generator around a DataLoader), after ``steps()`` has yielded the step: each step's own
    micro-batches, over two epochs."""
    from accelerate.data_loader import prepare_data_loader

    lengths = lengths_of()
    sampler = TokenBudgetSampler(lengths, **KW)
    prepared = prepare_data_loader(DataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=list),
                                   num_processes=1, process_index=0, put_on_device=False)

    def wrapped():
        yield from DataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=list)

    for loader in (lambda: iter(prepared), wrapped):
        sampler.set_epoch(0)
        pairs = _pairs(sampler, loader)
        assert len({s for s, _, _ in pairs}) == sampler.steps_before(2) > 2
        assert all(planned == handed for _, planned, handed in pairs)


def test_a_loader_behind_steps_is_stopped_in_one_line():
    lengths = lengths_of()
    for late in (False, True):
        sampler = TokenBudgetSampler(lengths, **KW)
        batches = iter(DataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=list))  # started at once
        with pytest.raises(ValueError) as err:
            for step in sampler.steps():
                if late and step.step == 0:
                    continue  # step 0 taken without its data
                for _ in step.microbatches[1:]:  # one micro-batch short each step
                    next(batches)
        assert "behind steps()" in str(err.value) and "\n" not in str(err.value)


def test_torchdatas_stateful_dataloader_resumes_mid_step_at_that_microbatch():
    from tests.stateful_loader import check_mid_step_resume

    check_mid_step_resume(workers=0)
