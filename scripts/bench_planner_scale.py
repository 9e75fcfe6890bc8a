"""Planning one DeepSeek-V3-size step over many ranks (a script, not a test): how long ``balanced_schedules`` takes
at 8, 64 and 1,024 ranks, and what the plan is.

    PYTHONPATH=. .venv/bin/python scripts/bench_planner_scale.py
    PYTHONPATH=. .venv/bin/python scripts/bench_planner_scale.py --impl /tmp/balanced_old   # another copy of balanced/

The step: 15,360 sequences (DeepSeek-V3's global batch) with lengths drawn
from a log-normal of mean 2,930 tokens (sigma 1, ``random.Random(seed)``),
capped at 131,072: about 45M tokens. Budget 32,768 tokens a micro-batch, cost
= tokens. Per layout and rank count: the median of ``--repeats`` timings of
``balanced_schedules``, and the plan's micro-batches, steps, sum over steps
of the costliest micro-batch (what a lock-step backend waits for) and the
largest and smallest per-rank cost. ``--impl`` loads the ``balanced`` package
from another folder (a copy of it from an older commit) in place of this
checkout's, for a before column on the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from balance_batch.cost import CostModel, microbatch_cost

SEQUENCES = 15_360
MEAN = 2_930
SIGMA = 1.0
LONGEST = 131_072
BUDGET = 32_768


def lengths(seed: int) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(MEAN) - SIGMA * SIGMA / 2  # the log-normal's mean is MEAN
    return [max(1, min(LONGEST, round(rng.lognormvariate(mu, SIGMA)))) for _ in range(SEQUENCES)]


def planner(impl: str) -> Callable:
    """``balanced_schedules`` of this checkout, or of the ``balanced`` package in folder ``impl``."""
    if not impl:
        from balance_batch.balanced import balanced_schedules

        return balanced_schedules
    import balance_batch  # noqa: F401  (the parent package first, with this checkout's modules)

    for name in [m for m in sys.modules if m == "balance_batch.balanced" or m.startswith("balance_batch.balanced.")]:
        del sys.modules[name]
    folder = Path(impl).resolve()
    spec = importlib.util.spec_from_file_location("balance_batch.balanced", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["balance_batch.balanced"] = module
    spec.loader.exec_module(module)
    return module.balanced_schedules


def summary(schedules: list, lens: list[int], layout: str, cost_model: CostModel) -> dict:
    costs = [[microbatch_cost(mb, lens, layout, cost_model) for mb in ranks] for ranks in schedules]
    per_rank = [sum(c) for c in costs]
    n_steps = len(schedules[0])
    return {
        "micro-batches": sum(mb is not None for ranks in schedules for mb in ranks),
        "steps": n_steps,
        "sum of step maxima": sum(max(c[s] for c in costs) for s in range(n_steps)),
        "max per rank": max(per_rank),
        "min per rank": min(per_rank),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,1024")
    ap.add_argument("--layouts", default="packed,padded")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", default="", help="a folder holding a copy of balance_batch/balanced to time instead")
    args = ap.parse_args()
    plan = planner(args.impl)
    lens = lengths(args.seed)
    cost_model = CostModel.tokens()
    print(f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}; "
          f"balanced from {Path(sys.modules[plan.__module__].__file__).parent}")
    print(f"{len(lens):,} sequences, {sum(lens):,} tokens (mean {sum(lens) / len(lens):,.0f}, longest {max(lens):,}), "
          f"budget {BUDGET:,}, cost = tokens, seed {args.seed}")
    print("| layout | ranks | seconds (median of %d) | micro-batches | steps | sum of step maxima | max per rank | "
          "min per rank |" % args.repeats)
    print("|---|---|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        for world in map(int, args.ranks.split(",")):
            times, schedules = [], None
            for _ in range(args.repeats):
                start = time.perf_counter()
                schedules = plan(lens, world, BUDGET, layout, cost_model)
                times.append(time.perf_counter() - start)
            s = summary(schedules, lens, layout, cost_model)
            print(f"| {layout} | {world:,} | {statistics.median(times):.3f} | {s['micro-batches']:,} | {s['steps']} | "
                  f"{s['sum of step maxima']:,.0f} | {s['max per rank']:,.0f} | {s['min per rank']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
