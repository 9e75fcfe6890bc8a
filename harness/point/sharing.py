"""Plan sharing in a sweep: two budgets that plan identically run the same steps, so the second point takes the
first's measurement (``shares`` says whose) instead of measuring it again (bench.share_plans=false measures it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from harness.app.batching import KEYS, without_batching
from harness.app.config import without_auto
from harness.point.results import OUTPUTS_FILE, PointResults, write_json_atomic

# What a point's config says of how it is run and logged (its batching aside): not part of what it measures.
_NOT_MEASURED = ("hydra", "logger", "resume", "dry_run", "hot")


def measurement_key(cfg: DictConfig, plan) -> str:
    """What a measurement depends on: the config less its batching knobs, and the plan's micro-batches and layout."""
    import hashlib

    conf = OmegaConf.to_container(without_auto(cfg), resolve=True, throw_on_missing=False)
    conf = {k: v for k, v in without_batching(conf).items() if k not in _NOT_MEASURED}
    conf["backend"] = conf.get("backend") or {}
    conf["bench"] = {k: v for k, v in (conf.get("bench") or {}).items() if k not in ("baseline", "share_plans")}
    what = {"config": conf, "layout": plan.stats.layout, "schedules": plan.schedules}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def measured_earlier(sweep_dir: Path, out_dir: Path, key: str) -> Optional[tuple[Path, dict]]:
    """The folder and results of a point of this sweep (not ``out_dir``'s) that measured ``key`` itself, or None."""
    from harness.sweep.points import read_result, result_files

    for path in result_files(sweep_dir):
        if path.parent == out_dir:
            continue
        doc = read_result(path.parent)
        if doc and doc.get("status") == "ok" and doc.get("measurement_key") == key and not doc.get("shares"):
            return path.parent, doc
    return None


def take_measurement(results: PointResults, out_dir: Path, folder: Path, doc: dict, save_outputs: bool) -> None:
    """``results`` takes the measurements of the point in ``folder`` (same plan, same setting); ``shares`` says
    whose."""
    for key in ("device", "precision", "load", "threads_per_rank", "peak", "launch", "passes", "speedup"):
        if key in doc:
            results.update(**{key: doc[key]})
    for measured in (results.doc.get("passes") or {}).values():  # bench.profile: the traces stay in its folder
        if isinstance(measured, dict) and isinstance(measured.get("profile"), dict):
            measured["profile"] = {**measured["profile"], "traces": [
                os.path.relpath(folder / t, out_dir) for t in measured["profile"]["traces"]]}
    results.update(model={**results.doc["model"], "built": (doc.get("model") or {}).get("built")})
    # whose measurement: its folder and batching (the plan, not the cost model that made it, is what is shared)
    results.update(shares={"folder": folder.name, **{k: doc.get(k) for k in KEYS if k != "cost_model"}})
    if (folder / OUTPUTS_FILE).is_file() and save_outputs:  # the same steps: the same outputs
        write_json_atomic(out_dir / OUTPUTS_FILE, json.loads((folder / OUTPUTS_FILE).read_text()))
