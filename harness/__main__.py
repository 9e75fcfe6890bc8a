"""``python -m harness``: the benchmark, a Hydra app over conf/."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from harness.app import run_point
from harness.cli import run_hydra_cli
from harness.state import STATE


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> int:
    return run_point(cfg)


def main() -> int:
    from backends.runtime.job import detect_launch

    if detect_launch() is None:
        return run_hydra_cli(_hydra_main, lambda: STATE.exit_code)
    return _main_launched()


def _main_launched() -> int:
    """One rank of a torchrun / Slurm job: rank 0 runs the benchmark, every other rank serves it (no Hydra, no files)."""
    from backends.errors import UserError
    from backends.runtime.job import keep_job_until_exit, launched_job

    try:
        job = launched_job()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if job.rank != 0:
        from backends.runtime.launched import follow

        return follow(job)
    keep_job_until_exit()
    try:
        return run_hydra_cli(_hydra_main, lambda: STATE.exit_code)
    finally:
        job.finish()  # the other ranks exit with this one


if __name__ == "__main__":
    sys.exit(main())
