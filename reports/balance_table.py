"""``python -m reports balance DIR [DIR ...]``: modeled against measured balance per setting, over repeated sweeps.

One row per backend, workload, budget, planner, layout and cost model: the
plan's modeled critical path, the measured one (forward + backward) as mean ±
standard deviation over the sweeps that ran it, each rank's measured idle
share, and how well the FLOP and calibrated models predicted the micro-batch
times (R², worst relative error; means over the runs). The same setting run in
several sweeps is what tells a model's effect from the machine's noise.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

from reports.collect import BACKEND_LABEL, BACKEND_ORDER, find_results, read_results

HEADER = ["backend", "workload", "mtpm", "planner", "layout", "cost model", "runs", "steps",
          "critical path, modeled", "critical path, measured (mean ± sd)", "idle % per rank, measured",
          "FLOP model R² / worst error", "calibrated R² / worst error"]


def _key(doc: dict) -> tuple:
    plan = doc.get("plan") or {}
    return (doc.get("backend"), (doc.get("workload") or {}).get("name"), doc.get("mtpm"), plan.get("planner"),
            plan.get("layout"), doc.get("cost_model") or "flops")


def _mean(values: list) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def _prediction(runs: list[dict], model: str) -> str:
    quality = [(r.get("cost_prediction") or {}).get(model) for r in runs]
    quality = [q for q in quality if q]
    if not quality:
        return "—"
    r2, worst = _mean([q.get("r2") for q in quality]), _mean([q.get("worst_rel_err") for q in quality])
    return f"{'—' if r2 is None else f'{r2:.2f}'} / {'—' if worst is None else f'{100 * worst:.0f}%'}"


def balance_rows(dirs: Iterable[Path]) -> list[list[str]]:
    """The table's rows from every measured results.json under ``dirs`` (its own sweep or a shared measurement)."""
    groups: dict[tuple, list[tuple[dict, dict]]] = defaultdict(list)
    for path in find_results(dirs):
        doc = read_results(path)
        fb = (doc.get("passes") or {}).get("forward_backward") or {}
        if doc.get("status") != "ok" or fb.get("measured_critical_path") is None:
            continue
        groups[_key(doc)].append((doc, fb))
    rows = []
    order = sorted(groups, key=lambda k: (BACKEND_ORDER.get(k[0], 9), str(k[1]), k[2] or 0, str(k[3]), str(k[4]),
                                          k[5] != "flops"))
    for key in order:
        members = groups[key]
        docs, passes = [m[0] for m in members], [m[1] for m in members]
        measured = [p["measured_critical_path"] for p in passes]
        spread = f" ± {statistics.stdev(measured):.3f}" if len(measured) > 1 else ""
        modeled = {round(d["plan"]["critical_path"], 3) for d in docs}
        idle = [[x for x in p.get("idle_fraction") or []] for p in passes]
        ranks = max((len(i) for i in idle), default=0)
        idle_mean = [_mean([i[r] for i in idle if r < len(i)]) for r in range(ranks)]
        backend, workload, mtpm, planner, layout, model = key
        rows.append(
            [
                BACKEND_LABEL.get(backend, str(backend)),
                str(workload),
                "—" if mtpm is None else f"{mtpm:,}",
                str(planner),
                str(layout),
                model,
                str(len(members)),
                "/".join(sorted({str(d["plan"]["steps"]) for d in docs})),
                " / ".join(f"{m:.3f}" for m in sorted(modeled)),
                f"{statistics.mean(measured):.3f}{spread}",
                ", ".join("—" if v is None else f"{100 * v:.1f}" for v in idle_mean),
                _prediction(passes, "flops"),
                _prediction(passes, "calibrated"),
            ]
        )
    return rows


def balance_markdown(dirs: Iterable[Path]) -> str:
    rows = balance_rows(dirs)
    if not rows:
        return "_No measured forward + backward pass with step times._"
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
