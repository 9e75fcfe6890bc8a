"""Tight packing benchmark (a script, not a test): how often plan_step and pack take more micro-batches than the
exact optimum on verl's test shape, and what planning a step costs.

    PYTHONPATH=. python scripts/bench_tight.py [--cases 300] [--rows 20,25]
    PYTHONPATH=. python scripts/bench_tight.py --cases 2000 --rows 25

The family: seeded steps of lengths uniform in [50, 90] at a budget of 300 tokens, one rank, packed, balanced;
``--rows 20,25`` (the default) draws 20 or 25 lengths a step, ``--rows 25`` always 25. No length is over half the
budget, so the lower bound is ceil(sum / 300): a plan that reaches it is optimal. Where a plan or a packing takes
more, ``fewest_microbatches`` below (an exact search of its own, uncapped) finds the optimum and a packing that
proves it, checked here. Also the exact search's work (``_Packer.search``, the units its cap counts) on every draw
where best-fit decreasing leaves a micro-batch over the bound. Run it with an older checkout first on PYTHONPATH
for the before column.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import itertools
import math
import platform
import random
import statistics
import sys
import time
from typing import Optional

import balance_batch
from balance_batch import pack, plan_step
from balance_batch.balanced import packed
from balance_batch.stats import lower_bound_bins

BUDGET = 300


def verl_shaped(seed: int, rows: tuple[int, ...] = (20, 25)) -> list[int]:
    rng = random.Random(seed)
    n = rows[0] if len(rows) == 1 else rng.choice(rows)
    return [rng.randint(50, 90) for _ in range(n)]


def pack_into(lengths: list[int], budget: int, bins: int) -> Optional[list[list[int]]]:
    """A packing of ``lengths`` (values) into ``bins`` bins of ``budget``, or None where there is none. Exact, with
    no cap: bin after bin, each takes the longest length left and then every subset of the rest that fits (fullest
    first, each multiset of lengths once). Pruned where the rooms left over pass the slack, and where more lengths are
    left than the bins left can hold (none holds more than the shortest ones whose sum fits)."""
    items = sorted(lengths, reverse=True)
    slack = bins * budget - sum(items)
    if slack < 0 or (items and items[0] > budget):
        return None
    failed: set = set()

    def solve(rest: list[int], bins: int, waste: int) -> Optional[list[list[int]]]:
        if not rest:
            return []
        most = bisect.bisect_right(list(itertools.accumulate(sorted(rest))), budget)
        key = (tuple(rest), bins)
        if bins == 0 or len(rest) > bins * most or key in failed:
            return None
        first, others = rest[0], rest[1:]
        fills: list[tuple[int, tuple[int, ...]]] = []

        def walk(i: int, room: int, taken: tuple[int, ...]) -> None:
            if waste + room - min(room, sum(others[i:])) > slack:
                return  # even taking every one left, this bin would waste more than the slack allows
            if i == len(others):
                fills.append((room, taken))
                return
            x = others[i]
            if x <= room:
                walk(i + 1, room - x, taken + (i,))
            j = i + 1
            while j < len(others) and others[j] == x:  # leaving x out leaves its equals out too: each multiset once
                j += 1
            walk(j, room, taken)

        walk(0, budget - first, ())
        for room, taken in sorted(fills, key=lambda f: f[0]):
            chosen = set(taken)
            left = [x for k, x in enumerate(others) if k not in chosen]
            found = solve(left, bins - 1, waste + room)
            if found is not None:
                return [[first, *(others[k] for k in taken)], *found]
        failed.add(key)
        return None

    return solve(items, bins, 0)


def fewest_microbatches(lengths: list[int], budget: int) -> tuple[int, list[list[int]]]:
    """The optimum and a packing that reaches it: the first count from the lower bound up that ``pack_into`` fills,
    the packing checked (the same lengths, every bin within the budget)."""
    bins = lower_bound_bins(lengths, budget)
    while (packing := pack_into(lengths, budget, bins)) is None:
        bins += 1
    assert sorted(x for b in packing for x in b) == sorted(lengths) and all(sum(b) <= budget for b in packing)
    return bins, packing


def search_work(lengths: list[int], budget: int) -> Optional[int]:
    """The exact search's work for the bound's micro-batches where best-fit decreasing leaves one over (None where it
    does not, or where this checkout's search does not say)."""
    hist = sorted(collections.Counter(lengths).items(), reverse=True)
    seq_cost = {n: float(n) for n, _ in hist}
    bfd = packed._Packer(hist, budget, math.inf, seq_cost)
    bfd.bfd()
    bound = lower_bound_bins(lengths, budget)
    if bfd.n_bins() <= bound:
        return None
    exact = packed._Packer(hist, budget, math.inf, seq_cost)
    exact.search(bound, packed._search_work(len(lengths)))
    return getattr(exact, "search_work", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--rows", default="20,25", help="lengths a step: one count, or counts to draw from")
    args = parser.parse_args()
    rows = tuple(int(r) for r in args.rows.split(","))
    print(f"Python {platform.python_version()} on {platform.machine()}; balance_batch from {balance_batch.__file__}",
          file=sys.stderr)
    over: dict[str, list[int]] = {"plan_step": [], "pack": []}  # seeds that take more than the optimum
    times: dict[str, list[float]] = {"plan_step": [], "pack": []}
    works: list[int] = []
    for seed in range(args.cases):
        lengths = verl_shaped(seed, rows)
        bound = lower_bound_bins(lengths, BUDGET)
        t = time.perf_counter()
        plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=BUDGET, layout="packed")
        times["plan_step"].append(time.perf_counter() - t)
        t = time.perf_counter()
        rows_packed = pack(lengths, BUDGET)
        times["pack"].append(time.perf_counter() - t)
        counts = {"plan_step": sum(1 for s in plan.microbatches for b in s if b), "pack": rows_packed.rows}
        optimum = bound if max(counts.values()) == bound else fewest_microbatches(lengths, BUDGET)[0]
        for name, count in counts.items():
            assert count >= optimum, (seed, name, count, optimum)
            if count > optimum:
                over[name].append(seed)
        work = search_work(lengths, BUDGET)
        if work is not None:
            works.append(work)
    print(f"{args.cases} steps of {' or '.join(map(str, rows))} lengths in [50, 90] at a budget of {BUDGET}")
    print("| call | above the optimum | per step: median | mean | max |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {len(over[name])} of {args.cases} | {1e3 * statistics.median(ts):.2f} ms | "
              f"{1e3 * statistics.mean(ts):.2f} ms | {1e3 * max(ts):.1f} ms |")
    for name, seeds in over.items():
        if seeds:
            print(f"{name} above the optimum at seeds {', '.join(map(str, seeds))}")
    cap = packed._search_work(max(rows))
    if works:
        print(f"the exact search, where best-fit decreasing leaves one over ({len(works)} steps): work median "
              f"{statistics.median(works):,.0f}, max {max(works):,} (cap {cap:,})")
    else:
        print("the exact search's work: not reported by this checkout")


if __name__ == "__main__":
    main()
