"""The answer on real backends: a sweep measures its own mbs=1 baseline and shares identical plans, and
mtpm=auto searches real budgets on one loaded backend, in float32 and in bf16."""

from __future__ import annotations

import pytest

from harness.auto.model import MemoryModel
from tests.conftest import harness_env, load_json, run_harness, sweep_results
from tests.wandb_records import run_contents

QUICK = ("workload=smoke", "logger=none", "bench.warmup=0", "bench.repeat=1")


def test_a_sweep_measures_its_baseline_shares_identical_plans_and_answers_first(tmp_path):
    sweep = tmp_path / "sweep"
    # On one rank the 16 smoke sequences (4,540 tokens) fit one micro-batch at 16,384 and at 32,768: one plan.
    proc = run_harness("-m", "backend=pytorch", "mtpm=16384,32768", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    base, first, second = sweep_results(sweep)
    assert (base["mtpm"], base["mbs"], base["planner"], base["layout"]) == (None, 1, "greedy", "padded")
    assert base["status"] == first["status"] == second["status"] == "ok"
    # what ran: the tests' OMP_NUM_THREADS=1 (backends.runtime.devices.threads_per_rank), a shared point's its source's
    assert base["threads_per_rank"] == first["threads_per_rank"] == second["threads_per_rank"] == 1
    assert (first["planner"], first["layout"]) == ("balanced", "packed")  # the default with a budget
    assert "shares" not in first and second["shares"]["mtpm"] == 16384 and second["mtpm"] == 32768
    assert second["passes"] == first["passes"] and second["measurement_key"] == first["measurement_key"]
    assert (sweep / "2" / "plan.json").is_file()  # its own plan, which is the measured one's
    report = (sweep / "report.md").read_text()
    # the answer first: whichever ran fastest (on 16 short sequences mbs=1 may), against the baseline
    assert report.startswith("- PyTorch: set ") and " tok/s fwd+bwd, " in report.splitlines()[0], report[:300]
    assert "1.00× (baseline)" in report and "shares mtpm=16,384's measurement" in report
    assert "no mbs=1" not in report

    # Measured again when asked, and the baseline not added when turned off.
    again = tmp_path / "again"
    proc = run_harness("-m", "backend=pytorch", "mtpm=16384,32768", *QUICK, "bench.share_plans=false",
                       "bench.baseline=false", f"hydra.sweep.dir={again}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, second = sweep_results(again)
    assert "shares" not in second and second["passes"] != first["passes"]


def _auto_checks(doc: dict) -> dict:
    """What any mtpm=auto result must hold: a chosen budget that ran ok, under the limit, the fastest measured."""
    auto = doc["auto"]
    assert doc["status"] == "ok", doc.get("error")
    chosen = {c["mtpm"]: c for c in auto["candidates"]}[auto["chosen"]]
    assert doc["mtpm"] == auto["chosen"] and chosen["status"] == "ok"
    assert chosen["measured_peak_bytes"] <= auto["limit_bytes"]
    measured = [c for c in auto["candidates"] if c["status"] == "ok"]
    if doc["bench"]["paired"]:
        # ranked by each candidate's pair ratio over an mbs=1 pass run beside it (bench.paired), not by raw tok/s
        assert all(c["speedup"] > 0 for c in measured)
        # the fastest, or, where the two leaders' intervals still overlap after more pairs, the tie rule's pick
        tie = auto.get("tie")
        assert chosen["speedup"] == max(c["speedup"] for c in measured) or tie and chosen["mtpm"] not in tie["with"]
        # the leaders may be measured past bench.repeat while they cannot be told apart (harness/auto/lead.py)
        assert doc["speedup"]["median"] > 0 and len(doc["speedup"]["pairs"]) >= doc["bench"]["repeat"]
    else:  # no pairs measured: ranked by tok/s
        assert all(c["speedup"] is None for c in auto["candidates"]) and doc.get("speedup") is None
        assert chosen["tok_per_s"] == max(c["tok_per_s"] for c in measured)
    assert set(doc["passes"]) == {"forward", "forward_backward"}
    assert len(doc["passes"]["forward_backward"]["elapsed_s"]) >= doc["bench"]["repeat"]
    assert auto["baseline"]["status"] == "ok" and auto["baseline"]["tok_per_s"] > 0
    for c in auto["candidates"]:
        assert c["status"] in ("ok", "oom", "over_limit"), c
        if c["status"] == "over_limit" and c["measured_peak_bytes"] is None:  # not run: predicted over, or above
            assert (c["decision"] == "predicted_over" and c["predicted_peak_bytes"] > auto["limit_bytes"]
                    or c["decision"] == "above_failure"), c
        if c["measured_peak_bytes"] is not None:  # the last refit, the recorded model, within 15% of what was measured
            assert c["refit_peak_bytes"] == pytest.approx(c["measured_peak_bytes"], rel=0.15), c
    return chosen


def test_auto_searches_under_a_memory_limit_and_records_the_answer(tmp_path):
    """pytorch, 8 of cpu_mixed's examples under a 1 GiB cap: the larger plans are predicted (or found) over it, the
    chosen one fits (the whole 16 examples under 1.5 GiB proved the same at twice the time). Unpaired (the fsdp2
    test below ranks by pairs): no mbs=1 pass beside each candidate, which is ranked by its tok/s."""
    run = tmp_path / "run"
    proc = run_harness("mtpm=auto", "backend=pytorch", "workload=cpu_mixed", "workload.n_examples=8",
                       "bench.memory_limit_gb=1", "bench.warmup=0", "bench.repeat=2",
                       f"hydra.run.dir={run}", cwd=tmp_path, env=harness_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = load_json(run / "results.json")
    chosen = _auto_checks(doc)
    auto = doc["auto"]
    assert auto["limit_source"] == "bench.memory_limit_gb" and auto["limit_bytes"] == int(1 * 1024**3)
    assert any(c["status"] != "ok" for c in auto["candidates"]), auto["candidates"]  # the cap bit
    assert auto["memory_model"]["points"] >= 3
    # A prediction made before it ran (none for a probe run before two sizes): the recorded model's, within 15%
    if chosen["predicted_peak_bytes"] is not None:
        model = MemoryModel.from_dict(chosen["predicted_by"])
        assert model.predict(chosen["tokens"], chosen["square"]) == chosen["predicted_peak_bytes"]
        assert chosen["predicted_peak_bytes"] == pytest.approx(chosen["measured_peak_bytes"], rel=0.15)
    assert f"set mtpm={doc['mtpm']} (balanced, packed)" in proc.stderr + proc.stdout
    # W&B: the answer in the run's summary, the run named for what ran and how it was found
    (record,) = run.glob("wandb/offline-run-*/run-*.wandb")
    wandb_run = run_contents(record)
    assert wandb_run["name"] == f"pytorch-mtpm{doc['mtpm']}-balanced-packed-auto"
    summary = wandb_run["summary"]
    assert summary["auto/chosen"] == doc["mtpm"] and summary["auto/limit_bytes"] == auto["limit_bytes"]
    assert summary[f"auto/candidates/{doc['mtpm']}/status"] == "ok"
    assert summary["passes/forward_backward/tok_per_s"] == pytest.approx(doc["passes"]["forward_backward"]["tok_per_s"])


def test_auto_on_fsdp2_in_bf16(tmp_path):
    """The published precision on the lock-step backend (the search is the backend's passes: harness/auto/model.py
    asks any backend alike, so one distributed backend covers the ranks' memory share), no baseline point added."""
    sweep = tmp_path / "sweep"
    proc = run_harness("-m", "mtpm=auto", "bench.paired=true", "backend=fsdp2", "model.dtype=bfloat16", *QUICK,
                       "workload.n_examples=8",
                       f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (doc,) = sweep_results(sweep)  # the search measures mbs=1 itself
    assert doc["backend"] == "fsdp2"
    _auto_checks(doc)
    assert sum(c["status"] == "ok" for c in doc["auto"]["candidates"]) >= 2  # 8 sequences: 3 plans, a real search
    assert doc["precision"]["compute"] == "bfloat16"
    assert "host memory / 2 rank(s)" in doc["auto"]["limit_source"]
    report = (sweep / "report.md").read_text()
    assert report.startswith("- FSDP2: set mtpm=") and "× mbs=1" in report
