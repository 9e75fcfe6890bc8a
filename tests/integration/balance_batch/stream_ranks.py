"""One rank of a ``TokenBudgetStream`` run under torchrun (gloo), for tests/integration/balance_batch/test_stream.py.

Each rank streams its own shard of items with ids: rank 0 from a generator (resumed by the count it read), rank 1
from a source with a ``state_dict`` (10% more items than rank 0), rank 2 and later from an empty list. The run is
made twice: uninterrupted, and again from the state each rank saved after step ``--resume-after``. Rank 0 writes
what every rank trained, step by step, to ``--out`` (JSON). With ``--fail-at k``, rank 1's length function raises at
its item k, and each rank writes the error it raised to ``--out``.rank<r>.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch.distributed as dist

from balance_batch.cost import CostModel
from balance_batch.stream import TokenBudgetStream
from tests.stream_sources import Shard


def shard(rank: int, n: int, seed: int) -> list[dict]:
    """Rank ``rank``'s items: lengths from a heavy-tailed draw (rank 1's longer and 10% more), ids unique over
    ranks."""
    if rank >= 2:
        return []
    count = n if rank == 0 else n + n // 10
    rng = np.random.default_rng([seed, rank])
    lengths = np.minimum(rng.lognormal(5.0 + 0.5 * rank, 1.0, count).astype(np.int64) + 1, 6000)
    return [{"id": rank * 1_000_000 + i, "input_ids": np.full(int(n_), 3, dtype=np.int32)}
            for i, n_ in enumerate(lengths)]


def source(rank: int, n: int, seed: int):
    items = shard(rank, n, seed)
    if rank == 0:
        return (item for item in items)
    return Shard(items) if rank == 1 else items


def run(args, stream: TokenBudgetStream, save_after: int | None = None):
    """Per step: this rank's micro-batches as item ids, and the step's totals; the state after ``save_after``."""
    steps, saved = [], None
    for step in stream:
        steps.append({"step": step.step, "tokens": step.global_tokens, "loss": step.global_loss_tokens,
                      "mbs": [[int(item["id"]) for item in mb] for mb in step.microbatches],
                      "lens": [[len(item["input_ids"]) for item in mb] for mb in step.microbatches]})
        if step.step == save_after:
            saved = stream.state_dict()
    return steps, saved


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--tokens-per-step", type=int, default=30000)
    p.add_argument("--resume-after", type=int, default=4)
    p.add_argument("--fail-at", type=int, default=None, help="rank 1's length function raises at this item")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cost = CostModel(1.0, 1 / 4096, "tokens plus attention")
    if args.fail_at is not None:
        def length(item):
            if rank == 1 and item["id"] == 1_000_000 + args.fail_at:
                raise KeyError("no tokens")
            return len(item["input_ids"])

        stream = TokenBudgetStream(source(rank, args.items, args.seed), max_tokens_per_microbatch=args.budget,
                                   tokens_per_step=args.tokens_per_step, buffer_size=64, length=length)
        try:
            list(stream)
        except ValueError as failed:
            with open(f"{args.out}.rank{rank}", "w", encoding="utf-8") as f:
                f.write(str(failed))
        dist.destroy_process_group()
        return

    def stream():
        return TokenBudgetStream(source(rank, args.items, args.seed), max_tokens_per_microbatch=args.budget,
                                 tokens_per_step=args.tokens_per_step, seed=args.seed, buffer_size=64,
                                 cost_model=cost)

    full, state = run(args, stream(), args.resume_after)
    resumed = stream()
    resumed.load_state_dict(state)
    rest, _ = run(args, resumed)
    shards = [[int(item["id"]) for item in shard(r, args.items, args.seed)] for r in range(dist.get_world_size())]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"full": full, "rest": rest})
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"ranks": gathered, "shards": shards, "budget": args.budget,
                       "cost": [cost.a, cost.b]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
