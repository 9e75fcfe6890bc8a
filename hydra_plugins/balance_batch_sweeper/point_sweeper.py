"""Hydra's basic sweeper, plus: each point once, an mbs=1 baseline per setting, and a point's folder found by its
overrides (see harness/sweep/points.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

DEFAULT_SUBDIR = "${hydra.job.num}"
SUBDIR_KEY = "hydra.sweep.subdir="  # the override that places a point in the folder split_arguments chose


def keep_earlier_sweep_config(sweep_dir: Path) -> Optional[Path]:
    """Before Hydra writes this run's multirun.yaml: keep the earlier run's as multirun.<n>.yaml (0 the first run's).

    multirun.yaml stays the latest run's, as Hydra writes it; a resume no longer erases what the sweep first was.
    """
    current = sweep_dir / "multirun.yaml"
    if not current.is_file():
        return None
    n = 0
    while (sweep_dir / f"multirun.{n}.yaml").exists():
        n += 1
    kept = sweep_dir / f"multirun.{n}.yaml"
    kept.write_bytes(current.read_bytes())
    log.info("resume: the earlier run's multirun.yaml is kept as %s", kept.name)
    return kept


def _compose(loader, config, job):
    """A job's composed config, or None when it does not compose (the point itself reports why)."""
    try:
        return loader.load_sweep_config(config, list(job))
    except Exception:  # noqa: BLE001 - the point reports why when it runs
        return None


def expand_swept_presets(jobs: List[List[str]], compose: Callable[[List[str]], Any],
                         split: Callable[[List[str]], List[List[str]]]) -> List[List[str]]:
    """Each job whose config sweeps keys of its own that the job does not set (a preset chosen in a sweep list,
    ``-m batching=peers,greedy_padded``, whose planner list Hydra reads only from the primary config) as the jobs of
    that sweep: what the preset says, as when it is the only value. ``split`` expands a list of overrides as the
    basic sweeper does."""
    from harness.sweep.points import unswept

    out: List[List[str]] = []
    for job in jobs:
        config = compose(job)
        params = OmegaConf.select(config, "hydra.sweeper.params", default=None) if config is not None else None
        more = unswept(params, job)
        out.extend(split(job + [f"{k}={v}" for k, v in more.items()]) if more else [job])
    return out


class PointSweeper(BasicSweeper):
    """Expands the sweep like BasicSweeper, then de-duplicates it and places each point before anything is written."""

    def split_arguments(self, overrides: List[Override], max_batch_size: Optional[int]) -> List[List[List[str]]]:
        from harness.app.config import check_sweep_calibration
        from harness.sweep.points import add_baselines, check_writable, dedupe, place_points

        assert self.config is not None and self.hydra_context is not None
        loader = self.hydra_context.config_loader
        composed: Dict[tuple, Any] = {}
        self._composed = composed

        def compose(job):  # each job composed once, for both steps below
            key = tuple(job)
            if key not in composed:
                composed[key] = _compose(loader, self.config, job)
            return composed[key]

        parser = OverridesParser.create(config_loader=loader)
        jobs = expand_swept_presets(BasicSweeper.split_arguments(overrides, None)[0], compose,
                                    lambda job: BasicSweeper.split_arguments(parser.parse_overrides(job), None)[0])
        jobs = dedupe(jobs)
        check_sweep_calibration([compose(job) for job in jobs])
        jobs = add_baselines(jobs, compose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        check_writable("hydra.sweep.dir", sweep_dir)
        from harness.sweep.lock import acquire, release

        lock = acquire(sweep_dir)  # one sweep at a time in a folder, from before its points are placed to its report
        resume = bool(OmegaConf.select(self.config, "resume", default=False))
        subdir = OmegaConf.to_container(self.config.hydra.sweep, resolve=False).get("subdir")
        try:
            folders = place_points(jobs, sweep_dir, resume)
        except Exception:
            release(lock)  # refused: no point of this sweep runs there
            raise
        if resume:
            keep_earlier_sweep_config(sweep_dir)
            from harness.app.state import STATE

            # the points this run lists: an earlier point left out of the list does not decide its exit status
            STATE.sweep_folders = set(folders) if subdir == DEFAULT_SUBDIR and all(folders) else None
        if subdir == DEFAULT_SUBDIR:  # a user's own subdir pattern is left alone
            jobs = [
                job + [f"{SUBDIR_KEY}{folder}"] if folder is not None else job
                for job, folder in zip(jobs, folders)
            ]
        return [list(chunk) for chunk in BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size)]

    def validate_batch_is_legal(self, batch) -> None:
        """Hydra's check that each job composes, left out for the jobs ``split_arguments`` composed already (the
        folder it placed a point in aside): composing a point costs about a tenth of a second, and Hydra's launcher
        composes each job once more to run it. A job that did not compose there is composed again, and fails as in
        Hydra."""
        composed = getattr(self, "_composed", {})
        left = [job for job in batch
                if composed.get(tuple(o for o in job if not o.startswith(SUBDIR_KEY))) is None]
        super().validate_batch_is_legal(left)
