"""W&B sweep files, the submitit launcher presets and the experiment preset, as Hydra sees them."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import load_json, run_harness, run_python, sweep_results


def test_seed_b200_preset_plans_the_published_setting_on_this_machine(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_harness("-m", "experiment=seed_b200", "dry_run=true", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sweep_results(sweep)
    assert len(results) == 12
    assert {r["backend"] for r in results} == {"fsdp2", "megatron_ddp"}
    assert all(r["status"] == "planned" and r["world_size"] == 4 and r["gc"] is True for r in results)
    assert all(r["workload"]["total_tokens"] == 1_669_550 and r["model"]["name"] == "qwen3_5_35b_a3b" for r in results)
    assert sorted({r["mtpm"] for r in results if r["mtpm"]}) == [16384, 32768, 65536, 131072]
    assert sorted({r["mbs"] for r in results if r["mtpm"] is None}) == [1, 2]


def test_two_points_through_the_local_submitit_launcher(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_harness(
        "-m",
        "hydra/launcher=local",
        "mtpm=600,100000",
        "bench.baseline=false",
        "backend=pytorch",
        "workload=smoke",
        "bench.warmup=0",
        "bench.repeat=1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sweep_results(sweep)
    assert [(r["mtpm"], r["status"]) for r in results] == [(600, "ok"), (100000, "ok")]
    assert (sweep / ".submitit").is_dir()  # the jobs really went through submitit
    assert (sweep / "report.md").exists()


def test_slurm_preset_composes(tmp_path):
    proc = run_harness("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "mtpm=16384", "--cfg", "hydra",
                       cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    launcher = yaml.safe_load(proc.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["nodes"], launcher["gpus_per_node"], launcher["partition"]) == (1, 4, "gpu")
    assert launcher["timeout_min"] > 0


@pytest.mark.parametrize(
    "args", [("--cfg", "job"), ("mtpm=-3", "--cfg", "job"), ("mtmp=1",)], ids=["cfg", "cfg-bad", "typo"]
)
def test_printing_or_refusing_a_config_imports_no_torch(tmp_path, args):
    """`python -m harness --cfg job` and a config mistake answer in about a second: torch (1.3 s+) is never imported."""
    code = ("import runpy, sys\nsys.argv = ['harness', *sys.argv[1:]]\ntry:\n    runpy.run_module('harness', "
            "run_name='__main__')\n"
            "except SystemExit as exc:\n    print('exit', exc.code, 'torch' in sys.modules, file=sys.stderr)\n")
    proc = run_python(code, *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.endswith(" False"), proc.stdout + proc.stderr
    assert last.startswith("exit 0" if args[0] == "--cfg" else "exit 2"), proc.stderr


def test_calibration_settings_nothing_reads_are_refused_or_said(tmp_path):
    """calibration.* in a sweep with no calibrated point is refused before any point runs (exit 2, one line), as in a
    single run; cost_model=calibrated beside a peer planner, which plans with no cost model, is one warning and
    recorded as the FLOP model, not calibrated (as logger.mode=online on a dry run, which streams nothing)."""
    sweep = tmp_path / "sweep"
    proc = run_harness("-m", "mtpm=500,1000", "calibration.repeat=5", "dry_run=true", f"hydra.sweep.dir={sweep}",
                       cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "calibration.repeat=5" in line]
    assert len(lines) == 1 and "no point of this sweep has cost_model=calibrated" in lines[0], lines
    assert not sweep.exists() or sweep_results(sweep) == []

    run = tmp_path / "run"
    proc = run_harness("mtpm=4096", "planner=verl", "cost_model=calibrated", "dry_run=true", "logger.mode=online",
                       f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "[WARNING]" in line]
    assert len(warnings) == 2 and "the verl planner plans with no cost model" in warnings[1], warnings
    # and a dry run streams nothing: logger.mode=online is said, not silently dropped
    assert "logger.mode=online: a dry run starts no W&B run" in warnings[0], warnings
    assert load_json(run / "results.json")["cost_model"] == "flops"
