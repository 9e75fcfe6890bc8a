"""A plain FSDP2 training loop on 2 gloo ranks, fed by the sampler, on a deliberately skewed dataset.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m examples.fsdp2

It needs the library's wheel with its ``[transformers]`` extra (docs/library.md, "Install") and this folder, not the
harness: it runs from a copy of examples/ as from the checkout.

The items alternate long and short, so splitting them by index (rank r takes r, r + 2, ...) would give one rank
only long sequences and the other only short ones: with a token budget per micro-batch, different micro-batch counts,
and a lock-step FSDP2 loop would hang in its collectives. The sampler plans each step over both ranks, so every rank
runs the same number of micro-batches (a dummy where it has nothing). Every step's gradient is checked against a
1-rank run of the same steps (rank 0, unsharded), and so are the weights at the end.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from balance_batch import TokenBudgetSampler
from balance_batch.collate import pack_collate
from examples.tiny import ToyDataset, tiny_model

LENGTHS = [40 if i % 2 == 0 else 5 for i in range(9)]
SAMPLER = dict(max_tokens_per_microbatch=48, sequences_per_step=4, seed=0)  # the last step: 1 sequence, 1 dummy
LR = 0.5


def train(model, world_size: int, grads_of=None) -> list[dict]:
    """SGD over one epoch of the sampler's steps; per step, the full gradient of every parameter. Under the process
    group the sampler takes its world size and rank from it; the 1-rank reference, run in a torchrun process before
    the group exists, says it is rank 0 of 1 (left to the defaults there, the sampler refuses to guess)."""
    dataset = ToyDataset(LENGTHS)
    ranks = {} if dist.is_initialized() else dict(world_size=1, rank=0)
    sampler = TokenBudgetSampler(LENGTHS, **ranks, **SAMPLER)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in sampler.steps():
        for microbatch in step.microbatches:  # [] is a dummy: it runs, and adds nothing
            batch = pack_collate([dataset[i] for i in microbatch])
            # summed over the step's loss tokens on all ranks; FSDP2 averages gradients over ranks, hence x world size
            loss = model(**batch, num_items_in_batch=step.global_loss_tokens).loss * world_size
            loss.backward()
        grads.append({n: (grads_of or full)(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return grads


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def main() -> None:
    from torch.distributed.fsdp import fully_shard

    reference = tiny_model()  # one process, before the group exists: the 1-rank run to compare with
    expected = train(reference, 1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    naive = [sum(LENGTHS[r::world]) for r in range(world)]
    model = tiny_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    grads = train(model, world)
    weights = {n: full(p.data) for n, p in model.named_parameters()}
    if rank == 0:
        assert len(grads) == len(expected)
        worst = max((g[n] - e[n]).abs().max().item() for g, e in zip(grads, expected) for n in e)
        drift = max((weights[n] - p.data).abs().max().item() for n, p in reference.named_parameters())
        assert worst <= 1e-5 and drift <= 1e-5, (worst, drift)
        print(f"{world} ranks, tokens by index split {naive}: {len(grads)} steps finished; gradients equal the 1-rank "
              f"run's within {worst:.1e}, final weights within {drift:.1e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
