"""Sampler states saved by the code before the sampler was split in three parts (commit 93125ce: mid-step as a
StatefulDataLoader saves it, after whole steps, re-planned after an elastic resume, and a version-1 state) load
today and train exactly what that code trained after loading them."""

import json
from pathlib import Path

import pytest

from balance_batch import TokenBudgetSampler

SAVED = json.loads((Path(__file__).parent / "sampler_states_93125ce.json").read_text())


@pytest.mark.parametrize("case", SAVED["cases"], ids=lambda c: f"{c['name']}-w{c['sampler']['world_size']}")
def test_a_state_saved_before_the_split_resumes_exactly(case):
    assert case["state"]["version"] in (1, 2)
    for rank, trained in enumerate(case["trained"]):
        sampler = TokenBudgetSampler(SAVED["lengths"], rank=rank, **case["sampler"])
        sampler.load_state_dict(case["state"])
        got = [[s.step, s.first_microbatch, s.global_loss_tokens, s.microbatches] for s in sampler.steps()][:4]
        assert got == trained, f"rank {rank}"
