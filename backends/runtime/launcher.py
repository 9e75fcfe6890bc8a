"""How this process was launched, read from its environment: torchrun, a Slurm step (``srun``) or RANK/WORLD_SIZE
set by something else, or none (the harness spawns its own ranks); and the world size a launcher fixes.

Pure functions of the environment, no store and no torch: backends/runtime/job.py connects a launched
process to its job.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from backends.errors import UserError
from backends.registry import is_distributed, valid_names


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a launched job, read from the launcher's environment."""

    launcher: str  # torchrun, slurm or env (RANK/WORLD_SIZE set by something else)
    rank: int
    world_size: int
    local_rank: int
    nnodes: int
    master_addr: str
    master_port: int

    def record(self) -> dict:
        return {"launcher": self.launcher, "nnodes": self.nnodes, "world_size": self.world_size}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[07-09,12],cpu3' -> 'gpu07'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return nodelist
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(environ, *names: str) -> Optional[int]:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            return int(value.split("(")[0])  # SLURM_TASKS_PER_NODE style '4(x2)' never reaches here, but be safe
    return None


def detect_launch(environ=None) -> Optional[LaunchEnv]:
    """The launched job this process is a rank of, or None when the harness starts its own ranks.

    torchrun (and submitit's exported torch environment) set RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR and MASTER_PORT. A Slurm step (``srun``) with more
    than one task sets SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID;
    the store then lives on the first node of the step, at MASTER_PORT if set,
    else a port derived from the job and step ids. A one-task Slurm job
    (``hydra/launcher=slurm`` with one task per node) is not a launched job: the
    harness spawns one rank per GPU itself.
    """
    env = os.environ if environ is None else environ
    slurm = "SLURM_JOB_ID" in env
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        local_world = _int(env, "LOCAL_WORLD_SIZE")
        if "TORCHELASTIC_RUN_ID" in env:
            launcher = "torchrun"
        else:
            launcher = "slurm" if slurm else "env"
        nnodes = (_int(env, "GROUP_WORLD_SIZE") if launcher == "torchrun" else None) \
            or (_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES") if slurm else None) \
            or (max(1, world_size // local_world) if local_world else 1)
        return LaunchEnv(launcher, int(env["RANK"]), world_size, _int(env, "LOCAL_RANK") or 0, nnodes,
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")))
    # SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: a batch script run with --ntasks=8 is no rank; an srun step is.
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if slurm and "SLURM_PROCID" in env and ntasks and ntasks > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        # a port of the job's own, so two jobs (or two steps of one job) sharing a node do not meet
        port = (
            _int(env, "MASTER_PORT") or 20000 + (int(env["SLURM_JOB_ID"]) + (_int(env, "SLURM_STEP_ID") or 0)) % 20000
        )
        return LaunchEnv("slurm", int(env["SLURM_PROCID"]), ntasks, _int(env, "SLURM_LOCALID") or 0,
                         _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES") or 1,
                         env.get("MASTER_ADDR") or first_host(nodelist), port)
    return None


def check_world_size(backend: str, world_size: Optional[int], env: LaunchEnv) -> int:
    """The launcher's world size; a ``world_size=`` that says otherwise, or a one-process backend, is a user error."""
    if not is_distributed(backend):
        if env.world_size != 1:
            raise UserError(f"backend.name: {backend} runs one process, but {env.launcher} started {env.world_size} "
                            f"ranks (valid under a launcher: {valid_names(distributed_only=True)})")
        return 1
    if world_size is not None and world_size != env.world_size:
        raise UserError(f"world_size: {world_size} conflicts with the {env.world_size} ranks {env.launcher} started "
                        f"(WORLD_SIZE={env.world_size}); leave world_size unset under a launcher")
    return env.world_size
