"""Hydra callbacks: check a single run's folder before it starts; after a multirun, write the report (table, CSV,
plots, plan figures) into the sweep folder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("harness.callbacks")  # the log channel's name, kept when the module moved


FAILED_STATUSES = ("error", "timeout", "running", "died", "interrupted", "unreadable")


def record_sweep_status(sweep_dir: Path) -> None:
    """Make the sweep's exit status reflect every point, also those a launcher ran in other processes."""
    import json

    from harness.app.state import EXIT_FAILED, STATE
    from harness.point.results import reported_status

    for path in sorted(sweep_dir.glob("*/results.json")):
        try:
            doc = json.loads(path.read_text())
            status = reported_status(doc) if isinstance(doc, dict) else "unreadable"  # "[]" must not stop the report
        except (OSError, ValueError):
            status = "unreadable"
        if status not in FAILED_STATUSES:
            continue
        if STATE.sweep_folders is not None and path.parent.name not in STATE.sweep_folders:
            log.warning("%s: %s, from an earlier run of this sweep and not in this run's list: it does not decide "
                        "the exit status (the report still shows it; list it again, or remove its folder)",
                        path.parent, status)
            continue
        STATE.record(EXIT_FAILED)


class RunFolderCallback(Callback):
    """Before a single run: its folder must be writable and hold no other run's results (multiruns: the sweeper
    checks)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from backends.errors import UserError
        from harness.app.cli import StartRefused
        from harness.sweep.points import check_run_folder, check_writable

        run_dir = Path(str(config.hydra.run.dir))
        try:
            check_writable("hydra.run.dir", run_dir)
            check_run_folder("hydra.run.dir", run_dir, list(config.hydra.overrides.task), bool(config.get("resume")))
        except UserError as exc:
            raise StartRefused(str(exc)) from None


class ReportCallback(Callback):
    """Runs ``python -m reports SWEEP`` in-process at the end of a multirun.

    A failing report is logged and never touches the results; a failed point
    never stops the report (it shows in the table with its status).
    ``plots`` (``hydra.callbacks.report.plots``): false writes the report
    without its figures (``python -m reports SWEEP --no-plots``); a sweep of
    many points spends about half a CPU-second per point drawing its plan.
    """

    def __init__(self, plots: bool = True):
        if not isinstance(plots, bool):
            raise ValueError(f"hydra.callbacks.report.plots: true or false, got {plots!r}")
        self.plots = plots

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from harness.sweep.hot import HOT
        from harness.sweep.lock import LOCK_FILE, release

        HOT.close()  # a hot sweep's backend lives until its last point
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        try:
            self._report(sweep_dir)
        finally:
            release(sweep_dir / LOCK_FILE)  # the sweep's folder is free for the next sweep once its report is written

    def _report(self, sweep_dir: Path) -> None:
        from harness.sweep.points import result_files

        record_sweep_status(sweep_dir)
        if not result_files(sweep_dir):
            return
        try:
            from reports.__main__ import parse_args, report

            # python -m reports SWEEP, the one place a report is built: it prints the answer, the short table and
            # the paths it wrote (figures only where it drew some)
            report(parse_args([str(sweep_dir)] + ([] if self.plots else ["--no-plots"])))
        except Exception as exc:  # noqa: BLE001 - the results are already on disk
            log.warning("report for %s failed (%s: %s); results.json files are intact; "
                        "retry with: python -m reports %s",
                        sweep_dir, type(exc).__name__, exc, sweep_dir)


class SingleRunCallback(Callback):
    """Before a single run (``python -m harness`` or ``harness.serve`` without -m): a batching knob its config sweeps
    (``batching=peers``'s planner list) and it does not set is refused in one line, not dropped for the knob's
    default (harness/sweep/points.py, check_single_run)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        from backends.errors import UserError
        from harness.app.cli import StartRefused
        from harness.sweep.points import check_single_run

        params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
        preset = OmegaConf.select(config, "hydra.runtime.choices.batching", default=None)
        try:
            check_single_run(params, list(config.hydra.overrides.task), preset, server=config.hydra.job.name == "serve")
        except UserError as exc:
            raise StartRefused(str(exc)) from None
