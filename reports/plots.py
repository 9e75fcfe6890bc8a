"""Plots: tok/s against mtpm per setting, backend and devices, pass, planner, layout, cap and cost model (fixed-mbs
runs as reference lines), pad efficiency against mtpm."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from reports.collect import BACKEND_LABEL, PASSES

PLOT_FILES = ("tok_per_s.png", "pad_efficiency.png")
MARKERS = ("o", "s", "^", "D")
PASS_TITLE = {"forward": "forward", "forward_backward": "forward + backward"}


def _lines(frame: pd.DataFrame):
    """One line per planner, layout, cap on sequences per micro-batch and cost model: (its label, its points).

    No cap (every run before the cap existed) is a group of its own, labelled as lines always were; so is the FLOP
    cost model (a calibrated one adds "calibrated" to the label).
    """
    cap = frame["max_seqs_per_microbatch"] if "max_seqs_per_microbatch" in frame else float("nan")
    cost = frame["cost_model"].fillna("flops") if "cost_model" in frame else "flops"
    for (planner, layout, n, model), pts in frame.assign(cap=cap, cost=cost).groupby(
            ["planner", "layout", "cap", "cost"], sort=True, dropna=False):
        yield (f"{planner} {layout}" + ("" if pd.isna(n) else f" ≤{int(n)} seqs")
               + ("" if model == "flops" else f" {model}")), pts


def _measured(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def _planned_budgets(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["mtpm"].notna() & df["pad_efficiency"].notna()]


def plot_paths(out_dir: Path, df: Optional[pd.DataFrame] = None) -> list[Path]:
    """The figures ``write_plots`` draws of ``df`` (all of them without one): tok/s only where a point was measured,
    pad efficiency only where a budget planned; a figure with nothing to show is neither drawn nor linked."""
    has = {"tok_per_s.png": df is None or not _measured(df).empty,
           "pad_efficiency.png": df is None or not _planned_budgets(df).empty}
    return [out_dir / "plots" / name for name in PLOT_FILES if has[name]]


def _phrases(setting: str) -> list[str]:
    """A setting's phrases: split at the commas outside brackets (a workload's sizes stay one phrase)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(setting):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(setting[start:i].strip())
            start = i + 1
    out.append(setting[start:].strip())
    return [x for x in out if x]


def setting_labels(settings) -> dict:
    """Each setting's phrases that not every setting has: what tells its lines apart in a figure of several ("" for
    one setting)."""
    split = {s: _phrases(s) for s in dict.fromkeys(settings)}
    common = set.intersection(*(set(p) for p in split.values())) if split else set()
    return {s: ", ".join(x for x in p if x not in common) for s, p in split.items()}


def _groups(frame: pd.DataFrame) -> list:
    """(setting, backend, devices) of ``frame``'s rows, first seen first, each with its legend label: a line never
    runs through two settings (a sweep over model.dtype draws each dtype's own)."""
    labels = setting_labels(frame["setting"])
    out = []
    for setting, backend, devices in dict.fromkeys(zip(frame["setting"], frame["backend"], frame["devices"])):
        label = f"{BACKEND_LABEL.get(backend, backend)}, {devices}"
        label += f", {labels[setting]}" if labels[setting] else ""
        mine = frame[(frame["setting"] == setting) & (frame["backend"] == backend) & (frame["devices"] == devices)]
        out.append((label, mine))
    return out


def write_plots(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Draw the figures ``plot_paths`` names for ``df``; the paths drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = plot_paths(out_dir, df)
    if not paths:
        return []
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ok = _measured(df)
    if not ok.empty:
        fig, axes = plt.subplots(1, len(PASSES), figsize=(11, 4.2), squeeze=False)
        for ax, pass_type in zip(axes[0], PASSES):
            col = f"{pass_type}_tok_per_s"
            for i, (label, mine) in enumerate(_groups(ok)):
                color = colors[i % len(colors)]
                # one line per planner and layout (and cap): the original greedy padded solid, the others dashed/dotted
                for k, (batching, pts) in enumerate(_lines(mine[mine["mtpm"].notna()])):
                    pts = pts.sort_values("mtpm")
                    ax.plot(pts["mtpm"], pts[col], marker=MARKERS[k % len(MARKERS)], color=color,
                            linestyle=("-", "--", "-.", ":")[k % 4], label=f"{label}, {batching}")
                for j, r in enumerate(mine[mine["mtpm"].isna()].itertuples(index=False)):
                    ax.axhline(getattr(r, col), color=color, linestyle=("--", ":", "-.")[j % 3], linewidth=1,
                               label=f"{label}, mbs={int(r.mbs)}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max tokens per micro-batch (mtpm)")
            ax.set_ylabel("tokens / s")
            ax.set_title(PASS_TITLE[pass_type])
            ax.grid(True, alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.08 + 0.04 * ((len(labels) + 1) // 2), 1, 1))
        fig.savefig(out_dir / "plots" / PLOT_FILES[0], dpi=110)
        plt.close(fig)

    planned = _planned_budgets(df)
    if not planned.empty:
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, (label, mine) in enumerate(_groups(planned)):
            for k, (batching, pts) in enumerate(_lines(mine)):
                pts = pts.sort_values("mtpm")
                ax.plot(pts["mtpm"], 100 * pts["pad_efficiency"], marker=MARKERS[k % len(MARKERS)],
                        color=colors[i % len(colors)], linestyle=("-", "--", "-.", ":")[k % 4],
                        label=f"{label}, {batching}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max tokens per micro-batch (mtpm)")
        ax.set_ylabel("pad efficiency (real / padded tokens), %")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "plots" / PLOT_FILES[1], dpi=110)
        plt.close(fig)
    return paths


def _histogram_sources(df: pd.DataFrame, out_dir: Path) -> dict:
    """Per setting: (its histogram ``out_dir/plots/lengths-<point>.png``, the plan.json it is drawn from), the
    setting's first point that has a plan.json; a setting with none is absent."""
    from reports.collect import settings_of
    from reports.plan_files import PLAN_FILE, point_name

    sources: dict = {}
    for setting in settings_of(df):
        # an unreadable results.json says nothing of its workload: its plan.json is not drawn as that workload
        readable = df.loc[(df["setting"] == setting) & (df["status"] != "unreadable"), "path"]
        for results_path in readable:
            plan = Path(results_path).parent / PLAN_FILE
            if plan.is_file():
                sources[setting] = (
                    Path(out_dir) / "plots" / f"lengths-{point_name(Path(results_path), out_dir)}.png",
                    plan,
                )
                break
    return sources


def length_histogram_paths(df: pd.DataFrame, out_dir: Path) -> list:
    """Per row: its setting's length histogram (see ``_histogram_sources``); None where no point of it has a
    plan.json."""
    sources = _histogram_sources(df, out_dir)
    return [sources[s][0] if s in sources else None for s in df["setting"]]


def write_length_histograms(df: pd.DataFrame, out_dir: Path) -> list:
    """Draw each setting's length histogram (see ``_histogram_sources``); per row, the figure drawn or None.

    A histogram that cannot be drawn is a warning: it never stops the report.
    """
    import json
    import logging

    drawn: dict = {}
    for setting, (png, plan) in _histogram_sources(df, out_dir).items():
        source = plan  # the file a failure is about, named in the warning
        try:
            lengths = json.loads(plan.read_text())["lengths"]
            source = plan.parent / "results.json"
            doc = json.loads(source.read_text())
            workload = (doc.get("workload") if isinstance(doc, dict) else None) or {}
            source = png
            drawn[setting] = draw_length_histogram(lengths, png, workload)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logging.getLogger(__name__).warning("length histogram %s not drawn: %s: %s", png, source, exc)
    return [drawn.get(s) for s in df["setting"]]


def truncation_note(dataset: dict) -> str:
    """", N truncated to L" for a dataset's results.json record that cut examples, else ""; results written before
    ``workload.truncate_to`` was named so record the length as ``max_len``."""
    if not dataset.get("truncated"):
        return ""
    return f", {dataset['truncated']:,} truncated to {dataset.get('truncate_to', dataset.get('max_len')):,}"


def draw_length_histogram(lengths, png: Path, workload: dict) -> Path:
    """Two panels over log-spaced length bins: how many sequences, and how many tokens, have each length; the
    median and p99 marked. Long sequences are few but hold the tokens (and set the budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = np.asarray(lengths, dtype=np.int64)
    edges = np.unique(np.geomspace(max(1, n.min()), n.max() + 1, num=min(40, max(2, n.size)) + 1).astype(np.int64))
    if edges.size < 2:
        edges = np.array([n.min(), n.min() + 1])
    median, p99 = np.quantile(n, [0.5, 0.99], method="inverted_cdf")  # as results.json's (harness/point/results.py)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, weights, ylabel in ((axes[0], None, "sequences"), (axes[1], n, "tokens")):
        ax.hist(n, bins=edges, weights=weights, color="#4c72b0", edgecolor="white", linewidth=0.5)
        for x, name, style in ((median, "median", "--"), (p99, "p99", ":")):
            ax.axvline(x, color="#c44e52", linestyle=style, linewidth=1, label=f"{name} {int(x):,}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    source = (workload.get("dataset") or {}).get("path") or (workload.get("file") or {}).get("path")
    name = (
        f"workload {workload.get('name')}" + (f" ({Path(source).name})" if source else "") if workload else "workload"
    )
    fig.suptitle(f"{name}: {n.size:,} sequences, {int(n.sum()):,} tokens, {int(n.min()):,}–{int(n.max()):,} per "
                 f"sequence{truncation_note(workload.get('dataset') or {})}", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _profiles(results_path) -> dict:
    """``{pass type: passes.<type>.profile}`` of a results.json (empty without bench.profile)."""
    import json

    try:
        doc = json.loads(Path(results_path).read_text())
    except (OSError, ValueError):
        return {}
    passes = doc.get("passes") if isinstance(doc, dict) else None
    if not isinstance(passes, dict):  # a results.json that is not what the harness writes: no profile to draw
        return {}
    return {t: p["profile"] for t, p in passes.items() if isinstance(p, dict) and isinstance(p.get("profile"), dict)}


def _profile_png(results_path, out_dir: Path) -> Path:
    from reports.plan_files import point_name

    return Path(out_dir) / "plots" / f"profile-{point_name(Path(results_path), out_dir)}.png"


def profile_figure_paths(df: pd.DataFrame, out_dir: Path) -> list:
    """Per row: ``out_dir/plots/profile-<point>.png`` where its results.json has a profiled pass, else None."""
    return [_profile_png(p, out_dir) if _profiles(p) else None for p in df["path"]]


def write_profile_figures(df: pd.DataFrame, out_dir: Path) -> list:
    """Draw each profiled point's breakdown (see ``profile_figure_paths``); per row, the figure or None."""
    import logging

    out = []
    for results_path in df["path"]:
        profiles = _profiles(results_path)  # each results.json read once
        png = _profile_png(results_path, out_dir) if profiles else None
        try:
            out.append(draw_profile(profiles, png) if png is not None else None)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logging.getLogger(__name__).warning("profile figure %s not drawn: %s", png, exc)
            out.append(None)
    return out


def draw_profile(profiles: dict, png: Path) -> Path:
    """One stacked bar per pass type and rank: the profiled pass's seconds by category
    (backends/runtime/profiling.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from backends.runtime.profiling import CATEGORIES

    rows = [(f"{PASS_TITLE.get(t, t)}, rank {r['rank']}", r) for t, p in profiles.items() for r in p["per_rank"]]
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(rows)))
    for y, (_, r) in enumerate(rows):
        left = 0.0
        for k, cat in enumerate(CATEGORIES):
            width = r["seconds"].get(cat, 0.0)
            ax.barh(y, width, left=left, color="#d0d0d0" if cat == "idle" else colors[k % len(colors)],
                    label=cat.replace("_", " ") if y == 0 else None, edgecolor="white", linewidth=0.4)
            if r["pass_s"] > 0 and width / r["pass_s"] >= 0.08:
                ax.text(left + width / 2, y, f"{100 * width / r['pass_s']:.0f}%", ha="center", va="center", fontsize=7)
            left += width
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds of the profiled pass (its host timeline on the thread that ran it)")
    ax.legend(ncol=len(CATEGORIES), fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False,
              handlelength=1.2, columnspacing=0.8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return png
