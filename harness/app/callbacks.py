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
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from harness.sweep.hot import HOT

        HOT.close()  # a hot sweep's backend lives until its last point
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        record_sweep_status(sweep_dir)
        try:
            from reports.collect import collect
            from reports.plan_figure import write_plan_figures
            from reports.plots import write_length_histograms, write_plots, write_profile_figures
            from reports.render import markdown_tables, write_csv
            from reports.side_by_side import with_side_by_side

            df = collect([sweep_dir])
            if df.empty:
                return
            df["plan_png"] = write_plan_figures(df, sweep_dir)  # plots/plan-<point>.png, one linked per row
            df["lengths_png"] = write_length_histograms(df, sweep_dir)  # plots/lengths-<point>.png, one per setting
            df["profile_png"] = write_profile_figures(df, sweep_dir)  # plots/profile-<point>.png (bench.profile)
            table = with_side_by_side(markdown_tables(df, sweep_dir), df)  # several planners: side by side
            (sweep_dir / "report.md").write_text(table + "\n")
            write_csv(df, sweep_dir / "results.csv")
            write_plots(df, sweep_dir)
            log.info(
                "report: %s (table), %s, %s", sweep_dir / "report.md", sweep_dir / "results.csv", sweep_dir / "plots"
            )
            print(table, flush=True)
        except Exception as exc:  # noqa: BLE001 - the results are already on disk
            log.warning("report for %s failed (%s: %s); results.json files are intact; "
                        "retry with: python -m reports %s",
                        sweep_dir, type(exc).__name__, exc, sweep_dir)
