"""The examples in the public entries' docstrings run and print what they say (doctest, in-process)."""

import doctest

import pytest

import balance_batch
from balance_batch import collate, corpus, data, plan, sampler, stream
from balance_batch.integrations.transformers import trainer

ENTRIES = [plan.plan_step, sampler.TokenBudgetSampler, corpus.pack, collate.pack_collate, collate.pad_collate,
           data.PackedDataset, stream.TokenBudgetStream, trainer.TokenBudgetTrainer]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__qualname__)
def test_the_docstrings_example_runs_as_written(entry):
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(entry, globs=vars(balance_batch)) if t.examples]
    assert tests, f"{entry.__qualname__} has no example"
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{entry.__qualname__}'s example does not print what it says"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__qualname__)
def test_the_docstring_says_args_returns_and_raises(entry):
    doc = entry.__doc__
    assert all(f"\n    {part}:" in doc for part in ("Args", "Raises", "Example")), doc[:200]
    assert "Returns:" in doc or "Yields:" in doc or isinstance(entry, type)  # a class returns itself
