"""CPU threads under load: idle OpenMP threads sleep (harness/__init__.py), and a pass whose threads waited for cores
is flagged (backends/pytorch.py). scripts/bench_threads.py measures the settings."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from tests.conftest import REPO


def test_the_harness_makes_idle_openmp_threads_sleep_unless_the_user_said_otherwise():
    """Set when the package loads, before torch (which reads it once): a spinning thread held the core its partner
    waited for, 62.7 s a pass against 4.5 s on a loaded 2-core machine."""
    code = "import harness, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=run_env, capture_output=True, text=True,
                             timeout=60)
        assert out.stdout.strip() == expected, out.stdout + out.stderr


def test_a_pass_whose_threads_waited_for_cores_is_flagged_once(caplog):
    from backends.pytorch import PyTorchBackend

    backend = SimpleNamespace(device=torch.device("cpu"), threads_per_rank=2)  # what the check reads of a backend
    with caplog.at_level(logging.WARNING, logger="backends.pytorch"):
        PyTorchBackend._flag_waiting_threads(backend, "forward", cpu_s=0.6, step_s=4.0)  # 0.15 s a second
        PyTorchBackend._flag_waiting_threads(backend, "forward", cpu_s=3.8, step_s=4.0)  # one thread always busy
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("pytorch forward: its 2 thread(s) computed 0.60 CPU-seconds in the pass's 4.00 s: they "
                           "waited for cores busy elsewhere"), line
