"""plan.json: a point's plan in its output folder, as the harness writes it (``plan_json``) and reports/ reads it back
(``check_plan_json``)."""

from __future__ import annotations

import json

from balance_batch import LAYOUTS, Plan

PLAN_JSON_VERSION = 1
PLAN_FILE = "plan.json"  # a point's plan, in its output folder (read back by reports/)


def plan_json(plan: Plan, **extra) -> dict:
    """``plan``'s plan.json document; ``extra`` adds keys such as ``backend``.

    Keys: ``version``, ``world_size``, ``lockstep`` (step s of every rank runs
    together), ``planner``, ``layout``, ``max_tokens_per_microbatch``,
    ``micro_batch_size``, ``max_seqs_per_microbatch`` (null: no cap), ``cost_model`` ({a, b, source}: a sequence of
    length L costs a*L + b*L**2), ``lengths`` (per example) and
    ``schedules``: per rank, per step, a list of example indices or null
    (a dummy step of zero loss weight).
    """
    doc = {
        "version": PLAN_JSON_VERSION,
        "world_size": len(plan.schedules),
        "lockstep": plan.lockstep,
        "planner": plan.planner,
        "layout": plan.layout,
        "max_tokens_per_microbatch": plan.max_tokens_per_microbatch,
        "micro_batch_size": plan.micro_batch_size,
        "max_seqs_per_microbatch": plan.max_seqs_per_microbatch,
        "cost_model": plan.cost_model.as_dict(),
        "lengths": list(plan.lengths),
        "schedules": [[None if b is None else list(b) for b in s] for s in plan.schedules],
    }
    if plan.peer:
        doc["peer"] = plan.peer
    return {"version": doc.pop("version"), **extra, **doc}


def check_plan_json(doc) -> None:
    """Raise ValueError naming the first thing that makes ``doc`` no plan.json document (the format of
    ``plan_json``)."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    version = doc.get("version")
    if type(version) is not int or version != PLAN_JSON_VERSION:  # type(): true is no version 1
        found = "missing" if version is None else json.dumps(version)  # as the file spells it: 2, "1", true
        raise ValueError(f"'version' is {found}; this code reads version {PLAN_JSON_VERSION} of plan.json")
    for key in ("lengths", "schedules"):
        if not isinstance(doc.get(key), list):
            raise ValueError(f"'{key}' is missing or not a list")
    lengths, schedules = doc["lengths"], doc["schedules"]
    if not all(isinstance(n, int) and n >= 0 for n in lengths):
        raise ValueError("'lengths' must be non-negative integers")
    if not schedules or not all(isinstance(s, list) for s in schedules):
        raise ValueError("'schedules' must be a non-empty list of per-rank lists")
    if doc.get("world_size") is not None and doc["world_size"] != len(schedules):
        raise ValueError(f"'world_size' is {doc['world_size']} but there are {len(schedules)} schedules")
    layout = doc.get("layout", "padded")
    if layout not in LAYOUTS:
        raise ValueError(f"'layout' is {layout!r} (valid: {', '.join(LAYOUTS)})")
    for r, schedule in enumerate(schedules):
        for s, batch in enumerate(schedule):
            if batch is None:
                continue
            indices_ok = isinstance(batch, list) and all(isinstance(i, int) and 0 <= i < len(lengths) for i in batch)
            if not batch or not indices_ok:
                raise ValueError(f"schedules[{r}][{s}] must be null or a non-empty list of indices into 'lengths'")
    if doc.get("lockstep", True) and len({len(s) for s in schedules}) > 1:
        raise ValueError("'lockstep' is true but the ranks' schedules differ in length")
    cap = doc.get("max_seqs_per_microbatch")
    if cap is not None and not (type(cap) is int and cap > 0):
        raise ValueError("'max_seqs_per_microbatch' must be null or a positive integer")
    cm = doc.get("cost_model")
    if cm is not None and not (isinstance(cm, dict) and all(isinstance(cm.get(k), (int, float)) for k in ("a", "b"))):
        raise ValueError("'cost_model' must be {\"a\": number, \"b\": number, \"source\": text}")
