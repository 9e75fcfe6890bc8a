"""results.json: written atomically, updated after every pass, the source of truth for reports."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.json"
OUTPUTS_FILE = "example_outputs.json"


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
    """Write to a temporary file in the same folder, then rename over ``path``: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_clean(data), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_results(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)
