"""examples/time_to_loss.py, its test-sized form (``--tiny``: a 2-layer model, 4,000 tokens per arm, one seed) run as
the command a user runs: two gloo ranks, seven real Trainer runs on the standard library's source, then the JSON and
the figure. The table and the bad-input line are the same ``main`` called in this process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from examples import time_to_loss
from tests.conftest import REPO

ARMS = ["padded", "group_by_length", "flattening", "trl_packing", "token_budget", "token_budget_ramp",
        "token_budget_stock_sdpa"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("time_to_loss")
    proc = subprocess.run([sys.executable, "-m", "examples.time_to_loss", "--out", str(out), "--tiny"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "time_to_loss.json").read_text()), proc.stdout


def test_every_arm_trains_the_same_tokens_on_two_ranks_and_reports_its_curve(tiny_run):
    out, result, stdout = tiny_run
    total = result["train_tokens"]
    assert total >= 2000 and result["same_train_tokens"] is True and result["world_size"] == 2
    assert [r["arm"] for r in result["runs"]] == ARMS and list(result["arms"]) == ARMS
    for run in result["runs"]:
        arm = run["arm"]
        # one pass over the same pieces: the same loss tokens, whatever the steps (the pieces are chosen so that no
        # arm's loader repeats items to fill a last step)
        assert run["train_tokens"] == total, (arm, run["train_tokens"], total)
        # two ranks, each with its own times; their local tokens add up to the step counts
        assert run["world_size"] == 2 and [r["rank"] for r in run["ranks"]] == [0, 1]
        assert sum(r["local_tokens"] for r in run["ranks"]) == total, arm
        for r in run["ranks"]:
            assert 0 <= r["wait_s"] <= r["step_s"] <= r["wall_s"] + 1e-3, (arm, r)
            assert r["idle_fraction"] == pytest.approx(r["wait_s"] / r["wall_s"], abs=1e-4)
        assert 0 <= run["idle_fraction"] < 1 and run["tokens_per_s"] == pytest.approx(total / run["wall_s"], rel=1e-3)
        # the kernel that ran: the library's per-sequence attention on the padding-free arms, stock sdpa elsewhere
        expected = "sdpa-per-sequence" if arm in time_to_loss.PER_SEQUENCE_ARMS else "sdpa"
        assert run["attention"] == expected, (arm, run["attention"])
        curve = run["curve"]
        assert curve[0][:3] == [0, 0.0, None] and curve[-1][0] == total and len(curve) == run["steps"] + 1
        tokens, walls = [c[0] for c in curve], [c[1] for c in curve]
        assert all(a < b for a, b in zip(tokens, tokens[1:])), (arm, tokens)  # every step trains tokens
        assert all(a <= b for a, b in zip(walls, walls[1:])), (arm, walls)
        steps = [b - a for a, b in zip(tokens, tokens[1:])]
        assert (min(steps), max(steps)) == (run["tokens_per_step"]["min"], run["tokens_per_step"]["max"])
        vals = [c[3] for c in curve if c[3] is not None]
        assert len(vals) >= 2 and run["val_loss"] == curve[-1][3]
        assert all(0 < v < 10 for v in vals) and vals[-1] < vals[0], (arm, vals)  # it learned something
        assert run["curve_state"]["state"] in ("still falling", "flattened")
    # the same seed is the same initial model: the same held-out loss before training
    assert len({r["curve"][0][3] for r in result["runs"]}) == 1
    # the steps: b sequences or r of TRL's rows per rank, and the token budget's as many steps as b's
    sizes, steps = result["step_sizes"], {r["arm"]: r["steps"] for r in result["runs"]}
    assert steps["padded"] == steps["group_by_length"] == steps["flattening"] == sizes["steps"]
    assert steps["trl_packing"] == sizes["trl_steps"]
    assert 0.9 * sizes["steps"] <= steps["token_budget"] <= sizes["steps"] < steps["token_budget_ramp"]
    speedups = result["speedup_to_baseline_loss"]
    assert list(speedups) == ARMS and speedups["padded"]["per_seed"] == [1.0]
    for s in speedups.values():
        assert s["mean"] is None and s["not_reached_seeds"] and s["reason"] or s["min"] <= s["mean"] <= s["max"]
    base = result["runs"][0]
    for arm, run in zip(ARMS, result["runs"]):
        assert result["speedup_at_equal_tokens"][arm]["per_seed"] == [round(base["wall_s"] / run["wall_s"], 4)]
        assert result["loss_difference_at_equal_tokens"][arm]["per_seed"] == [
            round(run["val_loss"] - base["val_loss"], 4)]
    assert {"cpu", "threads", "torch", "transformers", "trl", "python"} <= set(result["machine"])
    png = (out / "time_to_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_markdown_prints_the_measurement_tables(tiny_run, capsys):
    out, result, _ = tiny_run
    assert time_to_loss.main(["--markdown", str(out / "time_to_loss.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [f"| {arm}" for arm in ARMS]
    assert all(f"{100 * result['arms'][arm]['idle_fraction']:.1f}%" in row for arm, row in zip(ARMS, rows[1:]))


def test_bad_input_is_one_line(capsys):
    assert time_to_loss.main(["--out", "x", "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--threads must be a positive integer" in err, err
