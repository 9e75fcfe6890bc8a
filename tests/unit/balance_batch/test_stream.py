"""``TokenBudgetStream`` on one rank, with no process group (in-process; three torchrun ranks are in
tests/integration/balance_batch/test_stream.py): steps cut as the sampler cuts them (tokens, sequences, a ramp), every
item trained once within the budget, exact resume from a generator, a stateful source and a ``StatefulDataLoader``,
and each bad input refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from balance_batch.stream import StreamError, TokenBudgetStream
from tests.stream_sources import Shard

BUDGET = 512


def rows(n: int = 120, seed: int = 0) -> list[dict]:
    lengths = np.random.default_rng(seed).integers(1, 700, n)  # some over the budget
    return [{"id": i, "input_ids": [5] * int(k)} for i, k in enumerate(lengths)]


def stream(source=None, **kwargs) -> TokenBudgetStream:
    settings = dict(max_tokens_per_microbatch=BUDGET, tokens_per_step=2000, world_size=1, rank=0, buffer_size=16)
    settings.update(kwargs)
    return TokenBudgetStream(iter(rows()) if source is None else source, **settings)


def ids(step) -> list[list[int]]:
    return [[item["id"] for item in mb] for mb in step.microbatches]


def test_every_item_once_within_the_budget_in_steps_of_the_token_size():
    steps = list(stream())
    trained = [i for s in steps for mb in ids(s) for i in mb]
    assert sorted(trained) == list(range(120))
    length = {r["id"]: len(r["input_ids"]) for r in rows()}
    for s in steps:
        tokens = sum(length[i] for mb in ids(s) for i in mb)
        assert s.global_tokens == tokens and s.global_loss_tokens == tokens - sum(len(mb) for mb in ids(s))
        assert tokens <= 2000 or sum(len(mb) for mb in ids(s)) == 1
        assert all(sum(length[i] for i in mb) <= BUDGET or len(mb) == 1 for mb in ids(s))
    assert [s.step for s in steps] == list(range(len(steps)))
    assert [s.consumed_tokens for s in steps[1:]] == list(np.cumsum([s.global_tokens for s in steps])[:-1])


def test_steps_in_sequences_follow_a_ramp_and_a_step_takes_what_fits():
    steps = list(stream(sequences_per_step=[(0, 4), (20, 8)], tokens_per_step=None))
    counts = [sum(len(mb) for mb in s.microbatches) for s in steps]
    assert counts[:5] == [4] * 5 and set(counts[5:-1]) == {8} and sum(counts) == 120
    # a token step holds drawn items until the next would pass the size: with a buffer of all, every step but the
    # last is full to within one item
    one = list(stream(buffer_size=1000, tokens_per_step=3000))
    assert all(s.global_tokens > 3000 - 700 for s in one[:-1])


def test_labels_set_the_loss_tokens_and_an_item_of_no_tokens_is_placed_nowhere():
    source = [{"id": 0, "input_ids": [1] * 6, "labels": [-100] * 3 + [1] * 3}, {"id": 1, "input_ids": []},
              {"id": 2, "input_ids": [1] * 4}]
    steps = list(stream(source, tokens_per_step=100))
    assert sorted(i for s in steps for mb in ids(s) for i in mb) == [0, 2]
    assert sum(s.global_loss_tokens for s in steps) == 3 + 3


@pytest.mark.parametrize("make_source", [lambda r: (x for x in r), Shard], ids=["generator", "state_dict"])
def test_a_restart_from_the_state_after_step_k_trains_what_the_run_trained_after_it(make_source):
    whole = stream(make_source(rows()))
    steps = []
    for s in whole:
        steps.append(ids(s))
        if s.step == 3:
            state = whole.state_dict()
    resumed = stream(make_source(rows()))
    resumed.load_state_dict(state)
    assert [ids(s) for s in resumed] == steps[4:]
    assert whole.state_dict()["ended"] and list(whole) == []


def test_a_stateful_dataloader_resumes_the_stream_at_its_saved_step():
    """The stream itself (a torch IterableDataset once torch is imported) and ``StreamSteps`` (collated)."""
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from balance_batch.collate import pack_collate
    from balance_batch.data import StreamSteps

    for wrap in (lambda s: s, StreamSteps):
        first, steps = StatefulDataLoader(wrap(stream()), batch_size=None), []
        for k, s in enumerate(first):
            steps.append(ids(s))
            if k == 2:
                state = first.state_dict()
        again = StatefulDataLoader(wrap(stream()), batch_size=None)
        again.load_state_dict(state)
        assert [ids(s) for s in again] == steps[3:]
    collated = next(iter(DataLoader(StreamSteps(stream(), collate_fn=pack_collate), batch_size=None)))
    assert collated.microbatches[0]["input_ids"].shape[0] == 1  # one packed row per micro-batch
    workers = iter(DataLoader(stream(), batch_size=None, num_workers=1))
    try:
        with pytest.raises(ValueError, match="read in a loader worker, but its steps are planned with collectives"):
            next(workers)
    finally:  # at once: left to the garbage collector, torch waits 5 s for a worker that raised to exit
        workers._shutdown_workers()


def test_a_state_decides_its_steps_budget_may_change_but_not_seed_or_step_size():
    whole = stream()
    next(iter(whole))
    state = whole.state_dict()
    other = stream(max_tokens_per_microbatch=1024)
    other.load_state_dict(state)  # another budget: the same items in each step, planned anew
    assert next(iter(other)).step == 1
    for change, key in (({"seed": 1}, "seed=0, this stream has 1"), ({"tokens_per_step": 3000}, "tokens_per_step"),
                        ({"buffer_size": 8}, "buffer_size=16, this stream has 8")):
        with pytest.raises(ValueError, match=key) as refused:
            stream(**change).load_state_dict(state)
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="not a stream state"):
        stream().load_state_dict({"version": 2})
    with pytest.raises(ValueError, match="saved from a source without a state_dict; this one has one"):
        stream(Shard(rows())).load_state_dict(state)


def _raises(item):
    raise KeyError("text")


@pytest.mark.parametrize("kwargs, message", [
    ({"source": 5}, "source must be an iterable of items (a datasets.IterableDataset, a generator, a list), got int"),
    ({"source": "text"}, "source must be an iterable of items"),
    ({"length": _raises}, "length or loss_tokens raised KeyError: 'text' on item 0 of this rank's source"),
    ({"length": lambda item: 3.5}, "length returned 3.5 for item 0 of this rank's source; it must return an integer"),
    ({"length": lambda item: -1}, "length returned -1 for item 0 of this rank's source; it must be 0 or more"),
    ({"loss_tokens": lambda item: 10_000}, "loss_tokens returned 10000 for item 0 of this rank's source"),
    ({"source": [[1, 2]]}, "an item has no input_ids (list); give length="),
    ({"buffer_size": 0}, "buffer_size must be a positive integer, got 0"),
    ({"world_size": 2, "rank": 1}, "world_size=2 needs an initialised torch.distributed process group"),
    ({"tokens_per_step": None}, "give exactly one of sequences_per_step and tokens_per_step"),
    ({"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch must be a positive integer"),
])
def test_bad_input_is_one_line(kwargs, message):
    with pytest.raises(ValueError) as refused:
        list(stream(**kwargs))
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).startswith("TokenBudgetStream")


def test_a_wrong_type_is_also_a_type_error():
    with pytest.raises(TypeError):
        stream(5)
    assert issubclass(StreamError, ValueError)
