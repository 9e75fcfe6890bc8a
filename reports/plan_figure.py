"""Drawing plan figures: one row per rank, real tokens, padding and waiting on a modeled-cost axis; a report's figures
and README lines."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional, Sequence

from backends.errors import UserError
from reports.plan_blocks import MAX_COLUMNS, Layout, PlanBlocks, measured_blocks, plan_blocks, plan_layout
from reports.plan_files import find_plan, load_plan, plan_figure_paths, results_beside, workload_name
from reports.plan_json import PLAN_FILE

DPI = 110  # the PNG's; text is measured at it to wrap lines to the figure's width
COLORS = {"real": "#3b6fb6", "padding": "#e8893a", "idle": "#d9d9d9", "dummy": "#bdbdbd"}
LABELS = {
    "real": "real tokens",
    "padding": "padding",
    "idle": "waiting for the slowest rank",
    "dummy": "dummy step (no data; waits)",
}


def describe(pb: PlanBlocks, workload: Optional[str] = None) -> tuple[list[str], list[str]]:
    """The figure's title and subtitle parts: what the plan is, and the numbers it is judged by."""
    if pb.budget:
        budget = f"budget {pb.budget:,} tokens / micro-batch"
    else:
        budget = f"fixed {pb.micro_batch_size or 1} sequence(s) / micro-batch"
    title = [f"{pb.backend or 'backend ?'}", f"{pb.planner or 'planner ?'} planner", f"{pb.layout} layout", budget]
    if pb.max_seqs_per_microbatch is not None:
        title.append(f"≤ {pb.max_seqs_per_microbatch} sequences / micro-batch")
    what = f"{pb.n_sequences:,} sequences" + (f" of {workload}" if workload else "") + f", {pb.real_tokens:,} tokens"
    ranks = f"{pb.world_size} rank{'s' if pb.world_size != 1 else ''}"
    if pb.lockstep:
        shape = f"{ranks} × {pb.n_steps} lock-step steps"
        cp = f"critical path {pb.critical_path:.3f} (Σ steps of the slowest rank ÷ mean rank)"
    else:
        shape = f"{ranks} run independently, up to {max(pb.n_microbatches, default=0)} micro-batches each"
        cp = f"critical path {pb.critical_path:.3f} (slowest rank ÷ mean rank)"
    ideal = pb.makespan / pb.ideal_cost if pb.ideal_cost else 1.0
    return title, [shape, what, f"pad efficiency {pb.pad_efficiency:.3f}", cp,
                   f"modeled time {ideal:.3f} × the ideal (no padding, no waiting)"]


def figure_notes(pb: PlanBlocks, lay: Layout) -> list[str]:
    """The lines under the figure: how to read it, and whether steps were grouped (aggregated) to stay readable."""
    notes = []
    if pb.lockstep:
        notes.append("Lock-step: every rank runs step s together; "
                     "a column's width is the step's cost on its slowest rank.")
        if lay.group > 1:
            notes.append(f"Aggregated: {pb.n_steps} steps drawn in groups of {lay.group} consecutive steps, "
                         "each group's real, padding and waiting summed.")
    else:
        notes.append("Ranks run independently: each rank's micro-batches end to end; "
                     "grey = waiting at the end of the pass for the slowest rank.")
        if lay.group > 1:
            notes.append(f"Aggregated: groups of {lay.group} consecutive micro-batches per rank, summed.")
    if pb.layout == "packed":
        notes.append("Packed layout: sequences end to end in one row, no padding.")
    else:
        notes.append("Padded layout: every sequence of a micro-batch padded to its longest.")
    cm = pb.cost_model
    source = cm.get("source") or "no source given"
    if cm.get("c") or cm.get("fixed"):
        notes.append(f"Cost per micro-batch fixed + Σ over its sequences (c + a·L + b·L²), fixed={cm['fixed']:.4g}, "
                     f"c={cm['c']:.4g}, a={cm['a']:.4g}, b={cm['b']:.4g} ({source}). Numbers in blocks: sequences.")
    else:
        notes.append(f"Cost per sequence a·L + b·L², a={cm['a']:.4g}, b={cm['b']:.4g} ({source}). "
                     "Numbers in blocks: sequences.")
    return notes


@functools.lru_cache(maxsize=None)
def _renderer():
    from matplotlib.backends.backend_agg import RendererAgg

    return RendererAgg(1, 1, DPI)


def text_width_in(text: str, fontsize: float, weight: str = "normal") -> float:
    """How wide ``text`` is drawn, in inches, in matplotlib's default font at ``fontsize`` points (measured by Agg at
    DPI)."""
    from matplotlib.font_manager import FontProperties

    width, _, _ = _renderer().get_text_width_height_descent(text, FontProperties(size=fontsize, weight=weight),
                                                            ismath=False)
    return width / DPI


def _wrap(
    parts: Sequence[str], width_in: float, fontsize: float, sep: str = " · ", weight: str = "normal"
) -> list[str]:
    """Join ``parts`` with ``sep`` into lines no wider than ``width_in`` inches as drawn (a part is never split)."""
    lines: list[str] = []
    for part in parts:
        if lines and text_width_in(lines[-1] + sep + part, fontsize, weight) <= width_in:
            lines[-1] += sep + part
        else:
            lines.append(part)
    return lines


def draw_plan(doc: dict, out_png: Path, workload: Optional[str] = None, max_columns: int = MAX_COLUMNS,
              width_in: float = 13.0, x_total: float = 0.0, measured: Optional[dict] = None) -> Path:
    """Draw ``doc`` (a plan.json document) into ``out_png``, ``width_in`` inches wide.

    ``x_total``: draw the axis at least this long (plans shown side by side share one scale). ``measured``: a pass's
    record from the results.json beside the plan (see ``measured_pass``): a second panel draws its step times.
    """
    import matplotlib.pyplot as plt

    fig = plan_figure(doc, workload, max_columns, width_in, x_total, measured)
    try:
        out_png = Path(out_png)
        out_png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_png, dpi=DPI)
    finally:
        plt.close(fig)
    return out_png


PASS_WORDS = {"forward": "forward", "forward_backward": "forward + backward"}


def measured_pass(results: Optional[dict]) -> Optional[dict]:
    """The pass whose step times a plan figure draws: forward + backward's, else forward's, from a results.json
    document; {"pass_type", "timeline", "measured_critical_path"} or None when no pass recorded a timeline."""
    passes = (results or {}).get("passes") or {}
    for pass_type in ("forward_backward", "forward"):
        rec = passes.get(pass_type)
        if isinstance(rec, dict) and isinstance(rec.get("timeline"), dict):
            return {"pass_type": pass_type, "timeline": rec["timeline"],
                    "measured_critical_path": rec.get("measured_critical_path")}
    return None


def _measured_subtitle(pb: PlanBlocks, measured: dict) -> list[str]:
    tl = measured["timeline"]
    clock = {"thread-cpu": "each rank's thread CPU time (blocked in a collective is not busy)",
             "wall": "each step's wall time", "cuda-events": "CUDA events (device time)"}.get(tl.get("busy_clock"),
                                                                                            tl.get("busy_clock"))
    cp = pb.critical_path
    return [f"measured: {PASS_WORDS.get(measured['pass_type'], measured['pass_type'])}, busy time per step",
            f"mean of {tl.get('repeats')} timed repeats", f"clock: {clock}",
            f"critical path {cp:.3f} measured", f"measured time {pb.makespan / pb.ideal_cost:.3f} × the ideal"
            if pb.ideal_cost else "no busy time recorded"]


def plan_figure(doc: dict, workload: Optional[str] = None, max_columns: int = MAX_COLUMNS,
                width_in: float = 13.0, x_total: float = 0.0, measured: Optional[dict] = None):
    """The matplotlib figure of ``doc`` (see ``draw_plan``); the caller closes it.

    With ``measured`` (``measured_pass`` of the results.json beside the plan) a second panel under the plan draws
    what the ranks measured step by step on the same kind of axis (÷ the measured ideal pass), so modeled and
    measured waiting read side by side; a timeline whose steps are not the plan's draws no panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    pb = plan_blocks(doc)
    panels = [(pb, plan_layout(pb, max_columns), None)]
    mb = measured_blocks(pb, measured["timeline"]) if measured else None
    if mb is not None and mb.ideal_cost > 0:
        panels.append((mb, plan_layout(mb, max_columns), measured))
    ranks = pb.world_size
    title_parts, subtitle_parts = describe(pb, workload)
    text_in = 0.97 * (width_in - 2 * 0.08)  # texts start 0.08 in from the left edge; keep as much on the right
    title = _wrap(title_parts, text_in, 10.5, weight="bold")
    subtitle = _wrap(subtitle_parts, text_in, 8)
    notes = [line for note in figure_notes(pb, panels[0][1]) for line in _wrap(note.split(" "), text_in, 6.5, sep=" ")]
    if len(panels) > 1:
        notes += _wrap(("Lower panel: the same steps as measured, each micro-batch's busy time split into real and "
                        "padding as the model splits it, on the measured ideal pass (1.0: the busy time spread "
                        "evenly over the ranks).").split(" "), text_in, 6.5, sep=" ")
    panel_titles = [_wrap(_measured_subtitle(p, m), text_in, 7.5) if m else [] for p, _, m in panels]
    drawn = {r.kind for _, lay, _ in panels for r in lay.rects if r.width > 0}
    legend_kinds = ["real", "padding", "idle"] + (["dummy"] if "dummy" in drawn else [])
    legend_cols = len(legend_kinds) + 1 if width_in >= 10 else 3
    legend_rows = -(-(len(legend_kinds) + 1) // legend_cols)

    # Layout in inches: title and subtitle, step numbers, the panels (each its rows and axis), legend, notes.
    top_in = 0.2 + 0.22 * len(title) + 0.16 * len(subtitle) + (0.3 if pb.lockstep else 0.12)
    bottom_in = 0.55 + 0.22 * legend_rows + 0.12 * len(notes) + 0.06
    left_in, right_in, row_in = 0.62, 0.08, 0.36
    rows_in = row_in * max(ranks, 2)
    gaps_in = [0.0] + [0.5 + 0.15 * len(t) + (0.2 if pb.lockstep else 0.0) for t in panel_titles[1:]]
    fig_h = top_in + len(panels) * rows_in + sum(gaps_in) + bottom_in
    fig = plt.figure(figsize=(width_in, fig_h), dpi=DPI)
    plot_in = width_in - left_in - right_in
    total = max(max(lay.total for _, lay, _ in panels), 1.0)
    xmax = max(total, x_total) / (1 - 0.95 / plot_in)  # room right of the rows for each rank's totals
    per_in = xmax / plot_in  # x units per inch
    y_in = top_in
    for k, ((blocks, lay, m), gap) in enumerate(zip(panels, gaps_in)):
        y_in += gap
        ax = fig.add_axes((left_in / width_in, 1 - (y_in + rows_in) / fig_h, plot_in / width_in, rows_in / fig_h))
        _draw_panel(ax, blocks, lay, per_in, xmax, first=k == 0,
                    xlabel="modeled time ÷ the ideal pass (every rank busy, no padding)" if k == 0
                    else "measured time ÷ the ideal pass (the busy time spread evenly over the ranks)")
        if m:
            fig.text(0.08 / width_in, 1 - (y_in - 0.12 - (0.2 if pb.lockstep else 0.0)) / fig_h,
                     "\n".join(panel_titles[k]), fontsize=7.5, ha="left", va="bottom", linespacing=1.3)
        y_in += rows_in

    fig.text(0.08 / width_in, 1 - 0.08 / fig_h, "\n".join(title), fontsize=10.5, ha="left", va="top", weight="bold")
    fig.text(0.08 / width_in, 1 - (0.12 + 0.22 * len(title)) / fig_h, "\n".join(subtitle), fontsize=8,
             ha="left", va="top", linespacing=1.35)
    handles = [
        Patch(facecolor="white", edgecolor=COLORS["dummy"], hatch="////", label=LABELS[k]) if k == "dummy"
        else Patch(color=COLORS[k], label=LABELS[k])
        for k in legend_kinds
    ] + [Line2D([], [], color="black", linestyle="--", linewidth=0.8, label="1.0: the ideal pass")]
    notes_in = 0.12 * len(notes) + 0.06
    fig.legend(handles=handles, loc="lower left", ncol=legend_cols, fontsize=7.5, frameon=False,
               bbox_to_anchor=(0.0, notes_in / fig_h), handlelength=1.6, columnspacing=1.2)
    fig.text(0.08 / width_in, 0.05 / fig_h, "\n".join(notes), fontsize=6.5, ha="left", va="bottom", color="#444444")
    return fig


def _draw_panel(ax, pb: PlanBlocks, lay: Layout, per_in: float, xmax: float, first: bool, xlabel: str) -> None:
    """One panel: a row per rank, its blocks, the boundaries, each rank's totals, and (lock-step) the step numbers."""
    ranks = pb.world_size
    total = max(lay.total, 1.0)
    height = 0.62  # of a row
    for r in lay.rects:
        if r.kind == "dummy":
            if pb.lockstep:
                ax.barh(r.rank, r.width, left=r.x, height=height, color="white", edgecolor=COLORS["dummy"],
                        hatch="////", linewidth=0)
            continue
        ax.barh(r.rank, r.width, left=r.x, height=height, color=COLORS[r.kind], linewidth=0)
        if r.kind == "real" and r.n_sequences and r.width / per_in > 0.2:
            ax.text(r.x + r.width / 2, r.rank, f"{r.n_sequences}", ha="center", va="center", fontsize=6.5,
                    color="white")

    # Boundaries between drawn micro-batches (or groups): columns across all rows, or per row for independent ranks.
    for c in lay.columns[1:]:
        ax.axvline(c.x, color="white", linewidth=1.2)
    for rank, x in lay.boundaries:
        ax.plot([x, x], [rank - height / 2, rank + height / 2], color="white", linewidth=0.8)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=0.8)

    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)], fontsize=8)
    ax.set_xlim(0, xmax)
    ax.set_xticks([t for t in ax.get_xticks() if t <= total + 1e-9])
    for r in range(ranks):
        extra = (f", {pb.n_dummy[r]} dummy" if pb.lockstep else f", {pb.n_dummy[r]} null") if pb.n_dummy[r] else ""
        work = f"work {pb.rank_cost[r] / lay.unit:.2f}{extra}\n{pb.rank_real_tokens[r]:,} tok"
        ax.text(total + 0.05 * per_in, r, work, va="center", fontsize=6.5)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    if pb.lockstep:
        # Step numbers on top, where a column is wide enough to carry one.
        top = ax.secondary_xaxis("top")

        def label(c) -> str:
            return str(c.first_step + 1) if c.first_step == c.last_step else f"{c.first_step + 1}–{c.last_step + 1}"

        shown = [c for c in lay.columns if c.width / per_in > 0.055 * len(label(c)) + 0.04]
        top.set_xticks([c.x + c.width / 2 for c in shown])
        top.set_xticklabels([label(c) for c in shown], fontsize=6.5)
        top.tick_params(length=0, pad=1)
        top.spines["top"].set_visible(False)
        if first:
            top.set_xlabel("lock-step step", fontsize=7, labelpad=2)


def figure_name(plan_path: Path) -> str:
    """A plan's figure name in a folder: ``plan-<point>.png`` for a point's plan.json (as the report's plots/), else
    ``<name>.png``."""
    plan_path = Path(plan_path)
    if plan_path.name == PLAN_FILE:
        return f"plan-{plan_path.resolve().parent.name}.png"
    return plan_path.with_suffix(".png").name


def plan_png_path(out, plan_path: Path) -> Path:
    """Where ``python -m reports plan PATH -o OUT`` writes (UserError for a format other than PNG).

    No OUT: plan.png beside the plan.json. OUT a folder (an existing one, or a name ending in /):
    ``OUT/plan-<point>.png``. OUT without an extension: ``OUT.png``. Only PNG is written.
    """
    plan_path = Path(plan_path)
    if out is None:
        return plan_path.with_suffix(".png")
    raw, out = str(out), Path(out)
    if out.is_dir() or raw.endswith(("/", os.sep)):
        return out / figure_name(plan_path)
    if not out.suffix:
        return out.with_name(out.name + ".png")
    if out.suffix.lower() != ".png":
        raise UserError(f"{raw}: only .png is written (give OUT.png, a name without extension to get OUT.png, "
                        "or a folder)")
    return out


def draw_plan_file(path: Path, out_png=None, **kwargs) -> Path:
    """Draw the plan at ``path`` (a point folder or a plan.json) into ``out_png`` (see ``plan_png_path``); returns the
    PNG written."""
    plan_path = find_plan(path)
    doc = load_plan(plan_path)
    out = plan_png_path(out_png, plan_path)
    kwargs.setdefault("measured", measured_pass(results_beside(plan_path)))  # a measured point: its step times too
    try:
        return draw_plan(doc, out, workload=workload_name(plan_path), **kwargs)
    except OSError as exc:
        raise UserError(f"{out}: cannot write ({exc.strerror or exc}; give -o a path in a writable folder)") from None


def draw_side_by_side(plans: Sequence[Path], pngs: Sequence[Path], width_in: float = 6.5) -> list[Path]:
    """Draw plans meant to be compared (the README's): narrow, on one common time axis."""
    docs = [load_plan(p) for p in plans]
    longest = max((plan_layout(plan_blocks(d)).total for d in docs), default=0.0)
    return [draw_plan(d, png, workload=workload_name(find_plan(p)), width_in=width_in, x_total=longest)
            for d, p, png in zip(docs, plans, pngs)]


def write_plan_figures(df, out_dir: Path) -> list[Optional[Path]]:
    """Draw every row's plan figure (see ``plan_figure_paths``); returns them, None where none was drawn.

    A plan that cannot be drawn is a warning: it never stops the report.
    """
    import logging

    out: list[Optional[Path]] = []
    for results_path, png in zip(df["path"], plan_figure_paths(df, out_dir)):
        if png is None:
            out.append(None)
            continue
        try:
            out.append(draw_plan_file(Path(results_path).parent, png))
        except (UserError, OSError, ValueError) as exc:
            logging.getLogger(__name__).warning("plan figure %s not drawn: %s", png, exc)
            out.append(None)
    return out


def readme_plan_lines(figures: Sequence[Path], plans: Sequence[Path], base: Path) -> list[str]:
    """The README lines showing the published plans side by side (empty when there are none)."""
    if not figures:
        return []
    width = f"{100 // len(figures) - 1}%"
    imgs = " ".join(
        f'<img src="{Path(os.path.relpath(png, base)).as_posix()}" width="{width}" alt="plan {plan.parent.name}">'
        for png, plan in zip(figures, plans)
    )
    sources = ", ".join(f"`{Path(os.path.relpath(p, base)).as_posix()}`" for p in plans)
    return [
        "",
        (f"The plans behind a budget, from dry runs ({sources}): one row per rank, each micro-batch's real tokens, "
         "padding and the time it waits for the slowest rank, on the modeled cost a·L + b·L², both on one scale "
         "(1.0: the same sequences with no padding and no waiting). "
         "Draw any run's plan with `python -m reports plan POINT_DIR`."),
        "",
        f"<p>{imgs}</p>",
    ]
