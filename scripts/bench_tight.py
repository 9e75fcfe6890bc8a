"""Tight packing benchmark (a script, not a test): how often plan_step and pack reach the fewest micro-batches on
verl's test shape, and what planning a step costs.

    PYTHONPATH=. python scripts/bench_tight.py [--cases 300]

The family: seeded steps of 20 or 25 lengths uniform in [50, 90] at a budget of 300 tokens, one rank, packed,
balanced. No length is over half the budget, so the lower bound is ceil(sum / 300); a plan that reaches it is
optimal. Run it with an older checkout first on PYTHONPATH for the before column.
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import sys
import time

import balance_batch
from balance_batch import pack, plan_step

BUDGET = 300


def verl_shaped(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 90) for _ in range(rng.choice((20, 25)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    args = parser.parse_args()
    print(f"Python {platform.python_version()} on {platform.machine()}; balance_batch from {balance_batch.__file__}",
          file=sys.stderr)
    at_bound = {"plan_step": 0, "pack": 0}
    times: dict[str, list[float]] = {"plan_step": [], "pack": []}
    for seed in range(args.cases):
        lengths = verl_shaped(seed)
        bound = math.ceil(sum(lengths) / BUDGET)
        t = time.perf_counter()
        plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=BUDGET, layout="packed")
        times["plan_step"].append(time.perf_counter() - t)
        at_bound["plan_step"] += sum(1 for s in plan.microbatches for b in s if b) == bound
        t = time.perf_counter()
        rows = pack(lengths, BUDGET)
        times["pack"].append(time.perf_counter() - t)
        at_bound["pack"] += rows.rows == bound
    print("| call | at the optimum | per step: median | mean | max |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {at_bound[name]} of {args.cases} ({at_bound[name] / args.cases:.0%}) | "
              f"{1e3 * statistics.median(ts):.2f} ms | {1e3 * statistics.mean(ts):.2f} ms | {1e3 * max(ts):.1f} ms |")


if __name__ == "__main__":
    main()
