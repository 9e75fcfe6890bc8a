"""Hydra's task function body (harness/__main__.py): in a launched job only the lead measures
(harness/app/roles.py); a finished point is skipped on resume; else a ``Point`` runs and its exit code is recorded for
the CLI (harness/app/state.py)."""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from backends.errors import UserError
from harness.app.roles import follow, leads
from harness.app.state import EXIT_OK, EXIT_USER_ERROR, STATE
from harness.point.point import Point
from harness.point.setup import HydraRun

log = logging.getLogger("harness")


def skip_reason(cfg: DictConfig, hydra_run: HydraRun) -> str | None:
    """Why this point is not run (a finished result is kept); raises UserError for a folder it must not write."""
    from harness.sweep.points import check_run_folder, identity, read_result

    out_dir = hydra_run.out_dir
    previous = read_result(out_dir)
    if previous is None:
        return None
    # The sweeper and the run-folder callback check this before anything is written; this
    # also covers other sweepers and launchers: never overwrite another point's result.
    check_run_folder(hydra_run.folder_key, out_dir, hydra_run.overrides, bool(cfg.get("resume")))
    point = " ".join(identity(hydra_run.overrides)) or "this point"
    if previous.get("status") == "ok":
        return f"resume: {point} already ok in {out_dir}; skipped"
    if cfg.get("dry_run") and previous.get("status") != "planned":
        return f"resume: dry run; {point} keeps its {previous.get('status')} result in {out_dir}"
    return None


def run_point(cfg: DictConfig, job_spans_run: bool = False) -> int:
    """Hydra task function body: never raises for a failed point, records its exit code.

    In a launched job only the lead (global rank 0, harness/app/roles.py) measures and writes; it ends the
    job after this point unless ``job_spans_run`` (``python -m harness`` itself is the job's rank 0 and
    ends it after the last point; under submitit each point's Hydra job is the whole job).
    """
    if not leads():
        # Under submitit every task runs this Hydra job; only global rank 0 measures and writes.
        return follow()
    from backends.runtime.job import end_after_failure, launched_job

    job = launched_job()
    if job is None:
        return _run_point(cfg)
    try:
        code = _run_point(cfg)
        end_after_failure(code)  # a failed launched job runs no more points: every rank ends now
        return code
    finally:
        if not job_spans_run:
            job.finish()


def _run_point(cfg: DictConfig) -> int:
    hydra_run = HydraRun.current()
    STATE.last_dir = hydra_run.out_dir
    try:
        skip = skip_reason(cfg, hydra_run)
    except UserError as exc:
        log.error("%s", exc)
        STATE.record(EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    if skip is not None:
        log.info("%s", skip)
        return EXIT_OK
    code = Point(cfg, hydra_run).run()
    STATE.record(code)
    return code
