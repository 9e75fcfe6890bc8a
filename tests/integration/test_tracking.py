"""W&B: a real offline run per point, in the point's folder, grouped by sweep, finished even on failure."""

from __future__ import annotations

import pytest

from tests.conftest import harness_env, run_harness, sweep_results
from tests.wandb_records import run_contents


@pytest.fixture(scope="module")
def offline_sweep(golden_sweep):
    """The session's two-point sweep, run with W&B offline (tests/conftest.py's golden_sweep)."""
    return golden_sweep


def test_two_points_leave_two_offline_runs_in_their_folders(offline_sweep):
    files = sorted(offline_sweep.glob("*/wandb/offline-run-*/run-*.wandb"))
    assert [f.relative_to(offline_sweep).parts[0] for f in files] == ["0", "1"]
    runs = [run_contents(f) for f in files]
    results = sweep_results(offline_sweep)
    # the planner and layout that ran, in the name where they are not the original greedy padded ones
    assert [r["name"] for r in runs] == ["pytorch-mtpm600-balanced-packed", "pytorch-mtpm100000-balanced-packed"]
    # the sweep's folder names the group
    assert runs[0]["group"] == runs[1]["group"] == f"{offline_sweep.parent.name}_{offline_sweep.name}"
    for run, res in zip(runs, results):
        assert run["config"]["mtpm"] == res["mtpm"]
        assert run["config"]["backend"]["name"] == "pytorch"
        assert run["config"]["workload"]["name"] == "smoke"
        s = run["summary"]
        assert s["status"] == "ok"
        assert s["passes/forward/tok_per_s"] == pytest.approx(res["passes"]["forward"]["tok_per_s"])
        assert s["passes/forward_backward/tok_per_s"] == pytest.approx(res["passes"]["forward_backward"]["tok_per_s"])
        assert s["plan/pad_efficiency"] == pytest.approx(res["plan"]["pad_efficiency"])
        # the precision that ran and the kernels each pass ran, under results.json's names
        assert s["precision/compute"] == res["precision"]["compute"] == "float32"
        assert (
            s["passes/forward/kernels/delta_rule/segment-scan"]
            == res["passes"]["forward"]["kernels"]["delta_rule"]["segment-scan"]
            > 0
        )
        repeats = [h for h in run["history"] if "repeats/forward_backward/elapsed_s" in h]
        assert [h["repeats/forward_backward/elapsed_s"] for h in repeats] == pytest.approx(
            res["passes"]["forward_backward"]["elapsed_s"]
        )


def test_a_failed_point_still_finishes_its_run_and_the_next_starts(tmp_path):
    """Point 0 fails mid-measurement, after its W&B run started (a pass time-out of 1 ns); its own run is finished."""
    sweep = tmp_path / "sweep"
    proc = run_harness(
        "-m", "bench.pass_timeout_s=1e-9,null", "backend=pytorch", "workload=smoke", "bench.warmup=0", "bench.repeat=1",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=harness_env(WANDB_MODE="offline"),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed, ok = sweep_results(sweep)
    assert failed["status"] == "timeout" and ok["status"] == "ok"
    runs = [run_contents(f) for point in ("0", "1") for f in sweep.glob(f"{point}/wandb/offline-run-*/run-*.wandb")]
    assert len(runs) == 2  # one run per point, the failed one included
    assert runs[0]["summary"]["status"] == "timeout" and "pass_timeout_s" in runs[0]["summary"]["error"]
    assert runs[0]["exit_code"] == 1  # finished, marked failed
    assert runs[1]["summary"]["status"] == "ok" and runs[1]["exit_code"] == 0


def test_logger_none_writes_no_wandb_files(tmp_path):
    run = tmp_path / "run"
    proc = run_harness("logger=none", "backend=pytorch", "workload=smoke", "workload.n_examples=2", "bench.warmup=0",
                       "bench.repeat=1", f"hydra.run.dir={run}", cwd=tmp_path, env=harness_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (run / "wandb").exists()


def _logged_plan_image(run: dict) -> dict:
    rows = [h for h in run["history"] if h.get("plan/figure/_type") == "image-file"]
    assert len(rows) == 1, run["history"]
    return {k.removeprefix("plan/figure/"): v for k, v in rows[0].items() if k.startswith("plan/figure/")}


def test_the_run_logs_the_plan_figure_as_an_image(tmp_path):
    """A real offline run: the figure drawn from the point's plan.json is the image the run logged."""
    import hashlib
    import json

    from harness.point.tracking import Tracker
    from tests.plan_docs import greedy_doc

    doc, plan = greedy_doc([3000, 2000, 1200, 900, 400, 300, 120], 2, 4096)
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    tracker = Tracker({"name": "wandb", "mode": "offline"}, tmp_path, {"mtpm": 4096}, "fsdp2-mtpm4096", None)
    tracker.finish({"status": "ok", "plan": plan.stats.as_dict()})
    # run.finish() returns before W&B's service has closed the run's transaction log: the service
    # buffers the records and writes them when it closes the stream, which it is only told to do
    # (not waited for). A loaded machine once let this test read the bare 7-byte header. Shutting
    # the service down waits for it to close every stream: after that the file is complete.
    import wandb

    wandb.teardown()
    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    run = run_contents(wandb_file)
    image = _logged_plan_image(run)
    drawn = (tmp_path / "plan.png").read_bytes()
    assert image["format"] == "png" and image["sha256"] == hashlib.sha256(drawn).hexdigest()
    assert (wandb_file.parent / "files" / image["path"]).read_bytes() == drawn
    # the numbers stay beside it
    assert run["summary"]["plan/pad_efficiency"] == pytest.approx(plan.stats.pad_efficiency)
    assert run["exit_code"] == 0


def test_sweep_runs_log_their_plan_figures(offline_sweep):
    for wandb_file in sorted(offline_sweep.glob("*/wandb/offline-run-*/run-*.wandb")):
        assert _logged_plan_image(run_contents(wandb_file))["format"] == "png"
        assert (wandb_file.parents[2] / "plan.png").exists()


def test_a_point_at_its_memory_limit_still_gets_its_run(tmp_path):
    """The pytorch backend's bench.memory_limit_gb is the harness process's own RLIMIT_DATA, and a pass ends near it
    (glibc keeps the freed heap): W&B, imported and started there with 4 MB of room, could not map its shared objects
    or start a thread, and the point had no run (two CI failures of mtpm=auto). It starts beside the limit, and the
    limit is back after (in a process of its own: the limit must not reach pytest)."""
    import subprocess
    import sys

    code = f"""
import resource
from backends.runtime.memory import data_segment_bytes
from harness.point.tracking import Tracker
hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
limit = data_segment_bytes() + 4 * 1024**2
resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
tracker = Tracker({{"name": "wandb", "mode": "offline"}}, {str(tmp_path)!r}, {{}}, "at-the-limit", None)
assert tracker.run is not None
assert resource.getrlimit(resource.RLIMIT_DATA) == (limit, hard)
tracker.finish({{"status": "ok", "passes": {{"forward": {{"tok_per_s": 123.5}}}}}})
assert resource.getrlimit(resource.RLIMIT_DATA) == (limit, hard)
resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
import wandb
wandb.teardown()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=harness_env(WANDB_MODE="offline"))
    (record,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    run = run_contents(record)
    assert run["name"] == "at-the-limit" and run["exit_code"] == 0
    assert run["summary"]["passes/forward/tok_per_s"] == 123.5
