"""The walk of the budget (``max_tokens_per_microbatch``) from each public entry to where a micro-batch is cut: every
library function it is handed to, under which name, and every check of it (a script, not a test).

    .venv/bin/python scripts/trace_budget.py

A budget of 4,099 tokens is used (a value nothing else in a plan equals), and a call is listed where one of the
called function's arguments is that value, or settings (``PlanSettings``) that carry it; ``positive_int`` handed it is
a check.
"""

from __future__ import annotations

import sys
from pathlib import Path

from balance_batch import TokenBudgetSampler, pack, plan_step
from balance_batch.planners import PlanSettings

BUDGET = 4099
ROOT = str(Path(__file__).resolve().parents[1] / "balance_batch")


def walk(entry) -> list[str]:
    """``name(argument)`` for each library call that was handed the budget, in order, repeats folded."""
    seen: list[str] = []

    def profile(frame, event, _arg):
        if event != "call" or not frame.f_code.co_filename.startswith(ROOT):
            return
        code = frame.f_code
        args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        named = [a for a in args if type(frame.f_locals.get(a)) is int and frame.f_locals[a] == BUDGET]
        named += [f"{a}.budget" for a in args if isinstance(frame.f_locals.get(a), PlanSettings)
                  and frame.f_locals[a].budget == BUDGET]
        if named:
            where = Path(code.co_filename).relative_to(Path(ROOT).parent).as_posix()
            check = " (check)" if code.co_name == "positive_int" else ""
            step = f"{where}:{code.co_name}({named[0]}){check}"
            if not seen or seen[-1] != step:
                seen.append(step)

    sys.setprofile(profile)
    try:
        entry()
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    lengths = [(37 * i) % 3001 + 1 for i in range(400)]
    entries = {
        "plan_step (balanced)": lambda: plan_step(lengths, world_size=4, max_tokens_per_microbatch=BUDGET),
        "plan_step (greedy, padded)": lambda: plan_step(lengths, world_size=4, max_tokens_per_microbatch=BUDGET,
                                                        planner="greedy", layout="padded"),
        "TokenBudgetSampler, one step": lambda: next(TokenBudgetSampler(
            lengths, max_tokens_per_microbatch=BUDGET, tokens_per_step=40_000, world_size=4, rank=0).steps()),
        "pack": lambda: pack(lengths, BUDGET),
    }
    for name, entry in entries.items():
        steps = walk(entry)
        checks = sum(1 for s in steps if s.endswith("(check)"))
        print(f"{name}: {checks} check{'s' if checks != 1 else ''} of the budget")
        for s in steps:
            print(f"  {s}")


if __name__ == "__main__":
    main()
