"""results.json: written atomically, updated after every pass, the source of truth for reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from backends.runtime.atomic import write_text_atomic

RESULTS_FILE = "results.json"
OUTPUTS_FILE = "example_outputs.json"
PLAN_FILE = "plan.json"  # which rank runs which examples in which step (backends.planning.Plan.to_json)


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json_atomic(path: Path, data: Any) -> None:
    """results.json and friends: atomic and fsynced, so a crash never leaves half a file."""
    write_text_atomic(path, json.dumps(_clean(data), indent=2) + "\n", durable=True)


def write_plan_json(path: Path, plan: dict) -> None:
    """plan.json: compact (a plan of many lengths stays small), atomic like results.json."""
    write_text_atomic(path, json.dumps(_clean(plan), separators=(",", ":")) + "\n", durable=True)
