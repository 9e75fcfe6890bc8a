"""python -m harness as a user runs it: results.json, dry runs, multiruns and one-line errors."""

from __future__ import annotations

import math

import pytest

from backends.microbatch import plan_batch
from harness.workload import mixed_lengths
from tests.conftest import load_json, run_harness, sweep_results

FAST = ["workload=smoke", "backend=pytorch", "bench.warmup=0", "bench.repeat=2"]


def test_single_run_writes_results_json(workdir):
    run_dir = workdir / "run"
    proc = run_harness(*FAST, "mtpm=600", "bench.save_outputs=true", f"hydra.run.dir={run_dir}", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = load_json(run_dir / "results.json")
    assert res["status"] == "ok" and res["error"] is None
    assert res["backend"] == "pytorch" and res["world_size"] == 1
    assert res["device"]["type"] == "cpu" and res["device"]["count"] == 1
    assert res["model"]["name"] == "tiny" and res["model"]["lora_rank"] == 32
    assert (res["mtpm"], res["mbs"], res["gc"]) == (600, 1, False)
    assert res["bench"] == {"warmup": 0, "repeat": 2}
    lengths = mixed_lengths(16, 64, 512, 42)
    assert res["workload"]["name"] == "smoke"
    assert res["workload"]["n_examples"] == 16
    assert res["workload"]["total_tokens"] == sum(lengths)
    assert (res["workload"]["min_len"], res["workload"]["max_len"]) == (min(lengths), max(lengths))
    expected = plan_batch(lengths, 1, 600, 1).stats
    assert res["plan"]["n_microbatches"] == expected.n_microbatches
    assert res["plan"]["padded_tokens"] == expected.padded_tokens
    assert math.isclose(res["plan"]["pad_efficiency"], expected.pad_efficiency)
    for pass_type in ("forward", "forward_backward"):
        p = res["passes"][pass_type]
        assert len(p["elapsed_s"]) == 2 and all(t > 0 for t in p["elapsed_s"])
        assert math.isclose(p["tok_per_s"], sum(lengths) / (sum(p["elapsed_s"]) / 2), rel_tol=1e-9)
        assert 0 < p["util_pct"] <= 100
        assert 0 < p["mem_pct"] < 100
        assert len(p["mem_peak_bytes"]) == 1 and 100 * 1024**2 < p["mem_peak_bytes"][0] < res["device"]["memory_bytes"]
    outputs = load_json(run_dir / "example_outputs.json")
    assert len(outputs["forward"]["loss"]) == 16
    assert outputs["forward_backward"]["grad_norm"] > 0
    assert "micro-batch" in proc.stdout or "repeat 2/2" in proc.stdout  # progress is visible


def test_dry_run_of_the_seed_workload_plans_every_point(workdir):
    sweep = workdir / "sweep"
    budgets = [16384, 32768, 65536, 131072]
    proc = run_harness(
        "-m",
        "mtpm=" + ",".join(map(str, budgets)),
        "workload=seed_mixed_128",
        "backend=pytorch",
        "dry_run=true",
        f"hydra.sweep.dir={sweep}",
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sweep_results(sweep)
    lengths = mixed_lengths(128, 64, 32768, 42)
    assert [r["mtpm"] for r in results] == budgets
    for r, budget in zip(results, budgets):
        assert r["status"] == "planned"
        assert r["workload"]["total_tokens"] == 1_669_550
        assert r["plan"] == plan_batch(lengths, 1, budget, 1).stats.as_dict()
        assert r["passes"] == {}
    effs = [r["plan"]["pad_efficiency"] for r in results]
    assert effs == sorted(effs, reverse=True)  # bigger budgets pad more on this workload
    assert "1,669,550" in proc.stdout


@pytest.mark.slow
def test_multirun_outputs_agree_across_mbs_and_mtpm(workdir):
    """The issue's check: mtpm in {null, 600, 100000} x mbs in {1, 3}, all six outputs agree to 1e-5."""
    sweep = workdir / "sweep"
    proc = run_harness(
        "-m",
        "workload=smoke",
        "backend=pytorch",
        "bench.save_outputs=true",
        "bench.warmup=0",
        "bench.repeat=1",
        "mtpm=null,600,100000",
        "mbs=1,3",
        f"hydra.sweep.dir={sweep}",
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dirs = sorted(p for p in sweep.iterdir() if (p / "example_outputs.json").exists())
    assert len(dirs) == 6
    outs = [load_json(d / "example_outputs.json") for d in dirs]
    ref = outs[0]
    for out in outs[1:]:
        for pass_type in ("forward", "forward_backward"):
            for a, b in zip(out[pass_type]["loss"], ref[pass_type]["loss"]):
                assert math.isclose(a, b, rel_tol=1e-5)
        assert math.isclose(out["forward_backward"]["grad_norm"], ref["forward_backward"]["grad_norm"], rel_tol=1e-5)
    plans = {tuple(load_json(d / "results.json")["plan"]["n_microbatches"]) for d in dirs}
    assert len(plans) >= 4  # the six points really batch differently


def _one_error_line(proc) -> str:
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize(
    "override, key, valid",
    [
        ("mtpm=-1", "mtpm", "positive integer or null"),
        ("mtpm=0", "mtpm", "positive integer or null"),
        ("mtpm=1.5", "mtpm", "Integer"),
        ("mtpm=abc", "mtpm", "Integer"),
        ("mbs=0", "mbs", "positive integer"),
        ("backend=nccl_magic", "backend", "pytorch"),
        ("model=gpt5", "model", "tiny"),
        ("workload=huge", "workload", "smoke"),
        ("workload.n_examples=0", "workload.n_examples", "positive integer"),
        ("mtmp=1000", "mtmp", "not a config key"),
        ("backend.logprob_chunk_tokens=0", "backend.logprob_chunk_tokens", "positive integer or null"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(workdir, override, key, valid):
    proc = run_harness("dry_run=true", override, f"hydra.run.dir={workdir / 'run'}", cwd=workdir)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert key in line and valid in line, line


def test_zero_length_in_a_lengths_file_is_one_line(workdir):
    f = workdir / "lengths.txt"
    f.write_text("100\n0\n50\n")
    proc = run_harness("dry_run=true", "workload=lengths_file", f"workload.path={f}", f"hydra.run.dir={workdir / 'run'}", cwd=workdir)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "workload.path" in line and "lengths.txt:2" in line
    res = load_json(workdir / "run" / "results.json")
    assert res["status"] == "error" and "length 0" in res["error"]


def test_missing_checkpoint_is_one_line_naming_the_path(workdir):
    proc = run_harness("model=qwen3_5_35b_a3b", "model.path=/no/such/ckpt", *FAST, f"hydra.run.dir={workdir / 'run'}", cwd=workdir)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "model.path" in line and "/no/such/ckpt" in line


def test_a_bad_point_does_not_stop_the_sweep(workdir):
    sweep = workdir / "sweep"
    proc = run_harness("-m", "mtpm=-5,4096", "dry_run=true", "workload=smoke", f"hydra.sweep.dir={sweep}", cwd=workdir)
    assert proc.returncode == 2
    assert [r["status"] for r in sweep_results(sweep)] == ["error", "planned"]
