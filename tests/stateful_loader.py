"""One check shared by the unit (no workers) and integration (worker processes) tiers: torchdata's StatefulDataLoader
over TokenBudgetSampler, its state taken mid-step and resumed by a new loader and sampler, equals the uninterrupted
run, micro-batch for micro-batch, across the epoch's end into the next one."""

import pickle

from torchdata.stateful_dataloader import StatefulDataLoader

from balance_batch import TokenBudgetSampler

LENGTHS = [(13 * i) % 97 + 2 for i in range(240)]
KW = dict(max_tokens_per_microbatch=128, tokens_per_step=[(0, 900), (4000, 1800)], world_size=2, rank=1, seed=4)


def loader(workers: int):
    sampler = TokenBudgetSampler(LENGTHS, **KW)
    return sampler, StatefulDataLoader(range(len(LENGTHS)), batch_sampler=sampler, collate_fn=list,
                                       num_workers=workers)


def check_mid_step_resume(workers: int) -> None:
    sampler, whole = loader(workers)
    run = [list(whole), list(whole)]  # two epochs, no set_epoch: the second pass is epoch 1
    plan = TokenBudgetSampler(LENGTHS, **KW)
    counts = [len(step.microbatches) for step in plan.steps()]
    step = next(k for k, c in enumerate(counts) if c >= 3 and k > 0)  # a step of 3 micro-batches or more
    taken = sum(counts[:step]) + 2  # two of its micro-batches handed out to the loop
    _, first = loader(workers)
    batches = iter(first)
    got = [next(batches) for _ in range(taken)]
    state = pickle.loads(pickle.dumps(first.state_dict()))  # as a checkpoint keeps it
    del batches, first
    resumed_sampler, resumed = loader(workers)
    resumed.load_state_dict(state)
    batches = iter(resumed)
    steps = list(resumed_sampler.steps())  # the loop's step structure follows the loader's position
    partial = steps[0]
    assert (partial.step, partial.first_microbatch) == (step, 2)
    assert len(partial.microbatches) == counts[step] - 2
    rest = list(batches)
    assert got + rest == run[0]
    assert rest == [mb for s in steps for mb in s.microbatches]
    assert list(resumed) == run[1]  # and on into the next epoch
    assert sorted(i for mb in run[1] for i in mb) != list(range(len(LENGTHS)))  # rank 1's part, not everything
