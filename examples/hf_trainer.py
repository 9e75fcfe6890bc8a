"""The Hugging Face Trainer training the tiny model on the sampler's packed micro-batches.

    python -m examples.hf_trainer

It needs the library's wheel with its ``[transformers]`` extra (docs/library.md, "Install") and this folder, not the
harness: it runs from a copy of examples/ as from the checkout.

``TokenBudgetTrainer`` (balance_batch.integrations.transformers) makes one Trainer batch one whole sampler step and
runs its micro-batches forward and backward one at a time, each loss summed over its tokens and divided by the step's
``global_loss_tokens``, so the step's gradient is the mean over all its loss tokens whatever the micro-batches. The
run is checked against a reference of the same steps with one sequence per forward and the same denominator: every
step's loss and the final weights, float32, within 1e-5.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import TrainingArguments

from balance_batch import TokenBudgetSampler
from balance_batch.integrations.transformers import TokenBudgetTrainer
from examples.tiny import ToyDataset, tiny_model

LENGTHS = [9, 3, 17, 6, 12, 7]
LR = 0.5


def sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(dataset, sampler: TokenBudgetSampler) -> tuple[list[float], dict]:
    """The same steps with one sequence per forward and the same denominator."""
    model = tiny_model()
    optimizer, _ = sgd(model)
    losses = []
    for step in sampler.steps():
        total = 0.0
        for i in (i for mb in step.microbatches for i in mb):
            item = dataset[i]["input_ids"][None]
            loss = model(input_ids=item, labels=item, num_items_in_batch=step.global_loss_tokens).loss
            loss.backward()
            total += loss.item()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
    return losses, weights(model)


def main() -> None:
    dataset = ToyDataset(LENGTHS)
    make = lambda: TokenBudgetSampler(LENGTHS, max_tokens_per_microbatch=16, tokens_per_step=30, seed=0)  # noqa: E731
    sampler = make()
    model = tiny_model()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, num_train_epochs=1, logging_steps=1, report_to="none", use_cpu=True,
                                 save_strategy="no", max_grad_norm=0.0, disable_tqdm=True)
        trainer = TokenBudgetTrainer(model=model, args=args, train_dataset=dataset, sampler=sampler,
                                     optimizers=sgd(model))
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    expected_losses, expected_weights = reference(dataset, make())
    trained = weights(model)
    loss_gap = max(abs(a - b) for a, b in zip(losses, expected_losses))
    weight_gap = max((trained[n] - w).abs().max().item() for n, w in expected_weights.items())
    assert len(losses) == len(expected_losses) and loss_gap <= 1e-5 and weight_gap <= 1e-5, (loss_gap, weight_gap)
    print(f"Trainer, {len(losses)} steps of packed micro-batches: losses {[round(x, 4) for x in losses]} equal the "
          f"one-sequence-per-forward reference within {loss_gap:.1e}, weights within {weight_gap:.1e}")


if __name__ == "__main__":
    main()
