"""Time one rank's fwd+bwd of a workload three ways in one process: mbs=1, padded token budgets, packed rows.

    PYTHONPATH=. python scripts/bench_packing.py                       # cpu_mixed, tiny model, LoRA 32
    PYTHONPATH=. python scripts/bench_packing.py --profile packed:16384  # plus the top entries of one packed pass

Packed rows are the balanced planner's (real tokens up to the budget);
padded micro-batches are the original greedy planner's (count x longest <= budget).
The numbers are wall-clock on whatever else the machine is doing: compare
them within one run, not across machines.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from backends.model.build import build_model
from backends.model.step import run_schedule, total_loss_weight
from backends.specs import ModelSpec
from balance_batch import plan_step
from balance_batch.greedy import make_token_balanced_microbatches, sort_by_length
from balance_batch.integrations.transformers.packing import prepare_model_for_packing
from harness.data.workload import make_examples, mixed_lengths


def schedules(lengths: list[int], budgets: list[int]) -> dict[str, tuple[list, str]]:
    order = sort_by_length(lengths)
    out = {"mbs1": ([[i] for i in order], "padded")}
    for b in budgets:
        out[f"padded:{b}"] = (make_token_balanced_microbatches(order, [range(n) for n in lengths], b), "padded")
        packed = plan_step(lengths, world_size=1, max_tokens_per_microbatch=b, layout="packed", planner="balanced",
                           lockstep=False)
        out[f"packed:{b}"] = (packed.schedules[0], "packed")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-examples", type=int, default=24)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (a 2-rank CPU run gives each rank 1 of 2 cores)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="run only these settings (e.g. mbs1 packed:16384)")
    ap.add_argument("--profile", help="profile one pass of this setting (torch.profiler) and print the top operators")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    lengths = mixed_lengths(args.n_examples, args.min_len, args.max_len, 42)
    examples = make_examples(lengths, 2048, seed=0)
    total_weight = total_loss_weight(examples)
    model = prepare_model_for_packing(build_model(ModelSpec(lora_rank=args.lora_rank), torch.device("cpu"), args.gc))
    cpu = torch.device("cpu")
    settings = schedules(lengths, args.budgets)
    if args.only:
        settings = {k: v for k, v in settings.items() if k in args.only}

    def one_pass(schedule, layout) -> tuple[float, float]:
        """(wall s, CPU s of this process): CPU time is what the other users of a busy machine disturb least."""
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), time.process_time()
        run_schedule(model, examples, schedule, "forward_backward", total_weight, cpu, layout=layout)
        return time.perf_counter() - t0, time.process_time() - c0

    real = sum(lengths)
    print(f"{len(lengths)} sequences, {real:,} tokens, threads={args.threads}, lora={args.lora_rank}, gc={args.gc}")
    one_pass(*next(iter(settings.values())))  # warm-up (allocator, first-call costs)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    for _ in range(args.repeat):  # rounds, so a burst of load on the machine hits every setting alike
        for name, (schedule, layout) in settings.items():
            runs[name].append(one_pass(schedule, layout))
    results = {}
    for name, (schedule, layout) in settings.items():
        wall, cpu_s = min(w for w, _ in runs[name]), min(c for _, c in runs[name])
        computed = sum(len(b) * max(lengths[i] for i in b) for b in schedule) if layout == "padded" else real
        results[name] = dict(
            steps=len(schedule), computed_tokens=computed, wall_s=wall, cpu_s=cpu_s, tok_per_s=real / cpu_s
        )
        print(f"{name:>14}: {len(schedule):3d} steps, {computed:7,} tokens computed, best wall {wall:6.2f} s, "
              f"best CPU {cpu_s:6.2f} s, {real / cpu_s:7,.0f} tok/s (CPU)", flush=True)
    if "mbs1" in results:
        base = results["mbs1"]["tok_per_s"]
        print(
            "speedup vs mbs1 (CPU time):", json.dumps({k: round(v["tok_per_s"] / base, 2) for k, v in results.items()})
        )
    if args.profile:
        schedule, layout = schedules(lengths, args.budgets)[args.profile]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            elapsed_s, _ = one_pass(schedule, layout)
        print(f"profile of {args.profile} ({elapsed_s:.2f} s with the profiler on), operators by self CPU time:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
