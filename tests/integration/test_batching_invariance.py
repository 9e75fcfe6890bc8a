"""Batching must not change the answer: per-example losses and the gradient are the same for any mbs and mtpm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backends.messages import make_command
from backends.model.step import grad_norm_local_sq, run_schedule, total_loss_weight
from backends.pytorch import PyTorchBackend
from backends.specs import BackendSpec, ModelSpec
from balance_batch import plan_step
from harness.data.workload import make_examples, mixed_lengths
from tests.loss_oracle import oracle, tiny_examples

LENGTHS = mixed_lengths(16, 64, 512, 42)


@pytest.fixture(scope="module")
def backend():
    b = PyTorchBackend(BackendSpec(device="cpu"), ModelSpec())
    yield b
    b.close()


@pytest.fixture(scope="module")
def examples():
    return make_examples(LENGTHS, 2048, seed=0)


def _run(backend, examples, pass_type, mtpm, mbs, **extra):
    """``extra``: make_command's options (layout, planner) or command keys (logprob_chunk_tokens)."""
    options = {k: extra.pop(k) for k in ("layout", "planner") if k in extra}
    return backend.run_pass(make_command(pass_type, examples, mtpm, mbs, **options, **extra))


@pytest.fixture(scope="module")
def reference(backend, examples):
    return _run(backend, examples, "forward_backward", None, 1)


@pytest.mark.parametrize("mtpm, mbs", [(None, 3), (600, 1), (600, 3), (100_000, 1), (100_000, 3), (1, 1)])
def test_losses_and_gradient_do_not_depend_on_grouping(backend, examples, reference, mtpm, mbs):
    result = _run(backend, examples, "forward_backward", mtpm, mbs)
    ref_loss = np.array([o.loss for o in reference.outputs])
    loss = np.array([o.loss for o in result.outputs])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert math.isclose(result.grad_norm, reference.grad_norm, rel_tol=1e-5)
    for o, r in zip(result.outputs, reference.outputs):
        np.testing.assert_allclose(o.logprobs, r.logprobs, rtol=1e-4, atol=1e-5)


PLANS = [(planner, layout) for planner in ("greedy", "balanced") for layout in ("padded", "packed")
         if (planner, layout) != ("greedy", "padded")]


@pytest.mark.parametrize("planner, layout", PLANS)
@pytest.mark.parametrize("mtpm", [300, 600, 100_000])
def test_the_balanced_planner_and_packed_layout_give_the_same_answer(
    backend, examples, reference, mtpm, planner, layout
):
    result = _run(backend, examples, "forward_backward", mtpm, 1, planner=planner, layout=layout)
    assert (result.plan["planner"], result.plan["layout"]) == (planner, layout)
    if layout == "packed":
        # Rows of several sequences end to end, no pads: a boundary leak would change later sequences' losses.
        assert result.plan["pad_efficiency"] == 1.0
        assert result.plan["max_microbatch_size"] > 1 or mtpm < 600
    np.testing.assert_allclose([o.loss for o in result.outputs], [o.loss for o in reference.outputs], rtol=1e-5)
    assert math.isclose(result.grad_norm, reference.grad_norm, rel_tol=1e-5)
    for o, r in zip(result.outputs, reference.outputs):
        np.testing.assert_allclose(o.logprobs, r.logprobs, rtol=1e-4, atol=1e-5)
@pytest.fixture(scope="module")
def unchunked(backend, examples):
    """Full logits, then log-softmax: the reference for the chunked log-probs the backends run by default."""
    assert backend.spec.logprob_chunk_tokens is not None
    return _run(backend, examples, "forward_backward", 600, 3, logprob_chunk_tokens=None)


@pytest.mark.parametrize("chunk", [100, 1000, 100_000])  # under most rows, divides no micro-batch, all at once
def test_chunked_logprobs_change_nothing(backend, examples, unchunked, chunk):
    chunked = _run(backend, examples, "forward_backward", 600, 3, logprob_chunk_tokens=chunk)
    np.testing.assert_allclose([o.loss for o in chunked.outputs], [o.loss for o in unchunked.outputs], rtol=1e-5)
    assert math.isclose(chunked.grad_norm, unchunked.grad_norm, rel_tol=1e-5)
    for o, r in zip(chunked.outputs, unchunked.outputs):
        np.testing.assert_allclose(o.logprobs, r.logprobs, rtol=1e-5, atol=1e-6)


def test_grouping_really_differs_between_cases(backend, examples):
    small = _run(backend, examples, "forward", 600, 1).plan
    huge = _run(backend, examples, "forward", 100_000, 1).plan
    fixed3 = _run(backend, examples, "forward", None, 3).plan
    assert small["n_microbatches"] != huge["n_microbatches"] != fixed3["n_microbatches"]
    assert huge["n_microbatches"] == [1]
    assert huge["pad_efficiency"] < small["pad_efficiency"]


def test_outputs_come_back_in_request_order(backend, examples, reference):
    """By content: examples of equal lengths, each output equal to that example's own plain forward."""
    same_lengths = tiny_examples(lengths=(6, 9, 6, 9, 6, 12, 9))
    expected = oracle(same_lengths)["logprobs"]
    for mtpm, mbs, layout in ((None, 1, "padded"), (20, 1, "padded"), (None, 3, "padded"), (30, 1, "packed")):
        got = _run(backend, same_lengths, "forward", mtpm, mbs, layout=layout).outputs
        for i, out in enumerate(got):
            np.testing.assert_allclose(out.logprobs, expected[i], rtol=1e-4, atol=1e-5, err_msg=f"example {i}")
    fwd = _run(backend, examples, "forward", 600, 3)
    for ex, out in zip(examples, fwd.outputs):
        assert out.logprobs.shape == (len(ex),)
        assert math.isclose(out.loss, -float((out.logprobs * ex.weights).sum()), rel_tol=1e-5)
    # forward alone gives the same losses as forward_backward
    np.testing.assert_allclose([o.loss for o in fwd.outputs], [o.loss for o in reference.outputs], rtol=1e-5)


def test_gradient_is_normalised_by_the_whole_batch_weight(backend, examples, reference):
    # Doubling the batch (each example twice) keeps the normalised gradient the same:
    # the loss is divided by the total weight of all examples, not per micro-batch.
    doubled = _run(backend, list(examples) + list(examples), "forward_backward", 700, 2)
    assert math.isclose(doubled.grad_norm, reference.grad_norm, rel_tol=1e-5)
    assert reference.grad_norm > 0


def _grad_norm_normalised_per_microbatch(backend, examples, mtpm, mbs, divisor) -> float:
    """The bug public trainers shipped, run with the real step: each micro-batch divided by its own ``divisor``."""
    lengths = [len(e) for e in examples]
    backend.model.zero_grad(set_to_none=True)
    plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=mtpm, micro_batch_size=mbs, layout="padded",
                     planner="greedy", lockstep=False)
    for batch in plan.schedules[0]:
        run_schedule(backend.model, examples, [batch], "forward_backward", divisor(batch), torch.device("cpu"))
    return math.sqrt(grad_norm_local_sq(backend.model))


@pytest.mark.parametrize("divisor", ["micro-batch weight", "micro-batch tokens"])
def test_a_broken_normalisation_would_be_caught(backend, examples, reference, divisor):
    """The grouping tests above can fail: a per-micro-batch normalisation breaks exactly their assertion."""
    per_batch = {
        "micro-batch weight": lambda batch: total_loss_weight(examples, batch),
        "micro-batch tokens": lambda batch: float(sum(len(examples[i]) for i in batch)),
    }[divisor]
    norms = {(mtpm, mbs): _grad_norm_normalised_per_microbatch(backend, examples, mtpm, mbs, per_batch)
             for mtpm, mbs in [(None, 1), (600, 3)]}  # several micro-batches: one holding all would hide it
    for norm in norms.values():  # what test_losses_and_gradient_do_not_depend_on_grouping asserts, and it fails
        assert not math.isclose(norm, reference.grad_norm, rel_tol=1e-5)
    assert not math.isclose(norms[None, 1], norms[600, 3], rel_tol=1e-5)
    # and the same step with the whole batch's weight is the reference: the divisor is the only difference
    right = _grad_norm_normalised_per_microbatch(backend, examples, 600, 3, lambda batch: total_loss_weight(examples))
    assert math.isclose(right, reference.grad_norm, rel_tol=1e-5)


def test_trainable_parameters_are_lora_only(backend):
    names = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert torch.get_default_dtype() == torch.float32
