"""results.json files → one pandas DataFrame, a row per run, in the order the README table shows them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from backends.registry import BACKENDS
from harness.point.results import reported_status

log = logging.getLogger(__name__)

# The README table shows the distributed backends first, then the rest, each in the registry's order.
BACKEND_ORDER = {b.name: i for i, b in enumerate(sorted(BACKENDS, key=lambda b: not b.distributed))}
BACKEND_LABEL = {b.name: b.label for b in BACKENDS}
DISTRIBUTED = {b.name for b in BACKENDS if b.distributed}  # backends whose ranks talk over gloo (CPU) or NCCL (GPU)
PASSES = ("forward", "forward_backward")
PLANNER_ORDER = {"greedy": 0, "balanced": 1}
LAYOUT_ORDER = {"padded": 0, "packed": 1}


def find_results(dirs: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for d in dirs:
        d = Path(d)
        if d.is_file() and d.name == "results.json":
            files.append(d)
        elif d.is_dir():
            files.extend(p for p in d.rglob("results.json") if ".hydra" not in p.parts)
    return sorted(set(files))


def _overrides(path: Path, doc: dict) -> list[str]:
    if doc.get("overrides") is not None:
        return list(doc["overrides"])
    hydra = path.parent / ".hydra" / "overrides.yaml"
    if hydra.exists():
        from omegaconf import OmegaConf

        return list(OmegaConf.load(hydra))
    return []


def _devices(doc: dict) -> Optional[str]:
    """The devices a run used, as recorded, and what its ranks talk over (a distributed backend's: gloo on CPUs, NCCL
    on GPUs; the PyTorch backend is one process and talks to no one); without a recorded device only its rank count,
    if that (None: nothing known)."""
    dev = doc.get("device") or {}
    count = dev.get("count") or doc.get("world_size")
    ranks = doc.get("backend") in DISTRIBUTED
    if dev.get("type") == "cuda":
        return f"{count or 1} × {dev.get('name') or 'GPU'}" + (" (NCCL)" if ranks else "")
    if dev.get("type") == "cpu":
        if not ranks:
            return "1 × CPU process"
        return f"{count or 1} × CPU rank{'s' if (count or 1) != 1 else ''} (gloo)"
    if dev.get("type"):
        return f"{count or 1} × {dev['type']}"
    if isinstance(count, int) and count > 0:  # failed before the backend reported its devices
        return f"{count} rank{'s' if count != 1 else ''}"
    return None


def _hardware(dev: dict) -> Optional[str]:
    if dev.get("type") == "cpu":
        name = dev.get("name") or "a CPU"
        cores = f", {dev['cores']} cores" if dev.get("cores") else ""
        return f"{name}{cores} (no GPU)"  # what ranks talk over is the devices column's (the PyTorch backend: none)
    if dev.get("type") == "cuda":
        return dev.get("name") or "GPU"
    return dev.get("name") or dev.get("type") or None


def _dry_run(doc: dict) -> bool:
    """A point asked to plan only: planned, or refused before it planned with ``dry_run=true`` among its overrides."""
    if doc.get("status") == "planned":
        return True
    typed = [o.split("=", 1) for o in doc.get("overrides") or [] if isinstance(o, str) and "=" in o]
    return any(k.lstrip("+~") == "dry_run" and v.strip().lower() in ("true", "yes", "1", "on") for k, v in typed)


def _setting(doc: dict) -> str:
    """What makes rows comparable: devices, model, workload, gradient checkpointing, compilation, protocol.

    Only what the results.json records: a point that failed before its backend started has no
    hardware phrase (not "unknown hardware"), an unreadable one no setting at all ("").
    """
    return ", ".join(_setting_parts(doc))


def _setting_parts(doc: dict) -> list[str]:
    """``_setting``'s phrases, in order."""
    model = doc.get("model") or {}
    wl = doc.get("workload") or {}
    bench = doc.get("bench") or {}
    parts = [_hardware(doc.get("device") or {})]
    if model.get("name"):
        if "lora_rank" in model:
            tuning = f" (LoRA rank {model['lora_rank']})" if model["lora_rank"] else " (full fine-tuning)"
        else:
            tuning = ""
        parts.append(f"model `{model['name']}`{tuning}")
    if wl.get("n_examples"):
        source = (wl.get("dataset") or {}).get("path")  # your own data: the file (or folder) it came from
        spread = f", median {wl['median_len']:,}" if wl.get("median_len") is not None else ""
        if wl.get("p99_len") is not None and wl["n_examples"] >= P99_FROM:  # below 100 sequences p99 is the longest
            spread += f", p99 {wl['p99_len']:,}"
        parts.append(
            f"workload `{wl.get('name')}`" + (f" from `{Path(source).name}`" if source else "")
            + f" ({wl['n_examples']} examples, {wl.get('total_tokens', 0):,} tokens, "
            f"{wl.get('min_len', 0):,}–{wl.get('max_len', 0):,} per sequence{spread})"
        )
    elif wl.get("name"):
        parts.append(f"workload `{wl['name']}`")
    if doc.get("gc") is not None:
        parts.append(f"gradient checkpointing {'on' if doc['gc'] else 'off'}")
    if (model.get("built") or {}).get("compile"):  # backend.compile: its own setting, with its own mbs=1 baseline
        parts.append("torch.compile per decoder layer")
    parts.append(_precision(doc.get("precision")))
    if _dry_run(doc):
        parts.append("not timed (dry run)")  # a dry run plans; its bench settings were never used
    elif bench.get("repeat") is not None:
        warmup = f"{bench['warmup']} warm-up + " if bench.get("warmup") is not None else ""
        parts.append(f"{warmup}{bench['repeat']} timed repeats")
    return [p for p in parts if p]


# Fewer sequences than this: no p99 in a setting's header (the 99th percentile of 24 lengths is the longest, already
# shown as the range's end).
P99_FROM = 100

_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _precision(p: Optional[dict]) -> str:
    """``precision`` of results.json in a few words: "bf16 params, fp32 adapters, bf16 compute, fp32 reduce"."""
    if not p:
        return ""
    short = lambda d: _SHORT_DTYPE.get(d, d)  # noqa: E731
    parts = [f"{short(p[k])} {k}" for k in ("params", "adapters", "compute") if p.get(k)]
    parts.append(f"{short(p['reduce'])} reduce" if p.get("reduce") else "no reduce (one process)")
    return ", ".join(parts)


def _kernels(passes: dict) -> Optional[str]:
    """The kernels forward + backward ran (``passes.forward_backward.kernels``), as one line."""
    record = (passes.get("forward_backward") or {}).get("kernels")
    if not record:
        return None
    return ", ".join(f"{op}={'+'.join(impls)}" for op, impls in record.items())


def _cap(doc: dict, plan: dict) -> Optional[int]:
    """The cap on sequences per micro-batch that ran (the plan a backend reports), else the one recorded; None: no
    cap."""
    cap = plan.get("max_seqs_per_microbatch")
    return cap if cap is not None else doc.get("max_seqs_per_microbatch")


def _shares(doc: dict) -> Optional[str]:
    """Whose measurement a shared row shows, as the table names that row ("mtpm=65,536"); None: measured itself."""
    shares = doc.get("shares")
    if not isinstance(shares, dict):
        return None
    if shares.get("mtpm") is not None:
        return f"mtpm={shares['mtpm']:,}" if isinstance(shares["mtpm"], int) else f"mtpm={shares['mtpm']}"
    return f"mbs={shares.get('mbs')}"


def _cost_model(doc: dict, plan: dict, unreadable: bool) -> Optional[str]:
    """flops or calibrated: a calibrated plan's cost model carries its fit; results written before either say flops."""
    if unreadable:
        return None
    if isinstance(plan.get("cost_model"), dict) and plan["cost_model"].get("coefficients") is not None:
        return "calibrated"
    return "flops"


def _auto(doc: dict) -> Optional[dict]:
    auto = doc.get("auto")
    return auto if isinstance(auto, dict) else None


def row_of(path: Path, doc: dict) -> dict:
    plan = doc.get("plan") or {}
    passes = doc.get("passes") or {}
    unreadable = doc.get("status") == "unreadable"
    row = {
        "path": str(path),
        "backend": doc.get("backend"),
        "devices": _devices(doc),
        "setting": _setting(doc),
        "mbs": doc.get("mbs"),
        "mtpm": doc.get("mtpm"),
        # results written before the balanced planner ran the original planner's: greedy, padded
        # (an unreadable file records no run at all: nothing to default)
        "planner": plan.get("planner") or doc.get("planner") or (None if unreadable else "greedy"),
        "layout": plan.get("layout") or doc.get("layout") or (None if unreadable else "padded"),
        # at most this many sequences per micro-batch; results written before the cap had none (null)
        "max_seqs_per_microbatch": _cap(doc, plan),
        "status": doc.get("status"),
        "error": doc.get("error"),
        "pad_efficiency": plan.get("pad_efficiency"),
        "critical_path": plan.get("critical_path"),
        "cost_imbalance": plan.get("cost_imbalance"),
        "idle_fraction": plan.get("idle_fraction"),  # modeled, per rank (results before the timeline had none)
        # what the balanced planner balanced: flops, or calibrated seconds (older results: flops)
        "cost_model": _cost_model(doc, plan, unreadable),
        "steps": plan.get("steps"),
        "lower_bound_steps": plan.get("lower_bound_steps"),
        "n_microbatches": plan.get("n_microbatches"),
        "n_dummy": plan.get("n_dummy"),
        "max_microbatch_padded_tokens": plan.get("max_microbatch_padded_tokens"),
        "precision": _precision(doc.get("precision")) or None,
        "kernels": _kernels(passes),
        "started_at": doc.get("started_at"),
        "overrides": " ".join(_overrides(path, doc)),
        # the point planned exactly as an earlier one of its sweep and shares that measurement (its budget, or None)
        "shares_mtpm": _shares(doc),
        "auto": _auto(doc),  # mtpm=auto: the search's summary (harness/auto/model.py), else None
        # fwd+bwd over mbs=1 measured in pairs beside it ({median, ci, pairs, ...}); None: not paired
        "paired_speedup": doc.get("speedup") if isinstance(doc.get("speedup"), dict) else None,
    }
    mems = []
    rank_peaks: list = []
    for p in PASSES:
        rec = passes.get(p) or {}
        row[f"{p}_tok_per_s"] = rec.get("tok_per_s")
        row[f"{p}_util_pct"] = rec.get("util_pct")
        row[f"{p}_mem_pct"] = rec.get("mem_pct")
        row[f"{p}_mem_peak_bytes"] = rec.get("mem_peak_bytes")
        row[f"{p}_mfu_pct"] = rec.get("mfu_pct")
        row[f"{p}_measured_critical_path"] = rec.get("measured_critical_path")  # from the ranks' step times
        row[f"{p}_tok_per_s_median"] = rec.get("tok_per_s_median")  # the repeats' spread (harness/metrics/spread.py)
        row[f"{p}_tok_per_s_ci"] = rec.get("tok_per_s_ci")
        row[f"{p}_tok_per_s_ci_pct"] = rec.get("tok_per_s_ci_pct")
        row[f"{p}_noisy"] = rec.get("noisy")
        # how many timed repeats the interval is made of (results before ``repeats``: the elapsed times recorded)
        row[f"{p}_repeats"] = rec.get("repeats") or (len(rec["elapsed_s"]) if isinstance(rec.get("elapsed_s"), list)
                                                     else None)
        row[f"{p}_idle_fraction"] = rec.get("idle_fraction")
        if rec.get("mem_pct") is not None:
            mems.append(rec["mem_pct"])
        rank_peaks = _max_per_rank(rank_peaks, rec.get("mem_peak_bytes") or [])
    # Each rank's peak over both passes, of a point that ran both: one that ran out of memory (or failed) in fwd+bwd
    # peaked above anything its finished forward pass recorded, so that figure is not shown as its peak.
    finished = doc.get("status") == "ok"
    row["peak_mem_pct"] = max(mems) if mems and finished else None
    row["peak_mem_bytes_per_rank"] = (rank_peaks or None) if finished else None
    return row


def _max_per_rank(a: list, b: list) -> list:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    known = lambda x, y: y if x is None else x if y is None else max(x, y)  # noqa: E731
    return [known(x, shorter[i] if i < len(shorter) else None) for i, x in enumerate(longer)]


_JSON_TYPE = {dict: "an object", list: "an array", str: "a string", bool: "true or false", int: "a number",
              float: "a number", type(None): "null"}
# The keys the report reads, by what each must be (or null): a results.json with another shape is unreadable.
_KINDS = {"object": (dict,), "number": (int, float), "string": (str,), "list": (list,)}
_SHAPE = {
    "object": ("device", "model", "workload", "bench", "plan", "passes", "precision", "shares", "auto", "speedup"),
    "number": (
        "mtpm",
        "mbs",
        "max_seqs_per_microbatch",
        "world_size",
        "workload.n_examples",
        "workload.total_tokens",
        "workload.min_len",
        "workload.max_len",
        "plan.pad_efficiency",
        "plan.critical_path",
        "plan.cost_imbalance",
        "plan.steps",
        "plan.lower_bound_steps",
        "plan.max_microbatch_padded_tokens",
        "plan.max_seqs_per_microbatch",
    ),
    "string": ("status", "backend", "planner", "layout", "started_at", "plan.planner", "plan.layout"),
    "list": ("overrides", "plan.n_microbatches", "plan.n_dummy", "plan.idle_fraction"),
}
_PASS_SHAPE = {"number": ("tok_per_s", "util_pct", "mem_pct", "mfu_pct", "measured_critical_path"),
               "list": ("mem_peak_bytes", "idle_fraction")}


def _kind_problem(doc: dict, key: str, kind: str, prefix: str = "") -> Optional[str]:
    """Why ``doc``'s (dotted) ``key`` is not a ``kind`` or null, or None when it is (or is absent)."""
    *outer, last = key.split(".")
    value = doc
    for k in outer:
        value = value.get(k) or {}
    value = value.get(last)
    if value is None or (isinstance(value, _KINDS[kind]) and not isinstance(value, bool)):
        return None
    found = _JSON_TYPE.get(type(value), type(value).__name__)
    return f"'{prefix}{key}' is {found}, not {'an' if kind == 'object' else 'a'} {kind} or null"


def shape_problem(doc) -> Optional[str]:
    """What keeps ``doc`` from being read as a results.json (the keys the report reads), or None."""
    if not isinstance(doc, dict):
        return f"holds {_JSON_TYPE.get(type(doc), type(doc).__name__)}, not a JSON object"
    for kind, keys in _SHAPE.items():  # objects first: the dotted keys after them read into them
        for key in keys:
            problem = _kind_problem(doc, key, kind)
            if problem:
                return problem
    for name, rec in (doc.get("passes") or {}).items():
        problem = _kind_problem(doc["passes"], name, "object", "passes.")
        for kind, keys in _PASS_SHAPE.items():
            for key in keys:
                problem = problem or _kind_problem(rec or {}, key, kind, f"passes.{name}.")
        if problem:
            return problem
    return None


def read_results(path: Path) -> dict:
    """``path``'s results.json document; one that cannot be read as such is a warning naming it and an "unreadable"
    row."""
    try:
        doc = json.loads(Path(path).read_text())
        problem = shape_problem(doc)
    except (OSError, ValueError) as exc:  # ValueError: torn JSON, not UTF-8
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if problem is None:
        if reported_status(doc) == "died":  # "running", and the process writing it is gone
            proc = doc.get("process") or {}
            return {**doc, "status": "died", "error": doc.get("error") or (
                f"the process writing it (pid {proc.get('pid')} on {proc.get('host')}) is gone: killed, or its job "
                "ended before the point finished")}
        return doc
    log.warning("%s: unreadable (%s); shown as an unreadable row", path, problem)
    return {"status": "unreadable", "error": problem}


def collect(dirs: Iterable[Path]) -> pd.DataFrame:
    """Every results.json under ``dirs`` as a row; unreadable files are a warning and a row, never silently dropped."""
    rows, parts = [], []
    for path in find_results(dirs):
        doc = read_results(path)
        try:
            rows.append(row_of(path, doc))
            # a point that stopped before its backend reported its devices records only part of its setting
            parts.append((_setting_parts(doc), bool(doc.get("device"))))
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a shape shape_problem does not check
            log.warning("%s: unreadable (%s: %s); shown as an unreadable row", path, type(exc).__name__, exc)
            rows.append(row_of(path, {"status": "unreadable", "error": f"{type(exc).__name__}: {exc}"}))
            parts.append(([], False))
    _join_known_settings(rows, parts)
    df = pd.DataFrame(rows)
    return sort_rows(df) if not df.empty else df


def _fits(phrase: str, full: list[str]) -> bool:
    """A partial setting's phrase is one of ``full``'s, or its start (``workload `smoke``` of the workload's whole
    phrase with its sizes)."""
    return any(f == phrase or f.startswith(phrase + " ") for f in full)


def _join_known_settings(rows: list[dict], parts: list) -> None:
    """A point refused or failed before its backend reported (no devices, no workload sizes, no precision) goes into
    the table of the one setting of the others whose phrases hold each of its own, so a refused point of a sweep is a
    row of the sweep's table, not a table of its own under a header made of what it never ran; where no setting or
    several fit, it keeps the part it recorded. ``parts``: each row's (phrases, whether its backend reported)."""
    known = {r["setting"]: phrases for r, (phrases, started) in zip(rows, parts) if started and phrases}
    for r, (phrases, started) in zip(rows, parts):
        if started or not phrases:
            continue
        fits = [s for s, full in known.items() if all(_fits(x, full) for x in phrases)]
        if len(fits) == 1:
            r["setting"] = fits[0]


def sort_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Per backend: fixed-mbs rows first (by mbs), then mtpm ascending; greedy before balanced, padded before packed,
    no cap on sequences per micro-batch before the caps (ascending)."""
    key = pd.DataFrame(
        {
            "unrecorded": df["setting"] == "",  # rows whose results.json records no setting: their table last
            "setting": df["setting"],
            "backend": df["backend"].map(lambda b: BACKEND_ORDER.get(b, 9)),
            # fixed-mbs rows first; an mtpm=auto row (a budget, chosen or not yet) among the budgets
            "budget": [0 if fixed and not isinstance(auto, dict) else 1 for fixed, auto in zip(df["mtpm"].isna(),
                                                                                                 df["auto"])],
            "mtpm": df["mtpm"].fillna(0),
            "mbs": df["mbs"].fillna(0),
            "planner": df["planner"].map(lambda p: PLANNER_ORDER.get(p, 9)),
            "layout": df["layout"].map(lambda x: LAYOUT_ORDER.get(x, 9)),
            "max_seqs": df["max_seqs_per_microbatch"].fillna(0),  # no cap first, then caps ascending
            "started": df["started_at"].fillna(""),
        }
    )
    columns = ["unrecorded", "setting", "backend", "budget", "mtpm", "mbs", "planner", "layout", "max_seqs", "started"]
    order = key.sort_values(columns, kind="stable").index
    return df.loc[order].reset_index(drop=True)


def settings_of(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["setting"])) if not df.empty else []
