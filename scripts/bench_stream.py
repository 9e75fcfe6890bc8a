"""What ``TokenBudgetStream`` costs per step on gloo ranks (docs/measurements/2026-12-07-stream.md).

    python scripts/bench_stream.py --ranks 2 4 --out DIR
    python scripts/bench_stream.py --what throughput --mean 100 --out DIR

Two measurements per world size, each rank in its own process (torch.multiprocessing, gloo on 127.0.0.1, one torch
thread per rank):

- ``model``: the time-to-loss model (examples/time_to_loss.py's full size: a 1.18M-parameter Llama, float32,
  micro-batches of at most 1,024 tokens) trained on the stream's steps, about 5,800 tokens a step as there, the
  gradients all-reduced once a step. Per step, the stream's own time (``next(stream)``: reading the buffer, the
  exchange of lengths, planning, moving the items) against the step's compute (forward, backward, all-reduce).
- ``throughput``: the stream alone, items of int32 token arrays (a heavy-tailed length draw up to 16,384 tokens),
  micro-batches of at most 8,192 tokens, 16 micro-batches' worth of tokens per rank a step: tokens per second per
  rank, where the time goes (planning, the two collectives, the rest), each step's tokens per rank (the slowest
  over the mean) as run and as read (had each rank run the items it read), and the share of tokens moved.
  ``--mean`` sets the draw's median length (1,500 tokens; shorter items make more of them to plan and move).

Each rank's source is its own shard (rank r's lengths drawn with its own seed; the last rank's shard longer), read
from a list. The first steps are warm-up. Prints one JSON line per measurement and writes them to DIR/stream.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3


def shard(rank: int, world_size: int, n: int, cap: int, mean: float) -> list[dict]:
    rng = np.random.default_rng([7, rank])
    longer = 0.3 if rank == world_size - 1 else 0.0
    lengths = np.minimum(rng.lognormal(np.log(mean) + longer, 0.9, n).astype(np.int64) + 1, cap)
    return [{"input_ids": np.full(int(k), rank + 1, dtype=np.int32)} for k in lengths]


class Timed:
    """Wraps a function, summing the seconds of its calls."""

    def __init__(self, fn):
        self.fn, self.s = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.s += time.perf_counter() - t


def timed_stream(stream_module) -> dict:
    """The stream module's planning and collectives, timed."""
    timers = {"plan": Timed(stream_module.planned_rows), "gather": Timed(stream_module._Exchange.gather),
              "move": Timed(stream_module._Exchange.move)}
    stream_module.planned_rows = timers["plan"]
    stream_module._Exchange.gather = lambda self, *a, t=timers["gather"]: t(self, *a)
    stream_module._Exchange.move = lambda self, *a, t=timers["move"]: t(self, *a)
    return timers


def run_model(rank: int, world_size: int, steps: int, mean: int) -> dict:
    import torch
    import torch.distributed as dist

    from balance_batch.collate import pack_collate
    from balance_batch.stream import TokenBudgetStream
    from examples.time_to_loss import SIZES, make_model

    size = SIZES["full"]
    model = make_model(size, 0).train()
    items = [{"input_ids": torch.randint(1, size.vocab, (len(x["input_ids"]),))}
             for x in shard(rank, world_size, 60 * (steps + WARMUP), size.max_length, 300)]  # ~10 a step
    stream = iter(TokenBudgetStream(items, max_tokens_per_microbatch=size.max_length,
                                    tokens_per_step=5_800 * world_size // 2, seed=0, buffer_size=256))
    own, compute = [], []
    for _ in range(steps + WARMUP):
        t0 = time.perf_counter()
        step = next(stream)
        t1 = time.perf_counter()
        for mb in step.microbatches:
            model(**pack_collate(mb), num_items_in_batch=step.global_loss_tokens).loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad = None
        own.append(t1 - t0)
        compute.append(time.perf_counter() - t1)
    own, compute = own[WARMUP:], compute[WARMUP:]
    return {"own_ms": 1e3 * statistics.median(own), "compute_ms": 1e3 * statistics.median(compute),
            "own_over_compute": sum(own) / sum(compute), "steps": steps}


def run_throughput(rank: int, world_size: int, steps: int, mean: int) -> dict:
    import balance_batch.stream as stream_module

    budget = 8192
    items = shard(rank, world_size, (135_000 // mean + 1) * (steps + WARMUP) + 512, 2 * budget, mean)
    stream = iter(stream_module.TokenBudgetStream(items, max_tokens_per_microbatch=budget,
                                                  tokens_per_step=16 * budget * world_size, seed=0,
                                                  buffer_size=512))
    for _ in range(WARMUP):
        next(stream)
    timers = timed_stream(stream_module)
    t0, tokens, mbs, ran, origin = time.perf_counter(), 0, 0, [], []
    for _ in range(steps):
        step = next(stream)
        ran.append(sum(len(item["input_ids"]) for mb in step.microbatches for item in mb))
        read_by = np.zeros(world_size, dtype=np.int64)  # this rank's tokens by the rank that read them (its fill)
        for mb in step.microbatches:
            for item in mb:
                read_by[int(item["input_ids"][0]) - 1] += len(item["input_ids"])
        origin.append(read_by.tolist())
        tokens += ran[-1]
        mbs += len(step.microbatches)
    wall = time.perf_counter() - t0
    parts = {k: round(1e3 * t.s / steps, 2) for k, t in timers.items()}
    parts["rest"] = round(1e3 * wall / steps - sum(parts.values()), 2)
    return {"tokens_per_s_per_rank": tokens / wall, "ms_per_step": 1e3 * wall / steps,
            "tokens_per_rank_per_step": tokens / steps, "microbatches_per_step": mbs / steps, "ms": parts,
            "steps": steps, "ran": ran, "origin": origin}


def rank_main(rank: int, world_size: int, port: int, what: str, steps: int, mean: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    result = (run_model if what == "model" else run_throughput)(rank, world_size, steps, mean)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(what: str, world_size: int, steps: int, mean: int, folder: Path) -> dict:
    import torch.multiprocessing as mp

    out = folder / f"{what}-{world_size}.json"
    mp.spawn(rank_main, args=(world_size, free_port(), what, steps, mean, str(out)), nprocs=world_size)
    ranks = json.loads(out.read_text())
    if what == "model":
        return {"what": what, "ranks": world_size, "own_ms_median": max(r["own_ms"] for r in ranks),
                "compute_ms_median": max(r["compute_ms"] for r in ranks),
                "own_over_compute": max(r["own_over_compute"] for r in ranks), "steps": steps}
    ran = np.array([r["ran"] for r in ranks])  # [rank, step]: tokens each rank ran
    read = np.array([r["origin"] for r in ranks]).sum(axis=0).T  # [rank, step]: tokens each rank read for the step
    moved = 1 - sum(np.array(r["origin"])[:, k].sum() for k, r in enumerate(ranks)) / ran.sum()
    return {"what": what, "ranks": world_size, "mean_length": mean,
            "ran_max_over_mean": float((ran.max(0) / ran.mean(0)).mean()),
            "read_max_over_mean": float((read.max(0) / read.mean(0)).mean()), "tokens_moved": float(moved),
            "tokens_per_s_per_rank": min(r["tokens_per_s_per_rank"] for r in ranks),
            "ms_per_step": max(r["ms_per_step"] for r in ranks),
            "tokens_per_rank_per_step": statistics.mean(r["tokens_per_rank_per_step"] for r in ranks),
            "ms_rank0": ranks[0]["ms"], "steps": steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--what", nargs="+", default=["model", "throughput"], choices=["model", "throughput"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mean", type=int, default=1500, help="throughput: the length draw's median, in tokens")
    p.add_argument("--out", default="bench_stream")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(REPO))
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for what in args.what:
        for world_size in args.ranks:
            results.append(measure(what, world_size, args.steps, args.mean, folder))
            print(json.dumps(results[-1]), flush=True)
    (folder / "stream.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
