"""``python -m harness``: the benchmark, a Hydra app over conf/ (under torchrun / srun: rank 0 runs it, the other ranks
follow)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from backends.runtime.collector import defer_full_collections, exit_with
from harness.app.cli import reaped, run_hydra_cli
from harness.app.roles import follow, leads, tell_launcher
from harness.app.state import STATE
from harness.point.task import run_point


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> int:
    # Also what the submitit launcher runs in each task: there every point's Hydra job is the whole launched job.
    return run_point(cfg)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main_spanning_job(cfg: DictConfig) -> int:
    # Rank 0 of a torchrun / srun job that this process itself is: the job lasts until main() ends it.
    return run_point(cfg, job_spans_run=True)


def main() -> int:
    """Run the benchmark (rank 0 of a launched job: every point, then end the job), or follow rank 0; return once
    every process it started has exited and been reaped."""
    defer_full_collections()  # before the imports a run makes (backends/runtime/collector.py)
    return reaped(_run)


def _run() -> int:
    from backends.errors import UserError
    from backends.runtime.job import launched_job

    try:
        lead = leads()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        tell_launcher(str(exc))
        return 2
    if not lead:
        return follow()  # one rank of a torchrun / Slurm job: it serves rank 0 (no Hydra, no files)
    job = launched_job()
    if job is None:
        return run_hydra_cli(_hydra_main, lambda: STATE.exit_code)
    try:
        return run_hydra_cli(_hydra_main_spanning_job, lambda: STATE.exit_code)
    finally:
        job.finish()  # the other ranks exit with this one


if __name__ == "__main__":
    exit_with(main())
