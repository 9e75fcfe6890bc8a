"""The "planners side by side" section: where one setting and backend ran two or more planners (batching=peers), each
planner's plan (steps against the lower bound, pad efficiency, modeled and measured critical path) beside what it
measured (fwd+bwd tok/s and the paired speedup over mbs=1, each with its interval) and its speedup as a share of the
balanced planner's at the same budget."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from balance_batch import PLANNERS
from harness.app.batching import KEYS
from reports.collect import BACKEND_LABEL, settings_of
from reports.render import _critical_path, _is_baseline, _missing, _speedup_cell, _status, _text, _tok_cell, speedups

TITLE = "## Planners side by side"
REFERENCE = "balanced"
ALWAYS = ("mtpm", "planner", "layout")  # of the batching keys, shown even where they do not vary


def _key_cell(r, key: str) -> str:
    value = getattr(r, key, None)
    return f"{int(value):,}" if key in ("mtpm", "mbs") and not _missing(value) else _text(value)


def _steps(r) -> str:
    if _missing(r.steps):
        return "—"
    return f"{int(r.steps)}" + ("" if _missing(r.lower_bound_steps) else f" / {int(r.lower_bound_steps)}")


def _versus(speedup: Optional[float], reference: Optional[float]) -> str:
    if _missing(speedup) or _missing(reference) or not reference:
        return "—"
    return f"{speedup / reference:.3f}"


def _planner_order(planner) -> int:
    return PLANNERS.index(planner) if planner in PLANNERS else len(PLANNERS)


def _frame(sub: pd.DataFrame, speed: pd.Series) -> pd.DataFrame:
    """One setting and backend's rows, by budget then planner (PLANNERS' order)."""
    keys = [k for k in KEYS if k in sub and (k in ALWAYS or sub[k].astype(str).nunique() > 1)]
    order = sorted(sub.index, key=lambda i: (sub.at[i, "mtpm"], _planner_order(sub.at[i, "planner"])))
    reference = {}
    for i in order:
        if sub.at[i, "planner"] == REFERENCE and not _missing(speed[i]):
            reference[sub.at[i, "mtpm"]] = speed[i]
    rows = []
    for i in order:
        r = next(sub.loc[[i]].itertuples(index=False))
        rows.append([*(_key_cell(r, k) for k in keys), _steps(r),
                     "—" if _missing(r.pad_efficiency) else f"{100 * r.pad_efficiency:.1f}%",
                     _critical_path(r), _tok_cell(r, "forward_backward"), _speedup_cell(r, speed[i]),
                     _versus(speed[i], reference.get(r.mtpm)), _status(r, None)])
    columns = [*keys, "steps / bound", "pad efficiency", "critical path (model / measured)", "fwd+bwd tok/s",
               "speedup vs mbs=1", f"speedup ÷ {REFERENCE}'s", "status"]
    return pd.DataFrame(rows, columns=columns)


def side_by_side(df: pd.DataFrame) -> str:
    """The section's markdown, or "" where no setting and backend ran two planners at a budget."""
    if df.empty or "planner" not in df:
        return ""
    speed = pd.Series(speedups(df), index=df.index)
    parts = []
    for setting in settings_of(df):
        for backend in sorted(df.loc[df["setting"] == setting, "backend"].dropna().unique()):
            sub = df[(df["setting"] == setting) & (df["backend"] == backend)]
            sub = sub[[not _is_baseline(r) and not _missing(r.mtpm) for r in sub.itertuples(index=False)]]
            if sub["planner"].nunique() < 2:
                continue
            label = BACKEND_LABEL.get(backend, str(backend))
            parts.append(f"{label}, measured on {setting}. Speedups are paired with the same mbs=1 passes; the last "
                         f"column is each planner's speedup ÷ the {REFERENCE} planner's at the same budget.\n\n"
                         + _frame(sub, speed).to_markdown(index=False, disable_numparse=True))
    return "\n\n".join([TITLE, *parts]) if parts else ""


def with_side_by_side(tables: str, df: pd.DataFrame) -> str:
    """The report's tables, then the side-by-side section where there is one."""
    section = side_by_side(df)
    return f"{tables}\n\n{section}" if section else tables
