"""Sampler benchmark (a script, not a test): what balance_batch.TokenBudgetSampler costs a training loop.

    PYTHONPATH=. python scripts/bench_sampler.py [--sequences 1000000] [--steps 50]

1. An epoch of ``--sequences`` lengths of bench_planner's heavy-tailed distribution (log-normal, median 400, sigma
   1.4, up to 262,144: Wikipedia-like articles, with the odd huge one) in steps of at most 1,000,000 tokens on 8
   ranks, budget 8,192 tokens a micro-batch, packed, balanced: the time to cut the epoch into steps, to plan every
   step of one rank (what each rank does), and per step.
2. ``steps()`` at 4,096 sequences a step (same distribution, 8 ranks): the per-step cost over ``--steps`` steps.
3. What the sampler's planning leaves out (the balanced planner's refinement, ``work=0``): on 20 steps of part 1,
   the step count, critical path and per-rank cost imbalance with and without it, and the time of each.
4. Sizes: ``steps_in_epoch`` and ``len(sampler)`` on part 1's epoch, each asked twice (``--sizes-only``: this alone,
   e.g. at ``--sequences 10000000``).

Timings are wall-clock on whatever machine runs it: upper bounds on a busy one.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner import heavy_tailed_lengths

from balance_batch import CostModel, TokenBudgetSampler
from balance_batch.balanced import balanced_schedules
from balance_batch.stats import plan_stats

RANKS, BUDGET, STEP_TOKENS, STEP_SEQUENCES = 8, 8192, 1_000_000, 4096


def epoch(lengths: list[int]) -> None:
    sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=BUDGET, world_size=RANKS, rank=0,
                                 tokens_per_step=STEP_TOKENS)
    t = time.perf_counter()
    n_steps = sampler.steps_in_epoch
    cut = time.perf_counter() - t
    times, counts, tokens = [], [], []
    t = time.perf_counter()
    last = t
    for step in sampler.steps():
        now = time.perf_counter()
        times.append(now - last)
        last = now
        counts.append(len(step.microbatches))
        tokens.append(step.global_tokens)
    total = time.perf_counter() - t
    full = tokens[:-1]
    print("| epoch | steps | cutting | planning every step | per step | micro-batches per rank per step |")
    print("|---|---|---|---|---|---|")
    print(f"| {len(lengths):,} sequences, {sum(lengths):,} tokens | {n_steps:,} steps (tokens per step "
          f"{min(full):,}–{max(full):,}, last {tokens[-1]:,}) | cut {cut:.2f} s | planned in {total:.1f} s | per step "
          f"mean {1e3 * statistics.mean(times):.1f} ms, max {1e3 * max(times):.1f} ms | micro-batches per rank per "
          f"step {min(counts)}–{max(counts)} |")


def per_step(lengths: list[int], n: int) -> None:
    sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=BUDGET, world_size=RANKS, rank=0,
                                 sequences_per_step=STEP_SEQUENCES)
    steps = sampler.steps()
    times = []
    for _ in range(min(n, sampler.steps_in_epoch)):
        t = time.perf_counter()
        next(steps)
        times.append(time.perf_counter() - t)
    print("\n| step size | steps timed | per step |\n|---|---|---|")
    print(f"| {STEP_SEQUENCES:,} sequences a step, {RANKS} ranks | {len(times)} steps | per step median "
          f"{1e3 * statistics.median(times):.1f} ms, mean {1e3 * statistics.mean(times):.1f} ms, max "
          f"{1e3 * max(times):.1f} ms |")


def sizes(lengths: list[int]) -> None:
    """What a progress bar, a schedule or ``len(DataLoader)`` costs: the steps of the epoch (the cut alone) and its
    micro-batches (``len``: every step planned once, the counts kept), each asked twice."""
    t = time.perf_counter()
    sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=BUDGET, world_size=RANKS, rank=0,
                                 tokens_per_step=STEP_TOKENS)
    timed = [("construction", time.perf_counter() - t, "")]
    for name, ask in (("steps_in_epoch", lambda: sampler.steps_in_epoch), ("len", lambda: len(sampler))):
        for call in ("first", "second"):
            t = time.perf_counter()
            value = ask()
            timed.append((f"{name}, {call} call", time.perf_counter() - t, f"{value:,}"))
    print("\n| epoch of | asked | time | answer |\n|---|---|---|---|")
    for name, seconds, value in timed:
        print(f"| {len(lengths):,} sequences | {name} | {seconds:.3f} s | {value} |")


def refinement(lengths: list[int], n: int = 20) -> None:
    sampler = TokenBudgetSampler(lengths, max_tokens_per_microbatch=BUDGET, world_size=RANKS, rank=0,
                                 tokens_per_step=STEP_TOKENS)
    order, bounds, _, _ = sampler._cut(0)
    cm = CostModel.tokens()
    rows = {0: [], None: []}
    for p, q in bounds[:n]:
        step = [lengths[i] for i in order[p:q]]
        for work in rows:
            t = time.perf_counter()
            grid = balanced_schedules(step, RANKS, BUDGET, "packed", cm, work=work)
            dt = time.perf_counter() - t
            st = plan_stats(grid, step, layout="packed", cost_model=cm, budget=BUDGET, lockstep=True,
                            planner="balanced")
            rows[work].append((st.steps, st.critical_path, st.cost_imbalance, dt))
    print(f"\n| {n} steps planned by | lock-step micro-batch slots | critical path | cost imbalance | planning |")
    print("|---|---|---|---|---|")
    for work, label in ((0, "sampler (work=0)"), (None, "plan_step's refinement")):
        r = rows[work]
        print(f"| {label} | {sum(x[0] for x in r)} | mean {statistics.mean(x[1] for x in r):.4f} "
              f"| mean {statistics.mean(x[2] for x in r):.4f} | mean "
              f"{1e3 * statistics.mean(x[3] for x in r):.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=50, help="part 2's steps")
    parser.add_argument("--sizes-only", action="store_true", help="part 4 alone (the 10M-sequence figure)")
    args = parser.parse_args()
    print(f"Python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}\n")
    lengths = heavy_tailed_lengths(args.sequences)
    if args.sizes_only:
        sizes(lengths)
        return
    epoch(lengths)
    per_step(lengths, args.steps)
    refinement(lengths)
    sizes(lengths)


if __name__ == "__main__":
    main()
