"""``TokenBudgetStream`` on three torchrun ranks (gloo) with uneven shards, one of them empty: every item trained
once, the same micro-batch count on every rank at every step, each micro-batch within the budget, each step's
modeled cost balanced over the ranks as the map-style sampler balances the same lengths, and a restart from the
state after step k training what the uninterrupted run trained after it; and one rank's bad item raised on every
rank, none left waiting in a collective."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from balance_batch import TokenBudgetSampler
from balance_batch.cost import CostModel
from tests.conftest import harness_env

pytestmark = pytest.mark.integration
RANKS = Path(__file__).with_name("stream_ranks.py")
RESUME_AFTER = 4


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("stream") / "run.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", str(RANKS),
               "--out", str(out), "--resume-after", str(RESUME_AFTER)]
    proc = subprocess.run(command, env=harness_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _cost(lengths, a: float, b: float) -> float:
    return sum(a * n + b * n * n for n in lengths)


def test_every_item_once_equal_counts_within_budget(stream_run):
    ranks, budget = stream_run["ranks"], stream_run["budget"]
    trained = [i for r in ranks for s in r["full"] for mb in s["mbs"] for i in mb]
    every = [i for shard in stream_run["shards"] for i in shard]
    assert len(trained) == len(set(trained)) and sorted(trained) == sorted(every)
    assert stream_run["shards"][2] == []  # rank 2's source was empty from the start, and it ran every step
    assert len({len(r["full"]) for r in ranks}) == 1
    for steps in zip(*(r["full"] for r in ranks)):
        assert len({len(s["mbs"]) for s in steps}) == 1  # the same count on every rank
        assert len({(s["step"], s["tokens"], s["loss"]) for s in steps}) == 1
        assert sum(n for s in steps for mb in s["lens"] for n in mb) == steps[0]["tokens"]
        for s in steps:
            for mb in s["lens"]:
                assert sum(mb) <= budget or len(mb) == 1


def test_each_step_balanced_as_the_sampler_balances_its_lengths(stream_run):
    """Per step, the slowest rank's modeled cost over the mean; the same lengths through the map-style sampler."""
    ranks, budget = stream_run["ranks"], stream_run["budget"]
    a, b = stream_run["cost"]
    cost = CostModel(a, b, "tokens plus attention")
    for steps in zip(*(r["full"] for r in ranks)):
        per_rank = [_cost([n for mb in s["lens"] for n in mb], a, b) for s in steps]
        lengths = [n for s in steps for mb in s["lens"] for n in mb]
        sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=budget, sequences_per_step=len(lengths),
                                     world_size=3, rank=0, shuffle=False, cost_model=cost)
        plan = sampler.plan(0)
        ideal = [_cost([lengths[i] for mb in TokenBudgetSampler(
            lengths, max_tokens_per_microbatch=budget, sequences_per_step=len(lengths), world_size=3, rank=r,
            shuffle=False, cost_model=cost).plan(0).microbatches for i in mb], a, b) for r in range(3)]
        assert plan.global_tokens == sum(lengths)
        assert max(per_rank) / np.mean(per_rank) <= max(ideal) / np.mean(ideal) * 1.01


def test_a_restart_after_step_k_trains_what_the_run_trained_after_it(stream_run):
    for r in stream_run["ranks"]:
        after = [s for s in r["full"] if s["step"] > RESUME_AFTER]
        assert after and r["rest"] == after


def test_one_ranks_bad_item_is_raised_on_every_rank_in_one_line(tmp_path):
    out = tmp_path / "failed"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", str(RANKS),
               "--out", str(out), "--fail-at", "150", "--items", "200"]
    proc = subprocess.run(command, env=harness_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = {(tmp_path / f"failed.rank{r}").read_text() for r in range(3)}
    assert said == {("rank 1: TokenBudgetStream: length or loss_tokens raised KeyError: 'no tokens' on item 150 of "
                    "this rank's source")}
