"""Hot sweeps: one loaded backend for the whole multirun, same results as a cold sweep."""

from __future__ import annotations

import pytest

from tests.conftest import load_json, run_harness, sweep_results

# Fixed slices of 2, then a budget: the hot backend switches from one to the other through its control file (a switch
# between two budgets is test_compile's hot sweep's, on the one-process backend). Presets, because mbs beside a
# budget is refused (it would be ignored).
POINTS = ("fixed_mbs2", "balanced_packed16384")
COMMON = ("backend=fsdp2", "workload=smoke", "workload.n_examples=8", "bench.warmup=0", "bench.repeat=1",
          "bench.save_outputs=true", "bench.baseline=false")


def test_a_hot_sweep_loads_once_switches_budgets_and_gives_the_cold_answer(tmp_path):
    """The hot sweep's second point ran on a backend that had run the first point's plan: its plan, losses and
    gradient norm are those of the same point run cold (a backend started for it alone; the hot sweep's first point
    is such a start). Pairing is checked on the hot backend, where mbs=1 passes switch its control file and back."""
    hot = tmp_path / "hot"
    proc = run_harness("-m", "batching=" + ",".join(POINTS), *COMMON, "bench.paired=true", "hot=true",
                       f"hydra.sweep.dir={hot}", cwd=tmp_path, timeout=400)
    hot_log = proc.stdout + proc.stderr
    assert proc.returncode == 0, hot_log
    cold = tmp_path / "cold"
    proc = run_harness(f"batching={POINTS[1]}", *COMMON, f"hydra.run.dir={cold}", cwd=tmp_path, timeout=400)
    cold_log = proc.stdout + proc.stderr
    assert proc.returncode == 0, cold_log
    assert hot_log.count("ranks ready") == 1 and "loaded once for the sweep" in hot_log
    assert cold_log.count("ranks ready") == 1
    hot_res, c = sweep_results(hot), load_json(cold / "results.json")
    assert [r["status"] for r in hot_res] == ["ok"] * 2 and c["status"] == "ok"
    assert [r["hot"] for r in hot_res] == [True, True] and c["hot"] is False
    assert hot_res[0]["plan"]["max_microbatch_size"] == 2 and hot_res[0]["mtpm"] is None
    h = hot_res[1]
    assert set(c) - {"hot"} <= set(h)  # the same schema
    assert (c["mtpm"], c["mbs"]) == (h["mtpm"], h["mbs"])
    # the budget really switched between points: the plan that ran is the point's own
    assert h["plan"] == c["plan"] and h["plan"]["max_tokens_per_microbatch"] == h["mtpm"] == 16384
    co, ho = load_json(cold / "example_outputs.json"), load_json(hot / "1" / "example_outputs.json")
    for pass_type in ("forward", "forward_backward"):
        assert ho[pass_type]["loss"] == pytest.approx(co[pass_type]["loss"], rel=1e-5)
    assert ho["forward_backward"]["grad_norm"] == pytest.approx(co["forward_backward"]["grad_norm"], rel=1e-5)
    assert len({(r["plan"]["padded_tokens"], tuple(r["plan"]["n_microbatches"])) for r in hot_res}) == 2
    # each point's speedup was measured beside mbs=1 passes (bench.paired): the hot backend's control file switched
    # to mbs=1 and back for them: they ran fixed mbs=1 slices, and the point kept its own plan (above)
    for r in hot_res:  # mbs=2 or a budget at every point: none is the baseline, each is paired
        ran = r["speedup"]["baseline_plan"]
        assert (ran["planner"], ran["layout"], ran["max_microbatch_size"]) == ("greedy", "padded", 1), r["speedup"]
        assert sum(ran["n_microbatches"]) == r["workload"]["n_examples"] and r["plan"]["max_microbatch_size"] > 1
        assert len(r["speedup"]["pairs"]) == 1 and r["speedup"]["median"] > 0


def test_an_auto_point_in_a_hot_sweep_releases_the_loaded_backend_and_records_its_own(tmp_path):
    """mtpm=auto starts a backend of its own: the sweep's loaded one is closed first (the search's peaks are measured
    against the limit with nothing else resident), and the point records hot: false, the backend it ran on."""
    sweep = tmp_path / "sweep"
    proc = run_harness("-m", "mtpm=700,auto", "hot=true", "backend=pytorch", "workload=smoke", "workload.n_examples=1",
                       "bench.warmup=0", "bench.repeat=1", "bench.baseline=false", f"hydra.sweep.dir={sweep}",
                       cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    budget, auto = sweep_results(sweep)
    assert budget["hot"] is True and auto["hot"] is False and auto["status"] == "ok" and auto["auto"]["chosen"]
    released = log.index("hot: the sweep's loaded pytorch is released first")
    assert log.index("loaded once for the sweep") < released < log.index("[pytorch mtpm=auto] starting pytorch")
