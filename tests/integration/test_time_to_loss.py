"""examples/time_to_loss.py, its test-sized form (``--tiny``: a 2-layer model, 3,000 tokens per arm, one seed) run as
the command a user runs: four real Trainer runs on the standard library's source, then the JSON and the figure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

ARMS = ["padded", "group_by_length", "token_budget", "token_budget_ramp"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("time_to_loss")
    proc = subprocess.run([sys.executable, "-m", "examples.time_to_loss", "--out", str(out), "--tiny"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "time_to_loss.json").read_text()), proc.stdout


def test_every_arm_trains_the_same_tokens_and_reports_its_curve(tiny_run):
    out, result, stdout = tiny_run
    total = result["train_tokens"]
    assert total >= 3000 and result["same_train_tokens"] is True
    assert [r["arm"] for r in result["runs"]] == ARMS and list(result["arms"]) == ARMS
    for run in result["runs"]:
        arm = run["arm"]
        # one pass over the same files: exactly the same loss tokens, whatever the steps
        assert run["train_tokens"] == total, (arm, run["train_tokens"], total)
        assert result["arms"][arm]["train_tokens"] == total
        curve = run["curve"]
        assert curve[0][:3] == [0, 0.0, None] and curve[-1][0] == total and len(curve) == run["steps"] + 1
        tokens, walls = [c[0] for c in curve], [c[1] for c in curve]
        assert all(a < b for a, b in zip(tokens, tokens[1:])), (arm, tokens)  # every step trains tokens
        assert all(a <= b for a, b in zip(walls, walls[1:])), (arm, walls)
        # the per-step tokens the curve shows are the steps' counts
        steps = [b - a for a, b in zip(tokens, tokens[1:])]
        spread = run["tokens_per_step"]
        assert (min(steps), max(steps)) == (spread["min"], spread["max"])
        assert spread["mean"] == pytest.approx(total / run["steps"], abs=0.1)
        assert run["wall_s"] > 0 and run["wall_s"] >= walls[-1] - 1e-3
        vals = [c[3] for c in curve if c[3] is not None]
        assert len(vals) >= 3 and run["val_loss"] == curve[-1][3]  # the start, a checkpoint and the end
        assert all(0 < v < 10 for v in vals) and vals[-1] < vals[0], (arm, vals)  # it learned something
    # the same seed is the same initial model: the same held-out loss before training
    assert len({r["curve"][0][3] for r in result["runs"]}) == 1
    # token_budget takes as many steps as padded (fewer only where no step size gives as many), so about the same mean
    # tokens per step; the ramp's small first steps make more
    steps = {r["arm"]: r["steps"] for r in result["runs"]}
    assert steps["padded"] == steps["group_by_length"]
    assert 0.9 * steps["padded"] <= steps["token_budget"] <= steps["padded"] and steps["token_budget"] < steps[
        "token_budget_ramp"]
    speedups = result["speedup_to_baseline_loss"]
    assert list(speedups) == ARMS and speedups["padded"]["per_seed"] == [1.0]
    for s in speedups.values():
        assert s["mean"] is None and s["not_reached_seeds"] and s["reason"] or s["min"] <= s["mean"] <= s["max"]
    equal = result["speedup_at_equal_tokens"]
    for arm, run in zip(ARMS, result["runs"]):
        assert equal[arm]["per_seed"] == [round(result["runs"][0]["wall_s"] / run["wall_s"], 3)]
    assert {"cpu", "threads", "torch", "transformers", "python"} <= set(result["machine"])
    png = (out / "time_to_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_markdown_prints_the_measurement_tables(tiny_run):
    out, result, _ = tiny_run
    proc = subprocess.run([sys.executable, "-m", "examples.time_to_loss", "--markdown", str(out / "time_to_loss.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [f"| {arm}" for arm in ARMS]
    assert all(f"{result['train_tokens']:,}" in row for row in rows[1:])


def test_bad_input_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "examples.time_to_loss", "--out", "x", "--threads", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--threads must be a positive integer" in proc.stderr
