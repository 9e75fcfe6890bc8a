"""A plain PyTorch DataLoader with 2 worker processes, fed by the sampler, collating packed rows.

    python -m examples.dataloader

The loop takes the step structure (which micro-batches make an optimizer step, and its loss denominator) from
``sampler.steps()``, and the tensors from the loader, which iterates the same micro-batches in the same order.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from balance_batch import TokenBudgetSampler
from balance_batch.collate import pack_collate
from examples.tiny import ToyDataset


def main() -> None:
    lengths = [(7 * i) % 61 + 3 for i in range(200)]
    dataset = ToyDataset(lengths)
    # steps of at most 1,000 tokens until 3,000 are consumed, then of at most 2,000; micro-batches of 128 tokens
    sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=128, tokens_per_step=[(0, 1000), (3000, 2000)],
                                 seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pack_collate, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches, seen = iter(loader), []
        for step in sampler.steps():
            for microbatch in step.microbatches:
                batch = next(batches)
                # the row holds exactly the micro-batch's sequences, end to end
                starts = (batch["position_ids"][0] == 0).nonzero().flatten()
                assert batch["input_ids"][0, starts].tolist() == microbatch
                assert batch["input_ids"].shape[1] == sum(lengths[i] for i in microbatch) <= 128
                assert int((batch["labels"] != -100).sum()) == sum(lengths[i] - 1 for i in microbatch)
                seen += microbatch
        assert next(batches, None) is None and sorted(seen) == list(range(len(lengths)))
        print(f"epoch {epoch}: {sampler.steps_in_epoch} steps, every one of the {len(lengths)} items once, "
              f"through 2 worker processes (torch {torch.__version__})")


if __name__ == "__main__":
    main()
