"""A plain training loop on a Hugging Face ``datasets`` stream, under torchrun: token-budget steps from
``TokenBudgetStream``, balanced over the ranks, resumed exactly from a saved state.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m examples.stream_jsonl

It writes four jsonl shards of unequal sizes (nothing is downloaded), streams them with
``load_dataset("json", ..., streaming=True)``, tokenizes as it reads (a word-level hash, built here), and gives each
rank whole shards with ``split_dataset_by_node``: one rank's shards hold more and longer documents than the other's.
Each step is planned over both ranks' items together, so both run the same number of micro-batches and about the
same tokens. The loop trains the tiny model in bf16, sums each micro-batch's loss over the step's loss tokens and
all-reduces the gradients once per step. After step 2 it saves the stream's state (the dataset's own ``state_dict``
and the items read but not yet trained); a new stream on a new dataset, loaded from it, yields the uninterrupted
run's step 3 item for item. It also runs as one process (``python -m examples.stream_jsonl``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib

import numpy as np
import torch
import torch.distributed as dist

from balance_batch.collate import pack_collate
from balance_batch.stream import TokenBudgetStream
from examples.tiny import VOCAB, tiny_model

SHARDS = (30, 10, 25, 7)  # documents per shard: split over 2 ranks, rank 0 reads shards 0 and 2, rank 1 1 and 3
STREAM = dict(max_tokens_per_microbatch=512, tokens_per_step=1536, buffer_size=16, seed=0)
SAVE_AFTER = 2
LR = 0.5


def write_shards(folder: str) -> list[str]:
    """Four jsonl shards of documents, words drawn from a small vocabulary; the later a shard, the longer its
    documents."""
    rng, files = np.random.default_rng(0), []
    for k, n in enumerate(SHARDS):
        path = os.path.join(folder, f"shard-{k}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for i in range(n):
                words = rng.integers(0, 500, int(rng.integers(10, 120 + 120 * (k % 2 == 0))))
                f.write(json.dumps({"id": f"{k}-{i}", "text": " ".join(f"w{w}" for w in words)}) + "\n")
        files.append(path)
    return files


def tokenize(row: dict) -> dict:
    return {"input_ids": [zlib.crc32(w.encode()) % VOCAB for w in row["text"].split()]}


def dataset(files: list[str], rank: int, world_size: int):
    """This rank's shards, streamed and tokenized as they are read."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    stream = load_dataset("json", data_files=files, split="train", streaming=True)
    return split_dataset_by_node(stream.map(tokenize, remove_columns=["text"]), rank=rank, world_size=world_size)


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    folder = tempfile.mkdtemp(prefix="stream_jsonl-") if rank == 0 else None
    if dist.is_initialized():  # rank 0 writes the shards, every rank reads its own
        shared = [folder]
        dist.broadcast_object_list(shared, src=0)
        folder = shared[0]
    files = write_shards(folder) if rank == 0 else [os.path.join(folder, f"shard-{k}.jsonl") for k in range(4)]
    if dist.is_initialized():
        dist.barrier()
    torch.manual_seed(0)
    model = tiny_model().to(torch.bfloat16)
    stream = TokenBudgetStream(dataset(files, rank, world_size), world_size=world_size, rank=rank, **STREAM)
    trained, state, after = [], None, None
    for step in stream:
        for microbatch in step.microbatches:  # [] is a dummy: it runs, and adds nothing
            model(**pack_collate(microbatch), num_items_in_batch=step.global_loss_tokens).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    if dist.is_initialized():
                        dist.all_reduce(p.grad)  # each rank's loss is over the step's loss tokens: the sum is the mean
                    p.add_(p.grad, alpha=-LR)
                    p.grad = None
        mine = [row["id"] for mb in step.microbatches for row in mb]
        trained.append((len(step.microbatches), sum(len(row["input_ids"]) for mb in step.microbatches for row in mb)))
        if step.step == SAVE_AFTER:
            state = stream.state_dict()
        elif step.step == SAVE_AFTER + 1:
            after = mine
    resumed = TokenBudgetStream(dataset(files, rank, world_size), world_size=world_size, rank=rank, **STREAM)
    resumed.load_state_dict(state)
    again = [row["id"] for mb in next(iter(resumed)).microbatches for row in mb]
    assert again == after, "the resumed stream's next step differs from the uninterrupted run's"
    counts = {n for n, _ in trained}
    read = sum(len(row["input_ids"]) for row in dataset(files, rank, world_size))
    print(f"rank {rank}: its shards held {read:,} tokens; {len(trained)} steps, {sum(t for _, t in trained):,} "
          "tokens trained; micro-batches per "
          f"step {min(counts)}-{max(counts)}; resumed after step {SAVE_AFTER}: step {SAVE_AFTER + 1} as trained")
    if dist.is_initialized():
        totals: list = [None] * world_size
        dist.all_gather_object(totals, trained)
        if rank == 0:
            assert all([n for n, _ in rows] == [n for n, _ in totals[0]] for rows in totals)  # lock-step counts
            per_step = np.array([[t for _, t in rows] for rows in totals])
            print("the same micro-batch count on every rank at every step; each step's tokens, slowest rank over "
                  f"the mean: {float((per_step.max(0) / per_step.mean(0)).mean()):.3f}")
        dist.barrier()  # every rank done reading before rank 0 removes the shards
        dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
