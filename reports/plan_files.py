"""Finding and reading plan.json files: the one a user means, checked; the README's published plans; a point's figure
path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from backends.errors import UserError
from reports.plan_blocks import plan_blocks
from reports.plan_json import PLAN_FILE


def find_plan(path: Path) -> Path:
    """The plan.json a user means: the file itself, or the one in a point folder (UserError otherwise)."""
    path = Path(path)
    if path.is_dir():
        if not (path / PLAN_FILE).is_file():
            raise UserError(f"{path}: no {PLAN_FILE} in this folder (give a point folder or a {PLAN_FILE} file)")
        return path / PLAN_FILE
    if not path.is_file():
        raise UserError(f"{path}: no such file or folder (give a point folder or a {PLAN_FILE} file)")
    return path


def load_plan(path: Path) -> dict:
    """A checked plan.json document (UserError naming the path and the problem otherwise)."""
    path = find_plan(path)
    try:
        doc = json.loads(path.read_text())
        plan_blocks(doc)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path}: not a {PLAN_FILE} document ({reason})") from None
    return doc


def results_beside(plan_path: Path) -> Optional[dict]:
    """The results.json document beside a plan.json (its point's), or None when there is none or it is no object."""
    try:
        doc = json.loads((Path(plan_path).parent / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def workload_name(plan_path: Path) -> Optional[str]:
    """The workload's name from the results.json beside the plan, when there is one (plan.json does not hold it)."""
    try:
        return results_beside(plan_path)["workload"]["name"]
    except (KeyError, TypeError):
        return None


def point_name(results_path: Path, out_dir: Path) -> str:
    """A point's name for its figure: its folder relative to the report's folder ('0', 'sweepA-3'); a point outside
    it (a combined report of several sweeps) relative to the folder both lie in ('sweepB-0'), so two sweeps' point 0
    never share a figure."""
    import os

    folder = Path(results_path).parent.resolve()
    out = Path(out_dir).resolve()
    try:
        rel = folder.relative_to(out)
    except ValueError:
        rel = folder.relative_to(os.path.commonpath([folder, out]))
    return "-".join(rel.parts) or folder.name


def plan_figure_paths(df, out_dir: Path) -> list[Optional[Path]]:
    """Per row of ``df``: where its figure goes (``out_dir/plots/plan-<point>.png``); None where there is no
    plan.json."""
    out: list[Optional[Path]] = []
    for results_path in df["path"]:
        has_plan = (Path(results_path).parent / PLAN_FILE).is_file()
        out.append(
            Path(out_dir) / "plots" / f"plan-{point_name(Path(results_path), out_dir)}.png" if has_plan else None
        )
    return out


def published_plans(plans_dir: Path) -> list[Path]:
    """The README's plans, ``plans_dir/<name>/plan.json``: by budget, the original greedy planner first, padded before
    packed."""
    docs = []
    for path in sorted(Path(plans_dir).glob(f"*/{PLAN_FILE}")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = {}
        docs.append(((doc.get("max_tokens_per_microbatch") or 0, doc.get("planner") != "greedy",
                      doc.get("layout") != "padded", path.parent.name), path))
    return [p for _, p in sorted(docs)]
