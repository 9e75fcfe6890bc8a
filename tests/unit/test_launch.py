"""The launch environment read (torchrun, Slurm, none) and world_size checked against it, in-process (real torchrun
"nodes": tests/integration/test_launch.py)."""

from __future__ import annotations

import pytest

from backends.errors import UserError
from backends.runtime.launcher import LaunchEnv, check_world_size, detect_launch, first_host


def test_launch_environment_is_read_for_torchrun_slurm_and_none():
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2",
                "MASTER_ADDR": "n1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"}
    assert detect_launch(torchrun) == LaunchEnv("torchrun", 3, 4, 1, 2, "n1", 29400)
    srun = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    assert detect_launch(srun) == LaunchEnv("slurm", 5, 8, 1, 2, "gpu07", 20000 + 4242)
    # submitit's exported torch environment inside a Slurm job
    assert detect_launch({**srun, "RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "gpu07", "MASTER_PORT": "1234",
                          "LOCAL_RANK": "1"}).launcher == "slurm"
    # one Slurm task (hydra/launcher=slurm's default): the harness starts its own ranks
    assert detect_launch({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    # a batch script of an 8-task allocation, outside any srun step, is no rank either
    assert detect_launch({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None
    assert detect_launch({}) is None
    assert first_host("a[3-4,9],b1") == "a3" and first_host("solo") == "solo"


def test_world_size_comes_from_the_launcher():
    env = LaunchEnv("torchrun", 0, 2, 0, 2, "127.0.0.1", 1)
    assert check_world_size("fsdp2", None, env) == 2 and check_world_size("megatron_ddp", 2, env) == 2
    with pytest.raises(UserError, match=r"^world_size: 3 conflicts with the 2 ranks torchrun started"):
        check_world_size("fsdp2", 3, env)
    with pytest.raises(UserError, match=r"^backend.name: pytorch runs one process"):
        check_world_size("pytorch", None, env)
