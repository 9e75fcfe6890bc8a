"""The loss's absolute scale, pinned by an oracle outside the harness: a plain forward per example, summed by hand.

Comparing backends with each other cannot catch a normalisation bug they share
(they run the same step code); this compares each pass with tests/loss_oracle.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backends.messages import make_command
from backends.pytorch import PyTorchBackend
from backends.specs import BackendSpec, ModelSpec
from tests.loss_oracle import oracle, plain_model, tiny_examples

EXAMPLES = tiny_examples()

# (mtpm, mbs, options): one example per micro-batch, all in one, budgets that group some, packed rows, balanced.
GROUPINGS = {
    "mbs=1": (None, 1, {}),
    "all in one": (None, len(EXAMPLES), {}),
    "mtpm=28": (28, 1, {}),
    "mtpm=30 packed": (30, 1, {"layout": "packed"}),
    "mtpm=30 balanced": (30, 1, {"planner": "balanced"}),
    # a cap of 2 sequences splits rows that would hold 3 or more
    "mtpm=30 balanced packed ≤2 seqs": (
        30,
        1,
        {"planner": "balanced", "layout": "packed", "max_seqs_per_microbatch": 2},
    ),
}


@pytest.fixture(scope="module")
def backend():
    b = PyTorchBackend(BackendSpec(device="cpu"), ModelSpec())
    yield b
    b.close()


@pytest.fixture(scope="module")
def expected():
    return oracle(EXAMPLES, plain_model())


def test_the_oracle_model_is_the_model_the_backends_build(backend):
    ours = dict(backend.model.named_parameters())
    plain = dict(plain_model().named_parameters())
    assert ours.keys() == plain.keys()
    for name, p in plain.items():
        assert torch.equal(p, ours[name]), name
        assert p.requires_grad == ours[name].requires_grad, name


def test_the_oracle_divides_by_the_whole_batch_weight(expected):
    # the hand computation itself: the batch loss is the weighted sum over all tokens / all weights
    assert expected["total_weight"] == pytest.approx(sum(float(e.weights.sum()) for e in EXAMPLES))
    assert expected["loss"] == pytest.approx(sum(expected["losses"]) / expected["total_weight"])
    assert len({len(e) for e in EXAMPLES}) == len(EXAMPLES) and expected["grad_norm"] > 0


@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_each_grouping_reports_the_oracles_losses_and_gradient(backend, expected, grouping):
    mtpm, mbs, options = GROUPINGS[grouping]
    result = backend.run_pass(make_command("forward_backward", EXAMPLES, mtpm, mbs, **options))
    if grouping != "mbs=1":
        assert max(len(b) for b in _microbatches(result.plan, mtpm, mbs, options)) > 1  # grouping really happened
    cap = options.get("max_seqs_per_microbatch")
    assert (
        result.plan["max_microbatch_size"] <= (cap or len(EXAMPLES)) and result.plan["max_seqs_per_microbatch"] == cap
    )
    for i, out in enumerate(result.outputs):
        np.testing.assert_allclose(out.logprobs, expected["logprobs"][i], rtol=1e-4, atol=1e-5)
        assert out.loss == pytest.approx(expected["losses"][i], rel=1e-4)
    assert result.grad_norm == pytest.approx(expected["grad_norm"], rel=1e-4)
    grads = {n: p.grad for n, p in backend.model.named_parameters() if p.requires_grad}
    assert grads.keys() == expected["grads"].keys()
    for name, g in expected["grads"].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-7, msg=name)


def _microbatches(plan: dict, mtpm, mbs, options) -> list[list[int]]:
    from balance_batch import plan_step

    lengths = [len(e) for e in EXAMPLES]
    settings = {"layout": "padded", "planner": "greedy", **options}  # make_command's defaults, then the grouping's
    plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=mtpm, micro_batch_size=mbs, lockstep=False,
                     **settings)
    return [b for s in plan.schedules for b in s if b is not None]


def test_a_token_count_normalisation_would_be_caught(expected):
    """The oracle tells the batch weight from the usual wrong divisors: per-example token counts or weights."""
    per_token = sum(loss / len(e) for loss, e in zip(expected["losses"], EXAMPLES))
    per_example_weight = sum(loss / float(e.weights.sum()) for loss, e in zip(expected["losses"], EXAMPLES))
    for wrong in (per_token, per_example_weight, sum(expected["losses"]) / sum(len(e) for e in EXAMPLES)):
        assert not math.isclose(wrong, expected["loss"], rel_tol=1e-3)
