"""The markdown table, the README block between its markers, and the CSV."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from harness.metrics.spread import WIDE_PCT, choose, interval_text, tie_text
from reports.collect import BACKEND_LABEL, settings_of

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
STATUS_LABEL = {"ok": "ok", "oom": "OOM", "error": "error", "timeout": "timeout", "planned": "planned"}

COLUMNS = [
    "backend",
    "devices",
    "mbs",
    "mtpm",
    "planner",
    "layout",
    "fwd tok/s",
    "util (fwd)",
    "fwd+bwd tok/s",
    "util (fwd+bwd)",
    "speedup (fwd+bwd vs mbs 1)",
    "MFU (fwd+bwd)",
    "peak mem %",
    "peak mem per rank (GiB)",
    "pad efficiency",
    "critical path (model / measured)",
    "idle % per rank (model / measured)",
    "micro-batches per rank",
    "status",
]


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _int(x) -> str:
    return "—" if _missing(x) else f"{x:,.0f}"


def _pct(x, digits: int = 0) -> str:
    return "—" if _missing(x) else f"{x:.{digits}f}%"


def _gib_per_rank(peaks) -> str:
    if not isinstance(peaks, (list, tuple)) or not any(p is not None for p in peaks):
        return "—"
    return ", ".join("?" if p is None else f"{p / 1024**3:.2f}" for p in peaks)


def _microbatches(n_mb, n_dummy) -> str:
    if not isinstance(n_mb, (list, tuple)) or not n_mb:
        return "—"
    text = ", ".join(str(n) for n in n_mb)
    dummies = sum(n_dummy or [])
    return f"{text} (+{dummies} dummy)" if dummies else text


def _measured(r, key: str):
    """fwd+bwd's measured ``key`` (from the ranks' step times), None where the run recorded none."""
    value = getattr(r, f"forward_backward_{key}", None)
    if isinstance(value, (list, tuple)):
        return list(value) or None
    return None if _missing(value) else value


def _critical_path(r) -> str:
    """Modeled / measured (fwd+bwd): the plan's critical path beside the one its ranks' step times give."""
    if _missing(r.critical_path):
        return "—"
    measured = _measured(r, "measured_critical_path")
    return f"{r.critical_path:.3f}" + ("" if measured is None else f" / {measured:.3f}")


def _percents(values) -> str:
    return ", ".join(f"{100 * v:.1f}" for v in values)


def _idle(r) -> str:
    """Each rank's idle share of the pass, modeled / measured (fwd+bwd); either side "—" where not recorded."""
    modeled = getattr(r, "idle_fraction", None)
    modeled = modeled if isinstance(modeled, (list, tuple)) and modeled else None
    measured = _measured(r, "idle_fraction")
    if modeled is None and measured is None:
        return "—"
    return f"{_percents(modeled) if modeled else '—'} / {_percents(measured) if measured else '—'}"


def _text(x) -> str:
    return "—" if _missing(x) or x == "" else str(x)


def _status(r, base: Optional[Path]) -> str:
    """The status cell; an unreadable row names its file (the table has no other way to say which point it is)."""
    if _missing(r.status):
        return "—"
    if r.status == "unreadable":
        shown = Path(os.path.relpath(r.path, base)) if base is not None else Path(r.path)
        return f"unreadable: {shown.as_posix()}"
    label = STATUS_LABEL.get(r.status, str(r.status))
    shares = getattr(r, "shares_mtpm", None)
    noisy = ", noisy" if is_noisy(r) else ""
    if r.status == "ok" and not _missing(shares):
        return f"{label}{noisy} (shares {shares}'s measurement: same plan)"
    return label + noisy


def _figure_link(png, base: Optional[Path], text: str) -> str:
    if _missing(png):
        return "—"
    link = Path(os.path.relpath(png, base)) if base is not None else Path("plots") / Path(png).name
    return f"[{text}]({link.as_posix()})"


def _plan_link(png, base: Optional[Path]) -> str:
    return _figure_link(png, base, "plan")


def _is_baseline(r) -> bool:
    """The row every other is compared with: fixed micro-batches of one sequence, measured (never an mtpm=auto row)."""
    return (_missing(r.mtpm) and not _missing(r.mbs) and int(r.mbs) == 1 and r.status == "ok"
            and _auto_of(r) is None)


def _auto_of(r) -> Optional[dict]:
    auto = getattr(r, "auto", None)
    return auto if isinstance(auto, dict) else None


def sweep_of(r) -> Optional[str]:
    """The folder a row's point lies in (a multirun's, or a run folder's parent): a combined report's rows each compare
    with their own sweep's mbs=1 row."""
    return None if _missing(getattr(r, "path", None)) else str(Path(r.path).parent.parent)


def baselines(df: pd.DataFrame) -> dict:
    """(setting, backend, sweep) → the fwd+bwd tok/s of the sweep's mbs=1 row, else of the mbs=1 run its mtpm=auto
    search measured; (setting, backend, None) → the first such of any sweep (for a sweep without one)."""
    base = {}
    for r in df.itertuples(index=False):
        if _is_baseline(r) and not _missing(r.forward_backward_tok_per_s):
            for sweep in (sweep_of(r), None):
                base.setdefault((r.setting, r.backend, sweep), r.forward_backward_tok_per_s)
    for r in df.itertuples(index=False):
        searched = (_auto_of(r) or {}).get("baseline") or {}
        if searched.get("status") == "ok" and searched.get("tok_per_s"):
            for sweep in (sweep_of(r), None):
                base.setdefault((r.setting, r.backend, sweep), searched["tok_per_s"])
    return base


def _paired(r) -> Optional[dict]:
    """A row's speedup measured in pairs beside mbs=1 passes (results.json ``speedup``), or None."""
    speed = getattr(r, "paired_speedup", None)
    return speed if isinstance(speed, dict) and speed.get("median") is not None else None


def speedups(df: pd.DataFrame) -> list[Optional[float]]:
    """Each row's fwd+bwd speedup over mbs=1: the median of its pairs where it was measured in pairs, else its tok/s ÷
    that of the same setting's and backend's mbs=1 row of its own sweep (of another sweep where its own has none),
    measured at another time (None without one)."""
    base = baselines(df)
    out = []
    for r in df.itertuples(index=False):
        paired = _paired(r)
        if paired is not None and r.status == "ok":
            out.append(paired["median"])
            continue
        ref = base.get((r.setting, r.backend, sweep_of(r)), base.get((r.setting, r.backend, None)))
        ok = ref and r.status == "ok" and not _missing(r.forward_backward_tok_per_s)
        out.append(r.forward_backward_tok_per_s / ref if ok else None)
    return out


def _pairs(paired: dict) -> int:
    return paired.get("n") or len(paired.get("pairs") or [])


def _speedup_cell(r, speedup: Optional[float]) -> str:
    """"1.38× (95% 1.27–1.43, 3 pairs)" measured in pairs, "1.38× (unpaired)" from the mbs=1 row, the baseline's own.

    A speedup's interval is always shown by its bounds: it is the interval of the pairs' geometric mean, while the
    figure before it is their median, so "±x%" after the median would describe an interval around another centre
    (0.95× ±19.8% read as 0.76–1.14 where the interval was 0.86–1.23)."""
    if _missing(speedup):
        return "—"
    if _is_baseline(r):
        return "1.00× (baseline)"
    paired = _paired(r)
    if paired is not None:
        n = _pairs(paired)
        count = f"{'only ' if n == 2 else ''}{n} pair{'' if n == 1 else 's'}"
        ci = paired.get("ci")
        bounds = f"95% {ci[0]:.2f}–{ci[1]:.2f}, " if isinstance(ci, (list, tuple)) and len(ci) == 2 else ""
        return f"{speedup:.2f}× ({bounds}{count})"
    return f"{speedup:.2f}× (unpaired)"


def _repeats(r, pass_type: str) -> Optional[int]:
    n = getattr(r, f"{pass_type}_repeats", None)
    return None if _missing(n) else int(n)


def _tok_cell(r, pass_type: str) -> str:
    """A pass's tok/s with its interval: "10,874 ±2.3%", a wide one by its bounds (repeats written before intervals:
    the number)."""
    tok = getattr(r, f"{pass_type}_tok_per_s")
    if _missing(tok):
        return "—"
    return f"{tok:,.0f}{interval_text(getattr(r, f'{pass_type}_tok_per_s_ci', None), _repeats(r, pass_type))}"


def _two_values(r) -> bool:
    """A row with an interval made of two values (2 repeats or 2 pairs): t(1) = 12.7 makes it wide."""
    paired = _paired(r)
    return (any(_repeats(r, p) == 2 for p in ("forward", "forward_backward"))
            or (paired is not None and _pairs(paired) == 2))


TWO_VALUES_NOTE = ("Only 2 repeats (or pairs): the 95% interval of two values multiplies their spread by Student's "
                   "t(1) = 12.7, so it is wide whatever the machine did; intervals wider than "
                   f"±{WIDE_PCT:.0f}% show their bounds (they are lopsided, never below zero). "
                   "Raise bench.repeat to 3 or more for a usable interval.")


def is_noisy(r) -> bool:
    """A measured row whose fwd or fwd+bwd repeats, or whose speedup's pairs, spread more than 10% (max / min)."""
    paired = _paired(r) or {}
    flags = (getattr(r, "forward_noisy", None), getattr(r, "forward_backward_noisy", None), paired.get("noisy"))
    return r.status == "ok" and any(not _missing(f) and bool(f) for f in flags)


NOISY_NOTE = ("Noisy: a pass's timed repeats, or its speedup's pairs, spread more than 10% (largest ÷ smallest): rerun "
              "on a quiet machine, or raise bench.repeat (or set bench.target_ci_pct).")


def _cap(r) -> Optional[int]:
    """A row's cap on sequences per micro-batch; None: no cap (every result written before the cap existed)."""
    cap = getattr(r, "max_seqs_per_microbatch", None)
    return None if _missing(cap) else int(cap)


def _gib(n) -> str:
    return f"{n / 1024**3:.1f} GiB"


def _setting_phrase(r) -> str:
    """What to set: "mtpm=32,768 (balanced, packed)", "mbs=1"; a cap on sequences per micro-batch after it."""
    cap = _cap(r)
    seqs = "" if cap is None else f" max_seqs_per_microbatch={cap}"
    if _missing(r.mtpm):
        return f"mbs={int(r.mbs)}{seqs}"
    calibrated = ", cost_model=calibrated" if getattr(r, "cost_model", None) == "calibrated" else ""
    return f"mtpm={int(r.mtpm):,}{seqs} ({r.planner}, {r.layout}{calibrated})"


def _answer(r, speedup: Optional[float], n_measured: int, tie: str = "") -> str:
    """A backend's answer: what to set, how fast it ran, against mbs=1, and its memory (of the limit, for auto);
    ``tie``: the settings it could not be told apart from, and the rule that chose it."""
    parts = [f"{r.forward_backward_tok_per_s:,.0f} tok/s fwd+bwd"]
    paired = _paired(r)
    ci = (paired or {}).get("ci")
    if paired is not None and not _is_baseline(r):
        interval = f", 95% interval {ci[0]:.2f}–{ci[1]:.2f}" if ci else ""
        parts.append(f"{speedup:.2f}× mbs=1 ({len(paired.get('pairs') or [])} pairs{interval})")
    else:
        parts.append("no mbs=1 run to compare with" if _missing(speedup) else
                     "the mbs=1 baseline" if _is_baseline(r) else f"{speedup:.2f}× mbs=1")
    peaks = [p for p in (r.peak_mem_bytes_per_rank or []) if p is not None] if isinstance(
        r.peak_mem_bytes_per_rank, (list, tuple)) else []
    auto = _auto_of(r)
    limit = (auto or {}).get("limit_bytes")
    if peaks:
        parts.append(f"peak {_gib(max(peaks))}" + (f" of {_gib(limit)}" if limit else " per rank"))
    if ci and ci[0] <= 1.0 <= ci[1] and not _is_baseline(r):
        parts.append("not told apart from mbs=1 here (its interval holds 1.0)")
    elif not _missing(speedup) and speedup < 1 and not _is_baseline(r):
        parts.append("mbs=1 ran faster: no budget pays here")
    if is_noisy(r):
        parts.append("noisy")
    searched_tie = (auto or {}).get("tie")
    if searched_tie:  # mtpm=auto settled a tie among its candidates (harness/auto/run.py)
        tie = tie_text([f"mtpm={m:,}" for m in searched_tie["with"]], searched_tie["rule"], searched_tie.get("pairs"))
    if tie:
        parts.append(tie)
    if auto:
        # measured: ran to the end, ran out of memory, or ran and peaked over the limit
        tried = [c for c in auto.get("candidates") or []
                 if c.get("status") in ("ok", "oom") or c.get("measured_peak_bytes") is not None]
        how = (f"mtpm=auto: {'chosen' if tie else 'the fastest'} of {len(tried)} budgets measured, "
               f"of {len(auto.get('candidates') or [])} distinct plans")
    else:
        how = f"{'chosen' if tie else 'the fastest'} of {n_measured} measured settings"
    return f"{BACKEND_LABEL.get(r.backend, str(r.backend))}: set {_setting_phrase(r)}: {', '.join(parts)} ({how})"


def fastest_lines(df: pd.DataFrame) -> list[str]:
    """The answer, one line per backend (and setting): what to set, from its mtpm=auto row when there is one, else
    the fastest fwd+bwd row against mbs=1 (a speedup measured in pairs ranks by its pairs: a point measured while
    the machine ran fast does not win on that); its speed against mbs=1 and its peak memory."""
    if df.empty:
        return []
    df = df.assign(speedup=speedups(df))
    lines = []
    for _, sub in df.groupby(["setting", "backend"], sort=False):
        ok = sub[(sub["status"] == "ok") & sub["forward_backward_tok_per_s"].notna()]
        if ok.empty:
            continue
        searched = ok[ok["auto"].map(lambda a: isinstance(a, dict))] if "auto" in ok else ok.iloc[:0]
        pool = searched if not searched.empty else ok
        by_pairs = bool(pool["speedup"].notna().all())
        pick, tied, rule = choose(_options(pool, by_pairs), floor=1.0 if by_pairs else None)
        best = pool.iloc[pick]
        # a row sharing another's measurement (same plan) is that row again: not named as a setting of its own
        names = [_setting_phrase(pool.iloc[i]) for i in tied if _missing(pool.iloc[i].get("shares_mtpm"))]
        tie = tie_text(names, rule) if names else ""
        measured = ok["shares_mtpm"].isna().sum() if "shares_mtpm" in ok else len(ok)  # shared rows measured nothing
        lines.append(_answer(best, best.speedup, int(measured), tie))
    return lines


def _options(pool: pd.DataFrame, by_pairs: bool) -> list[dict]:
    """What ``choose`` ranks a backend's rows by: the paired speedup and its interval where every row was paired,
    else the fwd+bwd tok/s and its interval; each row's peak memory and budget for a tie."""
    out = []
    for r in pool.itertuples(index=False):
        ci = (_paired(r) or {}).get("ci") if by_pairs else r.forward_backward_tok_per_s_ci
        peaks = r.peak_mem_bytes_per_rank if isinstance(r.peak_mem_bytes_per_rank, (list, tuple)) else []
        known = [p for p in peaks if p is not None]
        out.append({"median": float(r.speedup if by_pairs else r.forward_backward_tok_per_s),
                    "ci": list(ci) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None,
                    "peak_bytes": max(known) if known else None, "budget": None if _missing(r.mtpm) else r.mtpm})
    return out


def _never_planned(r) -> bool:
    """A point refused or failed before it planned: its row says what it was asked, as its results.json records it."""
    return r.status not in ("ok", "planned") and _missing(getattr(r, "steps", None))


def _mbs_cell(r, budget: bool) -> str:
    """mbs where it cuts the batch (no budget); beside a budget only on a point that never planned and was asked for
    another than the default 1: ``mbs=2 mtpm=4096``, refused as a contradiction, shows both."""
    if _missing(r.mbs) or (budget and not (_never_planned(r) and int(r.mbs) != 1)):
        return "—"
    return f"{int(r.mbs)}"


def table_frame(df: pd.DataFrame, base: Optional[Path] = None) -> pd.DataFrame:
    """The displayed table: one formatted row per run, in ``df``'s order.

    A ``plan_png`` column (set where runs left a plan.json) adds a "plan" column
    linking each row's plan figure, relative to ``base`` (the markdown file's folder).
    A "max seqs" column after the layout is there only when a row capped its sequences per micro-batch.
    """
    rows = []
    for r, speedup in zip(df.itertuples(index=False), speedups(df)):
        budget = not _missing(r.mtpm)
        searched = _auto_of(r) is not None  # mtpm=auto: "auto" until a budget is chosen, then the chosen one
        rows.append(
            [
                "—" if _missing(r.backend) else BACKEND_LABEL.get(r.backend, str(r.backend)),
                _text(r.devices),
                _mbs_cell(r, budget or searched),
                (f"{int(r.mtpm):,}" + (" (auto)" if searched else "")) if budget else "auto" if searched else "—",
                _text(r.planner),
                _text(r.layout),
                _tok_cell(r, "forward"),
                _pct(r.forward_util_pct),
                _tok_cell(r, "forward_backward"),
                _pct(r.forward_backward_util_pct),
                _speedup_cell(r, speedup),
                _pct(getattr(r, "forward_backward_mfu_pct", None), 2),
                _pct(r.peak_mem_pct, 1),
                _gib_per_rank(r.peak_mem_bytes_per_rank),
                _pct(None if _missing(r.pad_efficiency) else 100 * r.pad_efficiency, 1),
                _critical_path(r),
                _idle(r),
                _microbatches(r.n_microbatches, r.n_dummy),
                _status(r, base),
            ]
        )
    frame = pd.DataFrame(rows, columns=COLUMNS)
    models = [getattr(r, "cost_model", None) for r in df.itertuples(index=False)]
    if any(m == "calibrated" for m in models):  # only where a row balanced calibrated seconds: others read as before
        frame.insert(COLUMNS.index("planner") + 1, "cost model", [_text(m) for m in models])
    caps = [_cap(r) for r in df.itertuples(index=False)]
    if any(c is not None for c in caps):  # only where a row has a cap: tables of uncapped runs read as they always did
        frame.insert(COLUMNS.index("layout") + 1, "max seqs", ["—" if c is None else str(c) for c in caps])
    if "plan_png" in df and df["plan_png"].notna().any():
        frame["plan"] = [_plan_link(png, base) for png in df["plan_png"]]
    if "profile_png" in df and df["profile_png"].notna().any():  # bench.profile: where the pass's time went
        frame["profile"] = [_figure_link(png, base, "profile") for png in df["profile_png"]]
    return frame


def markdown_tables(df: pd.DataFrame, base: Optional[Path] = None) -> str:
    """One table per setting (devices, model, workload, protocol), each under its label (plan links relative to
    ``base``)."""
    if df.empty:
        return "_No results._"
    return "\n\n".join(_setting_sections(df, base, table_frame, histogram=True))


def _setting_sections(df: pd.DataFrame, base: Optional[Path], frame, histogram: bool) -> list[str]:
    """Per setting: the answer lines (what to set per backend), the setting's label (with its length histogram when
    ``histogram``), the table ``frame`` makes of its rows, and the notes its rows need."""
    parts = []
    for setting in settings_of(df):
        sub = df[df["setting"] == setting]
        label = f"Measured on {setting}." if setting else "Setting not recorded."  # unreadable results.json
        answers = fastest_lines(sub)  # the answer first: what to set per backend, then the table it comes from
        text = "".join(f"- {line}\n" for line in answers) + ("\n" if answers else "")
        hist = sub["lengths_png"].dropna() if histogram and "lengths_png" in sub else ()
        if len(hist):  # the setting's workload drawn (reports/plots.py: draw_length_histogram)
            label += f" Sequence lengths: {_figure_link(hist.iloc[0], base, 'histogram')}."
        text += f"{label}\n\n" + frame(sub, base).to_markdown(index=False, disable_numparse=True)
        if any(is_noisy(r) for r in sub.itertuples(index=False)):
            text += "\n\n" + NOISY_NOTE
        if any(_two_values(r) for r in sub.itertuples(index=False)):
            text += "\n\n" + TWO_VALUES_NOTE
        reasons = failure_lines(sub, base)
        if reasons:
            text += "\n\nWhy points did not finish:\n\n" + "\n".join(f"- {line}" for line in reasons)
        parts.append(text)
    return parts


FAILED = ("oom", "error", "timeout", "died", "interrupted", "running")
REASON_CHARS = 300  # a reason longer than this is cut (results.json and the point's error.txt hold it whole)


def _point_name(r, base: Optional[Path]) -> str:
    """The point's folder as the report names it: relative to ``base`` (its markdown file's folder) where given."""
    folder = Path(r.path).parent
    return (Path(os.path.relpath(folder, base)) if base is not None else folder).as_posix()


def failure_lines(df: pd.DataFrame, base: Optional[Path] = None) -> list[str]:
    """Per point that did not finish (refused, out of memory, failed, timed out): what it was asked to run, its folder
    and the first line of the reason its results.json records."""
    lines = []
    for r in df.itertuples(index=False):
        if r.status not in FAILED or _missing(r.error) or not str(r.error).strip():
            continue
        reason = str(r.error).strip().splitlines()[0]
        reason = reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"
        backend = "—" if _missing(r.backend) else BACKEND_LABEL.get(r.backend, str(r.backend))
        asked = "mtpm=auto" if _auto_of(r) is not None and _missing(r.mtpm) else _asked_phrase(r)
        lines.append(f"{backend} {asked} (`{_point_name(r, base)}`): {STATUS_LABEL.get(r.status, r.status)}: "
                     f"{reason}")
    return lines


def _asked_phrase(r) -> str:
    """``_setting_phrase``, with the mbs a never-planned point was asked for beside its budget (see ``_mbs_cell``)."""
    if _missing(r.mtpm) and _missing(r.mbs):
        return "—"
    phrase = _setting_phrase(r)
    return f"mbs={int(r.mbs)} {phrase}" if not _missing(r.mtpm) and _mbs_cell(r, True) != "—" else phrase


SHORT_COLUMNS = ["backend", "batching", "fwd+bwd tok/s", "speedup vs mbs=1", "peak GiB (largest rank)",
                 "pad efficiency", "status"]


def _batching_cell(r) -> str:
    """What a row ran, in one cell: "mbs 1", "16,384 balanced packed", "auto: 16,384 balanced packed"."""
    searched = _auto_of(r) is not None
    if _missing(r.mtpm):
        text = "auto" if searched else "—" if _missing(r.mbs) else f"mbs {int(r.mbs)}"
    else:
        text = f"{'auto: ' if searched else ''}{int(r.mtpm):,} {_text(r.planner)} {_text(r.layout)}"
        if _mbs_cell(r, True) != "—":  # a point refused for asking both (see _mbs_cell)
            text = f"mbs {int(r.mbs)}, {text}"
    if getattr(r, "cost_model", None) == "calibrated":
        text += " calibrated"
    cap = _cap(r)
    return text if cap is None else f"{text}, ≤ {cap} seqs"


def _largest_gib(peaks) -> str:
    known = [p for p in peaks if p is not None] if isinstance(peaks, (list, tuple)) else []
    return f"{max(known) / 1024**3:.2f}" if known else "—"


def _short_status(r, base: Optional[Path]) -> str:
    """The status cell, a shared measurement said in a few words (the full table says it in full)."""
    shares = getattr(r, "shares_mtpm", None)
    if r.status != "ok" or _missing(shares):
        return _status(r, base)
    return f"ok{', noisy' if is_noisy(r) else ''} (same plan as {shares})"


def short_frame(df: pd.DataFrame, base: Optional[Path] = None) -> pd.DataFrame:
    """The README's table: seven columns a page shows without scrolling (every column: ``table_frame``)."""
    rows = [[BACKEND_LABEL.get(r.backend, str(r.backend)) if not _missing(r.backend) else "—", _batching_cell(r),
             _tok_cell(r, "forward_backward"), _speedup_cell(r, speedup), _largest_gib(r.peak_mem_bytes_per_rank),
             _pct(None if _missing(r.pad_efficiency) else 100 * r.pad_efficiency, 1), _short_status(r, base)]
            for r, speedup in zip(df.itertuples(index=False), speedups(df))]
    return pd.DataFrame(rows, columns=SHORT_COLUMNS)


def short_tables(df: pd.DataFrame, base: Optional[Path], full_link: str) -> str:
    """Per setting: the answer lines, the setting, the short table; then where every column is."""
    if df.empty:
        return "_No results._"
    parts = _setting_sections(df, base, short_frame, histogram=False)
    parts.append(f"Every column (forward pass, utilisation, MFU, critical path, idle, micro-batches, plan figures): "
                 f"{full_link}.")
    return "\n\n".join(parts)


def _generated(command: str) -> str:
    return f"<!-- generated by `{command}`; edit the results, not this block -->"


def short_block(df: pd.DataFrame, readme: Path, full: Path, source: str, command: str) -> str:
    """The README's block when the full table has a page of its own (``full``): answers and the short table;
    ``command`` regenerates both."""
    link = Path(os.path.relpath(full, readme.parent)).as_posix()
    return "\n".join([
        BEGIN,
        _generated(command),
        "",
        short_tables(df, readme.parent, f"[{link}]({link})"),
        "",
        f"Source: `{source}`.",
        END,
    ])


def readme_block(df: pd.DataFrame, plots: Sequence[Path], readme: Optional[Path], source: str,
                 plan_lines: Sequence[str] = (), command: str = "python -m reports --readme README.md") -> str:
    """The text between a page's markers: tables, their source, links to the plots, then ``plan_lines``; ``command``
    regenerates it."""
    base = readme.parent if readme is not None else Path.cwd()
    links = " ".join(f"![{p.stem.replace('_', ' ')}]({Path(os.path.relpath(p, base)).as_posix()})" for p in plots)
    lines = [
        BEGIN,
        _generated(command),
        "",
        markdown_tables(df, base),
        "",
        f"Source: `{source}`.",
    ]
    if links:
        lines += ["", links]
    lines += list(plan_lines)
    lines.append(END)
    return "\n".join(lines)


def block_span(text: str) -> Optional[tuple[int, int]]:
    """Where the results block (both markers included) is in ``text``; None without BEGIN followed by END."""
    start = text.find(BEGIN)
    end = text.find(END, start + len(BEGIN)) if start >= 0 else -1
    return (start, end + len(END)) if end >= 0 else None


def no_block_message(path: Path, verb: str = "rewrite") -> str:
    return (f"{path}: no results block to {verb}; add the lines '{BEGIN}' and '{END}' (in that order) where the "
            "table goes")


def current_block(text: str) -> Optional[str]:
    span = block_span(text)
    return text[span[0] : span[1]] if span else None


def replace_block(text: str, block: str, path: Path) -> str:
    span = block_span(text)
    if span is None:
        raise ValueError(no_block_message(path))
    return text[: span[0]] + block + text[span[1] :]


def portable_path(path, base: Path) -> str:
    """``path`` relative to ``base`` (POSIX) when it lies under it, else absolute: what a CSV in ``base`` names a run
    by."""
    full = Path(path).resolve()
    try:
        return full.relative_to(Path(base).resolve()).as_posix()
    except ValueError:
        return str(full)


def write_csv(df: pd.DataFrame, path: Path, base: Optional[Path] = None) -> None:
    """The frame as CSV; ``path`` relative to ``base`` (default: the CSV's folder), so another clone writes the same
    file."""
    # figures' paths on this machine, not measurements; the repeat counts only say how a cell shows its interval
    out = df.drop(columns=["plan_png", "lengths_png", "profile_png", "forward_repeats", "forward_backward_repeats"],
                  errors="ignore")
    if "auto" in out:  # the search's summary as JSON (results.json has it whole)
        import json

        out["auto"] = out["auto"].map(lambda a: json.dumps(a, sort_keys=True) if isinstance(a, dict) else None)
    base = Path(path).parent if base is None else base
    out["path"] = out["path"].map(lambda p: p if _missing(p) else portable_path(p, base))
    for col in ("n_microbatches", "n_dummy", "forward_mem_peak_bytes", "forward_backward_mem_peak_bytes",
                "peak_mem_bytes_per_rank", "idle_fraction", "forward_idle_fraction", "forward_backward_idle_fraction",
                "forward_tok_per_s_ci", "forward_backward_tok_per_s_ci"):
        out[col] = out[col].map(lambda v: " ".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
    if "paired_speedup" in out:  # the speedup's median, interval and pairs as columns; results.json has it whole
        speed = out.pop("paired_speedup")
        out["speedup_median"] = speed.map(lambda d: d.get("median") if isinstance(d, dict) else None)
        out["speedup_ci"] = speed.map(lambda d: " ".join(map(str, d["ci"])) if isinstance(d, dict) and d.get("ci")
                                      else None)
        out["speedup_pairs"] = speed.map(lambda d: " ".join(map(str, d.get("pairs") or [])) if isinstance(d, dict)
                                         else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(path, index=False)
