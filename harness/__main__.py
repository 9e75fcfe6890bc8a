"""``python -m harness``: the benchmark, a Hydra app over conf/."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from harness.app import STATE, run_point
from harness.cli import run_hydra_cli


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> int:
    return run_point(cfg)


def main() -> int:
    return run_hydra_cli(_hydra_main, lambda: STATE.exit_code)


if __name__ == "__main__":
    sys.exit(main())
