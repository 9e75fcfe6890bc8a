"""W&B: a real offline run per point, in the point's folder, grouped by sweep, finished even on failure."""

from __future__ import annotations

import pytest

from tests.conftest import harness_env, run_harness, sweep_results
from tests.wandb_records import run_contents

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offline_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    sweep = root / "sweep"
    proc = run_harness(
        "-m", "mtpm=600,100000", "backend=pytorch", "workload=smoke", "bench.warmup=0", "bench.repeat=2",
        f"hydra.sweep.dir={sweep}", cwd=root, env=harness_env(WANDB_MODE="offline"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep


def test_two_points_leave_two_offline_runs_in_their_folders(offline_sweep):
    files = sorted(offline_sweep.glob("*/wandb/offline-run-*/run-*.wandb"))
    assert [f.relative_to(offline_sweep).parts[0] for f in files] == ["0", "1"]
    runs = [run_contents(f) for f in files]
    results = sweep_results(offline_sweep)
    assert [r["name"] for r in runs] == ["pytorch-mtpm600", "pytorch-mtpm100000"]
    assert runs[0]["group"] == runs[1]["group"] == "wandb0_sweep"  # the sweep's folder names the group
    for run, res in zip(runs, results):
        assert run["config"]["mtpm"] == res["mtpm"]
        assert run["config"]["backend"]["name"] == "pytorch"
        assert run["config"]["workload"]["name"] == "smoke"
        s = run["summary"]
        assert s["status"] == "ok"
        assert s["passes/forward/tok_per_s"] == pytest.approx(res["passes"]["forward"]["tok_per_s"])
        assert s["passes/forward_backward/tok_per_s"] == pytest.approx(res["passes"]["forward_backward"]["tok_per_s"])
        assert s["plan/pad_efficiency"] == pytest.approx(res["plan"]["pad_efficiency"])
        repeats = [h for h in run["history"] if "repeats/forward_backward/elapsed_s" in h]
        assert [h["repeats/forward_backward/elapsed_s"] for h in repeats] == pytest.approx(
            res["passes"]["forward_backward"]["elapsed_s"]
        )


def test_a_failed_point_still_finishes_its_run_and_the_next_starts(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_harness(
        "-m", "model.path=/nope,null", "backend=pytorch", "workload=smoke", "bench.warmup=0", "bench.repeat=1",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=harness_env(WANDB_MODE="offline"),
    )
    assert proc.returncode == 2
    assert [r["status"] for r in sweep_results(sweep)] == ["error", "ok"]
    assert len(list(sweep.glob("1/wandb/offline-run-*/run-*.wandb"))) == 1


def test_logger_none_writes_no_wandb_files(tmp_path):
    run = tmp_path / "run"
    proc = run_harness("logger=none", "backend=pytorch", "workload=smoke", "workload.n_examples=2", "bench.warmup=0",
                       "bench.repeat=1", f"hydra.run.dir={run}", cwd=tmp_path, env=harness_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (run / "wandb").exists()
