"""Sweep points and their folders: a point is what its overrides say, never its position in the list."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from backends.errors import UserError
from harness.app.batching import AUTO, KEYS, PRESETS, is_batching_key
from harness.point.results import RESULTS_FILE

log = logging.getLogger("harness.points")  # the log channel's name, kept when the module moved

# Keys that say how a point is run, not what it measures.
NOT_IDENTITY = ("resume", "dry_run", "bench.baseline", "bench.share_plans")
BASELINE = ("mtpm=null", "mbs=1")


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def unswept(params: Any, job: Sequence[str]) -> dict[str, str]:
    """What a config's own sweep (``hydra.sweeper.params``, e.g. batching=peers's planner list) sweeps that ``job``
    does not set: the keys and their values, which a multirun's job expands (the sweeper) and a single run would drop
    (``check_single_run``)."""
    typed = {override_key(o) for o in job}
    return {str(k): str(v) for k, v in (params or {}).items() if str(k).lstrip("+~") not in typed}


def check_single_run(params: Any, task: Sequence[str], preset: Optional[str], server: bool) -> None:
    """A run without -m whose config sweeps a batching knob it does not set (``batching=peers`` sweeps the planner)
    would run one point of that sweep, at the knob's default, and say nothing: a UserError of one line instead.
    ``preset``: the batching preset chosen (its name), ``server``: the run is ``python -m harness.serve``."""
    dropped = {k: v for k, v in unswept(params, task).items() if k in KEYS}
    if not dropped:
        return
    key, values = next(iter(dropped.items()))
    source = f"{PRESETS}={preset}" if preset and preset != "default" else "this config (hydra.sweeper.params)"
    if server:
        raise UserError(f"{key}: {source} sweeps it over {values}, and a server runs one: set {key}=<one of them>")
    raise UserError(f"{key}: {source} sweeps it over {values}, which only a multirun does: add -m to run them all, "
                    f"or set {key}=<one of them> for one point")


def identity(overrides: Iterable[str]) -> tuple[str, ...]:
    """What a point measures: its overrides, sorted, without hydra.* and the keys in NOT_IDENTITY."""
    return tuple(sorted(o for o in overrides
                        if override_key(o) not in NOT_IDENTITY and not override_key(o).startswith("hydra.")))


def read_result(folder: Path) -> Optional[dict]:
    """The folder's results.json, {"status": "unreadable"} when it cannot be read, None when there is none."""
    path = Path(folder) / RESULTS_FILE
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else {"status": "unreadable"}
    except (OSError, ValueError):
        return {"status": "unreadable"}


def recorded_overrides(folder: Path) -> Optional[list[str]]:
    """The overrides a point folder was run with: from its results.json, else from Hydra's .hydra/overrides.yaml."""
    doc = read_result(folder)
    if doc is not None and isinstance(doc.get("overrides"), list):
        return [str(o) for o in doc["overrides"]]
    hydra_file = Path(folder) / ".hydra" / "overrides.yaml"
    if hydra_file.is_file():
        import yaml

        try:
            data = yaml.safe_load(hydra_file.read_text())
        except (OSError, yaml.YAMLError):
            return None
        return [str(o) for o in data] if isinstance(data, list) else None
    return None


def result_files(sweep_dir: Path) -> list[Path]:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    return sorted(p for p in sweep_dir.rglob(RESULTS_FILE) if ".hydra" not in p.parts and "wandb" not in p.parts)


def check_writable(key: str, folder: Path) -> None:
    """Create ``folder`` and a file in it, or raise a one-line UserError naming ``key``."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        where = f" '{exc.filename}'" if exc.filename and str(exc.filename) != str(folder) else ""
        raise UserError(f"{key}: cannot write to {folder}{where} ({exc.strerror or exc}); "
                        "choose a writable folder") from None


def dedupe(jobs: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each point once, in first-seen order; a repeated one is dropped with a note (it would be a second row)."""
    seen: dict[tuple[str, ...], int] = {}
    out: list[list[str]] = []
    for job in jobs:
        key = identity(job)
        if key in seen:
            seen[key] += 1
            continue
        seen[key] = 1
        out.append(list(job))
    for key, count in seen.items():
        if count > 1:
            log.warning("sweep: %s is listed %d times; it is measured once", " ".join(key) or "the default point",
                        count)
    return out


def setting_of(job: Sequence[str]) -> tuple[str, ...]:
    """A point's overrides less its batching: the points of a sweep with the same setting compare with one baseline."""
    return tuple(o for o in identity(job) if not is_batching_key(override_key(o)))


def add_baselines(jobs: Sequence[Sequence[str]], compose: Callable[[Sequence[str]], Any]) -> list[list[str]]:
    """``jobs`` with an mbs=1 point ahead of each setting's first point where the setting has none.

    ``compose`` gives a job's composed config (the sweeper's config loader): whether a point is mbs=1 is what
    its config says (``batching=fixed_mbs1``, ``mtpm=null``, an experiment's defaults), not how it is spelled.
    Nothing is added for a setting whose config says ``bench.baseline=false``, for dry runs and runs against a
    server (``target.url``), nor for a setting whose every point is ``mtpm=auto`` (the search measures its own).
    """
    groups: dict[tuple[str, ...], list[Sequence[str]]] = {}
    for job in jobs:
        groups.setdefault(setting_of(job), []).append(job)
    first_of = {key: members[0] for key, members in groups.items()}
    added: dict[tuple[str, ...], list[str]] = {}
    for key, members in groups.items():
        configs = [compose(job) for job in members]
        if any(c is None for c in configs):  # a point that does not compose reports that itself
            continue
        head = configs[0]
        if not _select(head, "bench.baseline", True) or _select(head, "dry_run", False) or _select(head, "target.url"):
            continue
        if any(_budget(c) is None and _batch_size(c) == 1 for c in configs):
            continue
        if all(_budget(c) == AUTO for c in configs):
            continue
        baseline = [o for o in members[0] if not is_batching_key(override_key(o))] + list(BASELINE)
        added[key] = baseline
        log.info("sweep: %s has no mbs=1 point; measuring one (%s) as its speedup baseline "
                 "(bench.baseline=false: none)",
                 " ".join(key) or "the default setting", " ".join(BASELINE))
    out: list[list[str]] = []
    for job in jobs:
        key = setting_of(job)
        if key in added and job is first_of[key]:
            out.append(added[key])
        out.append(list(job))
    return out


def _budget(cfg: Any) -> Any:
    """The budget a point runs with (the knob, which a preset sets unless typed: harness/app/batching.py)."""
    return _select(cfg, "mtpm")


def _batch_size(cfg: Any) -> Any:
    return _select(cfg, "mbs")


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=default, throw_on_resolution_failure=False)
    except Exception:  # noqa: BLE001 - a config that does not resolve decides nothing here (the point reports it)
        return default


def _numbered_folders(sweep_dir: Path) -> list[Path]:
    if not sweep_dir.is_dir():
        return []
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def place_points(jobs: Sequence[Sequence[str]], sweep_dir: Path, resume: bool) -> list[Optional[str]]:
    """The folder (under ``sweep_dir``) each job runs in; None keeps Hydra's own (the job number).

    A sweep folder that already holds results is only reused with ``resume``.
    Then a point goes back to the folder that holds its earlier run (found by
    its overrides), and a new point gets a new number after the highest one,
    so no point ever lands in another point's folder.
    """
    sweep_dir = Path(sweep_dir)
    found = result_files(sweep_dir)
    if found and not resume:
        raise UserError(
            f"hydra.sweep.dir: {sweep_dir} already holds results ({len(found)} results.json); to continue that sweep "
            "and skip its finished points add resume=true, or choose another hydra.sweep.dir"
        )
    folders = _numbered_folders(sweep_dir)
    if not resume or not folders:
        return [None] * len(jobs)
    by_identity: dict[tuple[str, ...], str] = {}
    for folder in folders:
        overrides = recorded_overrides(folder)
        if overrides is not None:
            by_identity.setdefault(identity(overrides), folder.name)
    next_number = int(folders[-1].name) + 1
    placed: list[Optional[str]] = []
    for job in jobs:
        name = by_identity.get(identity(job))
        if name is None:
            name = str(next_number)
            next_number += 1
        placed.append(name)
    return placed


def check_run_folder(key: str, folder: Path, overrides: Sequence[str], resume: bool) -> None:
    """A folder holding a result is reused only by ``resume`` and only for the same point; else a UserError."""
    previous = read_result(folder)
    if previous is None:
        return
    status = previous.get("status")
    if not resume:
        raise UserError(
            f"{key}: {folder} already holds a result (status {status}); add resume=true to keep it when it is ok "
            f"(and measure it again when it is not), or choose another {key}"
        )
    theirs = recorded_overrides(folder)
    if theirs is None or identity(theirs) != identity(overrides):
        shown = " ".join(identity(theirs)) if theirs else "unknown overrides"
        raise UserError(f"{key}: {folder} holds the result of another point ({shown or 'the defaults'}); "
                        f"choose another {key}")
