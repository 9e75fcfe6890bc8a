"""The examples in the public entries' docstrings run and print what they say (doctest, in-process)."""

import doctest
import importlib

import pytest

import balance_batch

# Named, imported by the test that reads them: the Trainer's module imports transformers' Trainer (and with it peft),
# seconds that every pytest worker would pay at collection.
ENTRIES = ["plan.plan_step", "sampler.TokenBudgetSampler", "corpus.pack", "collate.pack_collate",
           "collate.pad_collate", "data.PackedDataset", "stream.TokenBudgetStream",
           "integrations.transformers.trainer.TokenBudgetTrainer"]


def entry_of(name: str):
    module, attribute = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"balance_batch.{module}"), attribute)


@pytest.mark.parametrize("name", ENTRIES, ids=lambda name: name.rsplit(".", 1)[1])
def test_the_docstrings_example_runs_as_written(name):
    entry = entry_of(name)
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(entry, globs=vars(balance_batch)) if t.examples]
    assert tests, f"{entry.__qualname__} has no example"
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{entry.__qualname__}'s example does not print what it says"


@pytest.mark.parametrize("name", ENTRIES, ids=lambda name: name.rsplit(".", 1)[1])
def test_the_docstring_says_args_returns_and_raises(name):
    entry = entry_of(name)
    doc = entry.__doc__
    assert all(f"\n    {part}:" in doc for part in ("Args", "Raises", "Example")), doc[:200]
    assert "Returns:" in doc or "Yields:" in doc or isinstance(entry, type)  # a class returns itself
