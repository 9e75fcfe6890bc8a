"""Planner benchmark (a script, not a test): greedy and balanced x padded and packed on the published workload.

    PYTHONPATH=. python scripts/bench_planner.py [--large N] [--out reports/planner_benchmark.md]

Prints, per planner, layout, ranks and budget: lock-step steps against the
lower bound, pad efficiency, per-rank modeled cost max/mean, the critical path
(sum over steps of the costliest rank's micro-batch / mean per-rank cost) and,
packed, the critical path no plan can beat (``critical_path_lower_bound``),
micro-batches over budget and planning time; then the large case (the original workload
generator with N lengths, 8 ranks). Cost model: Qwen3.5-35B-A3B's shipped config.
Timings are wall-clock on whatever machine runs it: upper bounds on a busy one.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from backends.model.configs import cost_model_for
from backends.planning import critical_path_lower_bound, plan_batch
from backends.specs import ModelSpec
from harness.workload import mixed_lengths

BUDGETS = (16384, 32768, 65536, 131072)
RANKS = (1, 4, 8)
CASES = [("greedy", "padded"), ("greedy", "packed"), ("balanced", "padded"), ("balanced", "packed")]


def row(lengths, planner, layout, world, budget, cost_model) -> list[str]:
    t0 = time.perf_counter()
    plan = plan_batch(lengths, world, budget, 1, align=True, layout=layout, planner=planner, cost_model=cost_model)
    elapsed_ms = 1000 * (time.perf_counter() - t0)
    st = plan.stats
    return [
        planner,
        layout,
        str(world),
        f"{budget:,}",
        f"{st.steps} / {st.lower_bound_steps}",
        f"{st.pad_efficiency:.3f}",
        f"{st.cost_imbalance:.4f}",
        f"{st.critical_path:.4f}",
        f"{critical_path_lower_bound(lengths, world, budget, cost_model):.4f}" if layout == "packed" else "—",
        str(st.over_budget),
        f"{elapsed_ms:,.1f}",
    ]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", type=int, default=100_000, help="lengths in the large case (0 skips it)")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    cost_model = cost_model_for(ModelSpec(name="qwen3_5_35b_a3b", path="/nonexistent/Qwen3.5-35B-A3B"))
    header = ["planner", "layout", "ranks", "budget", "steps / lower bound", "pad eff.", "cost max/mean",
              "critical path", "critical path ≥", "over budget", "plan ms"]
    lengths = mixed_lengths(128, 64, 32768, 42)
    out = [
        "# Planner benchmark",
        "",
        f"`PYTHONPATH=. python scripts/bench_planner.py --large {args.large}` on {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}. Lock-step plans (as FSDP2 runs them). Cost model: "
        f"a = {cost_model.a:.4g} FLOPs/token, b = {cost_model.b:.4g} FLOPs/token² ({cost_model.source}). "
        "Planning times are wall-clock on a shared machine: upper bounds.",
        "",
        f"## seed_mixed_128 ({len(lengths)} examples, {sum(lengths):,} tokens)",
        "",
    ]
    rows = []
    for world in RANKS:
        for planner, layout in CASES:
            for budget in BUDGETS:
                rows.append(row(lengths, planner, layout, world, budget, cost_model))
                print(" | ".join(rows[-1]), flush=True)
    out.append(table(header, rows))
    if args.large:
        big = mixed_lengths(args.large, 64, 32768, 42)
        out += ["", f"## {args.large:,} lengths (the original workload generator, seed 42), 8 ranks, {sum(big):,} tokens", ""]
        big_rows = []
        for planner, layout in CASES:
            for budget in BUDGETS:
                big_rows.append(row(big, planner, layout, 8, budget, cost_model))
                print(" | ".join(big_rows[-1]), flush=True)
        out.append(table(header, big_rows))
    text = "\n".join(out) + "\n"
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
