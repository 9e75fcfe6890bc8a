"""The "planners side by side" section: where one setting, backend and devices ran two or more planners
(batching=peers), each planner's plan (steps against the lower bound, pad efficiency, modeled and measured critical
path) beside what it measured (fwd+bwd tok/s and the paired speedup over mbs=1, each with its interval) and its speedup
as a share of the balanced planner's at the same budget."""

from __future__ import annotations

from typing import Optional

import pandas as pd

import harness.peers  # noqa: F401  (registers the peers' planners: planner_names() is ours, then theirs)
from balance_batch.planners import planner_names
from harness.app.batching import KEYS
from reports.collect import BACKEND_LABEL, settings_of
from reports.render import (
    _critical_path,
    _is_baseline,
    _missing,
    _speedup_cell,
    _status,
    _text,
    _tok_cell,
    speedups,
    sweep_of,
)

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
    names = planner_names()  # ours (PLANNERS), then the peers in harness.peers' order
    return names.index(planner) if planner in names else len(names)


# What a row's reference (the balanced planner's row at its budget) shares with it where there is a choice: its sweep,
# then its layout, cap on sequences and cost model (a peer's padded row beside balanced padded where that ran).
MATCH = ("sweep", "layout", "max_seqs_per_microbatch", "cost_model")


def _same(a, b) -> bool:
    return (_missing(a) and _missing(b)) or a == b


def reference_of(sub: pd.DataFrame, i) -> Optional[int]:
    """The balanced row row ``i`` is divided by: itself when it is one, else the balanced rows at its budget narrowed
    by ``MATCH`` (each key only where some share it); None where none ran or several remain alike."""
    if sub.at[i, "planner"] == REFERENCE:
        return i
    pool = [j for j in sub.index if sub.at[j, "planner"] == REFERENCE and sub.at[j, "mtpm"] == sub.at[i, "mtpm"]]
    for key in MATCH:
        alike = [j for j in pool if _same(sub.at[j, key], sub.at[i, key])]
        pool = alike or pool
    return pool[0] if len(pool) == 1 else None


def _frame(sub: pd.DataFrame, speed: pd.Series) -> pd.DataFrame:
    """One setting, backend and devices' rows, by budget then planner (ours, then the peers': planner_names())."""
    keys = [k for k in KEYS if k in sub and (k in ALWAYS or sub[k].astype(str).nunique() > 1)]
    order = sorted(sub.index, key=lambda i: (sub.at[i, "mtpm"], _planner_order(sub.at[i, "planner"])))
    rows = []
    for i in order:
        r = next(sub.loc[[i]].itertuples(index=False))
        ref = reference_of(sub, i)
        rows.append([*(_key_cell(r, k) for k in keys), _steps(r),
                     "—" if _missing(r.pad_efficiency) else f"{100 * r.pad_efficiency:.1f}%",
                     _critical_path(r), _tok_cell(r, "forward_backward"), _speedup_cell(r, speed[i]),
                     _versus(speed[i], None if ref is None else speed[ref]), _status(r, None)])
    columns = [*keys, "steps / bound", "pad efficiency", "critical path (model / measured)", "fwd+bwd tok/s",
               "speedup vs mbs=1", f"speedup ÷ {REFERENCE}'s", "status"]
    return pd.DataFrame(rows, columns=columns)


def side_by_side(df: pd.DataFrame) -> str:
    """The section's markdown, or "" where no setting, backend and devices ran two planners at a budget."""
    if df.empty or "planner" not in df:
        return ""
    df = df.assign(sweep=[sweep_of(r) for r in df.itertuples(index=False)])
    speed = pd.Series(speedups(df), index=df.index)
    parts = []
    for setting in settings_of(df):
        mine = df[df["setting"] == setting]
        for backend, devices in dict.fromkeys(zip(mine["backend"], mine["devices"])):
            if _missing(backend):
                continue
            sub = mine[(mine["backend"] == backend) & mine["devices"].map(lambda d, want=devices: _same(d, want))]
            sub = sub[[not _is_baseline(r) and not _missing(r.mtpm) for r in sub.itertuples(index=False)]]
            if sub["planner"].nunique() < 2:
                continue
            label = BACKEND_LABEL.get(backend, str(backend))
            on = "" if _missing(devices) else f" on {devices}"
            parts.append(f"{label}{on}, measured on {setting}. Speedups are paired with the same mbs=1 passes; the "
                         f"last column is each planner's speedup ÷ the {REFERENCE} planner's at the same budget (and "
                         "the same layout, cap and cost model where it ran several).\n\n"
                         + _frame(sub, speed).to_markdown(index=False, disable_numparse=True))
    return "\n\n".join([TITLE, *parts]) if parts else ""


def with_side_by_side(tables: str, df: pd.DataFrame) -> str:
    """The report's tables, then the side-by-side section where there is one."""
    section = side_by_side(df)
    return f"{tables}\n\n{section}" if section else tables
