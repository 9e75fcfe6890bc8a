"""``TokenBudgetTrainer`` on a ``TokenBudgetStream`` (``max_steps`` of its steps): it trains the weights a plain loop
over the same stream trains, bit for bit, and a checkpoint resumes at the next step with the same items and
weights; a stream without ``max_steps``, a stream with a sampler and neither are refused in one line. In-process,
bf16, the runs' tiny Llama (tests/trainer_runs.py) on 24 short items streamed from a generator."""

from __future__ import annotations

import pytest
import torch

from balance_batch.collate import pack_collate
from balance_batch.stream import TokenBudgetStream
from tests.trainer_runs import LR, MTPM, Recorder, items, make_sampler, tiny_llama, training_args

pytestmark = pytest.mark.integration
MAX_STEPS = 6


def stream() -> TokenBudgetStream:
    """The runs' items with ids, read from a generator (resumed by the count read), 40 tokens a step."""
    rows = [{"id": i, **item} for i, item in enumerate(items())]
    return TokenBudgetStream((row for row in rows), max_tokens_per_microbatch=MTPM, tokens_per_step=40, seed=3,
                             buffer_size=8)


def bf16_llama():
    return tiny_llama().to(torch.bfloat16)


def train(out, resume=None, **overrides) -> dict:
    from balance_batch.integrations.transformers import TokenBudgetTrainer

    args = training_args(str(out), max_steps=MAX_STEPS, save_steps=3, bf16=True, **overrides)
    model = bf16_llama()
    trainer = TokenBudgetTrainer(model=model, args=args, train_dataset=stream())
    recorder = Recorder(trainer)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    steps = [(s, [item["id"] for item in ids], loss) for s, ids, loss in recorder.steps]
    return {"steps": steps, "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "global_step": trainer.state.global_step}


def plain_loop() -> dict:
    """The stream's first MAX_STEPS steps as a plain loop: each micro-batch's summed loss over the step's loss
    tokens, SGD at the linear schedule's rate."""
    model, steps = bf16_llama(), []
    for step in stream():
        for mb in step.microbatches:
            model(**pack_collate(mb), num_items_in_batch=step.global_loss_tokens).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR * (1 - len(steps) / MAX_STEPS))  # as torch.optim.SGD rounds
                p.grad = None
        steps.append((step.step, [item["id"] for mb in step.microbatches for item in mb], step.global_loss_tokens))
        if len(steps) == MAX_STEPS:
            break
    return {"steps": steps, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_the_trainer_trains_the_streams_steps_and_resumes_at_the_next_one(tmp_path):
    whole = train(tmp_path / "whole")
    reference = plain_loop()
    assert whole["global_step"] == MAX_STEPS and whole["steps"] == reference["steps"]
    assert all(torch.equal(whole["weights"][n], w) for n, w in reference["weights"].items())
    assert {i for _, ids, _ in whole["steps"] for i in ids} < set(range(24))  # the run stops at max_steps

    resumed = train(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-3"))
    assert resumed["steps"] == whole["steps"][3:]
    assert all(torch.equal(resumed["weights"][n], w) for n, w in whole["weights"].items())


@pytest.mark.parametrize("overrides, message", [
    ({"max_steps": -1}, "train_dataset is a TokenBudgetStream, whose length is not known up front: give max_steps"),
    ({"sampler": True}, "train_dataset is a TokenBudgetStream, which plans its own steps: leave sampler out"),
    ({"dataset": "map"}, "give sampler= (a TokenBudgetSampler, or a function of the train dataset"),
])
def test_a_stream_without_max_steps_or_with_a_sampler_is_refused_in_one_line(overrides, message, tmp_path):
    from balance_batch.integrations.transformers import TokenBudgetTrainer

    args = training_args(str(tmp_path), max_steps=overrides.get("max_steps", MAX_STEPS), save_strategy="no")
    kwargs = {"train_dataset": items() if overrides.get("dataset") else stream()}
    if overrides.get("sampler"):
        kwargs["sampler"] = make_sampler()
    with pytest.raises(ValueError) as refused:
        TokenBudgetTrainer(model=tiny_llama(), args=args, **kwargs)
    assert message in str(refused.value) and "\n" not in str(refused.value)
