"""results.json, a point's record and the source of truth for reports: created, updated after every pass, written
atomically.

``PointResults`` holds one point's document: ``base_document`` starts it
("running", the point's identity read leniently from the config), the point
adds what it ran and each pass's measurements, and every ``save`` rewrites the
file atomically. plan.json and example_outputs.json sit beside it.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from backends.runtime.atomic import write_text_atomic
from backends.runtime.liveness import process_record, recorded_process_gone
from harness.app.batching import AUTO, asked

RESULTS_FILE = "results.json"
OUTPUTS_FILE = "example_outputs.json"
SNAPSHOT_DIR = "memory"  # <pass>-rank<r>.pickle, written when a pass runs out of memory (bench.memory_snapshot)


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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "peft", "megatron-core", "hydra-core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def base_document(cfg: DictConfig, overrides: Sequence[str]) -> dict[str, Any]:
    """The run's identity, read leniently so even an invalid config leaves a readable results.json."""

    def get(key: str) -> Any:
        try:
            return OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
        except Exception:  # noqa: BLE001 - an invalid config still leaves a readable record: the key reads null
            return None

    auto = get("mtpm") == AUTO
    doc = {
        "status": "running",
        "error": None,
        "backend": get("backend.name"),
        "world_size": get("backend.world_size"),
        "device": None,
        "model": {"name": get("model.name"), "path": get("model.path"), "lora_rank": get("model.lora_rank")},
        # what the point is asked to run, until it records what ran: a point that fails first still says its batching
        # (mtpm=auto: null until a budget is chosen; cost_model: what the planner balanced, plan.cost_model the numbers)
        **asked(get),
        "gc": get("gc"),
        "bench": {"warmup": get("bench.warmup"), "repeat": get("bench.repeat"), "profile": get("bench.profile"),
                  "memory_snapshot": get("bench.memory_snapshot"), "paired": get("bench.paired"),
                  "target_ci_pct": get("bench.target_ci_pct"), "max_repeats": get("bench.max_repeats")},
        "workload": {"name": get("workload.name")},
        "plan": None,
        "precision": None,  # the precision policy that ran: params, adapters, compute, reduce (backends/model/build.py)
        "passes": {},
        "peak": None,  # the device peak MFU is measured against (harness/metrics/flops.py)
        "overrides": list(overrides),
        "started_at": _now(),
        # who writes this file: a reader that finds "running" and this process gone reports the point as died
        "process": process_record(),
        "versions": _versions(),
    }
    if auto:  # an mtpm=auto point says so from the start, so it never reads as the mbs=1 baseline (the search's own)
        doc["auto"] = {"candidates": [], "chosen": None, "baseline": None, "limit_bytes": None}
    return doc


def reported_status(doc: dict[str, Any]) -> Any:
    """The status a reader should show: "died" for a "running" point whose writing process is gone (killed,
    or its machine's job ended), judged only on the host that ran it; otherwise the recorded status."""
    status = doc.get("status")
    if status == "running" and recorded_process_gone(doc.get("process")):
        return "died"
    return status


def model_record(model, built: Optional[dict]) -> dict[str, Any]:
    """results.json's ``model``: the model config (backends.specs.ModelSpec) and what the backend built (None in a dry
    run)."""
    return {
        "name": model.name,
        "path": model.path,
        "lora_rank": model.lora_rank,
        "dtype": model.dtype,
        "built": built,  # what the backend reports it built: architecture, parameters, vocabulary, dtype
    }


def workload_record(workload, lengths: Sequence[int], file: Optional[dict] = None, dataset=None) -> dict[str, Any]:
    """results.json's ``workload``: its name and seed (harness.data.workload.WorkloadSpec) and the lengths it made.

    From a lengths file, ``file`` says what was read and drawn (harness.data.workload.file_lengths): path, format
    (lengths or histogram), distinct lengths, sequences in the file, how many were sampled (null: all), order.
    From a dataset (harness.data.dataset.DatasetExamples), ``dataset`` says what was read and tokenized: files, format,
    tokenizer, rows, truncations, trained tokens, sampling and the cache key.
    """
    import numpy as np

    # the nearest-rank percentile: the shortest length at least that share of the sequences are no longer than (p99 of
    # fewer than 100 sequences is the longest, not the second longest as numpy's "lower" gives)
    q = np.quantile(np.asarray(lengths, dtype=np.float64), [0.5, 0.99], method="inverted_cdf")
    record = {
        "name": workload.name,
        "n_examples": len(lengths),
        "n_tokens": workload.n_tokens,  # the batch's size in tokens as asked (null: sized by n_examples)
        "total_tokens": sum(lengths),
        "min_len": min(lengths),
        "max_len": max(lengths),
        "median_len": int(q[0]),
        "p99_len": int(q[1]),
        "seed": workload.seed,
    }
    if file is not None:
        record["file"] = dict(file)
    if dataset is not None:
        record["dataset"] = dict(dataset.record)
    return record


class PointResults:
    """One point's results.json: the document, and its file rewritten atomically at every ``save``.

    ``wall_s`` (seconds since the document was made) is refreshed at each save.
    """

    def __init__(self, out_dir: Path, doc: dict[str, Any]):
        self.path = Path(out_dir) / RESULTS_FILE
        self.doc = doc
        self._t0 = time.perf_counter()

    def save(self) -> None:
        self.doc["wall_s"] = time.perf_counter() - self._t0
        write_json_atomic(self.path, self.doc)

    def update(self, **fields: Any) -> None:
        """Set top-level fields (a field already there keeps its place in the file; a new one goes last)."""
        self.doc.update(fields)

    def mark(self, status: str) -> None:
        """The point ended with ``status`` (ok also stamps ``finished_at``); written at once."""
        self.doc["status"] = status
        if status == "ok":
            self.doc["finished_at"] = _now()
        self.save()

    def fail(self, status: str, message: str) -> None:
        """The point ended without its measurements: ``status`` (error, oom, timeout, interrupted) and why."""
        self.doc["status"] = status
        self.doc["error"] = message
        self.save()

    def record_pass(self, pass_type: str, measured: dict[str, Any]) -> None:
        """One pass type measured: its record under ``passes``; written at once."""
        self.doc["passes"][pass_type] = measured
        self.save()
