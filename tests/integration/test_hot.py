"""Hot sweeps: one loaded backend for the whole multirun, same results as a cold sweep."""

from __future__ import annotations

import pytest

from tests.conftest import load_json, run_harness, sweep_results

# Fixed slices of 2, then a budget: the hot backend switches from one to the other through its control file (a switch
# between two budgets is test_compile's hot sweep's, on the one-process backend). Presets, because mbs beside a
# budget is refused (it would be ignored).
POINTS = ["batching=fixed_mbs2,balanced_packed16384"]


def _sweep(tmp_path, name: str, *extra: str):
    sweep = tmp_path / name
    proc = run_harness(
        "-m",
        *POINTS,
        "backend=fsdp2",
        "workload=smoke",
        "workload.n_examples=8",
        "bench.warmup=0",
        "bench.repeat=1",
        "bench.save_outputs=true",
        "bench.baseline=false",
        "bench.paired=true",
        f"hydra.sweep.dir={sweep}",
        *extra,
        cwd=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep, proc.stdout + proc.stderr


def test_hot_and_cold_sweeps_agree_and_hot_loads_once(tmp_path):
    cold, cold_log = _sweep(tmp_path, "cold")
    hot, hot_log = _sweep(tmp_path, "hot", "hot=true")
    assert cold_log.count("ranks ready") == 2
    assert hot_log.count("ranks ready") == 1 and "loaded once for the sweep" in hot_log
    cold_res, hot_res = sweep_results(cold), sweep_results(hot)
    assert [r["status"] for r in hot_res] == ["ok"] * 2
    for c, h in zip(cold_res, hot_res):
        assert set(c) - {"hot"} <= set(h)  # the same schema
        assert (c["mtpm"], c["mbs"]) == (h["mtpm"], h["mbs"])
        assert h["hot"] is True and c["hot"] is False
        # the budget really switched between points: the plan that ran is the point's own
        assert h["plan"] == c["plan"]
        assert h["plan"]["max_tokens_per_microbatch"] == h["mtpm"]
        co = load_json(cold / str(cold_res.index(c)) / "example_outputs.json")
        ho = load_json(hot / str(hot_res.index(h)) / "example_outputs.json")
        for pass_type in ("forward", "forward_backward"):
            assert ho[pass_type]["loss"] == pytest.approx(co[pass_type]["loss"], rel=1e-5)
        assert ho["forward_backward"]["grad_norm"] == pytest.approx(co["forward_backward"]["grad_norm"], rel=1e-5)
    assert len({(r["plan"]["padded_tokens"], tuple(r["plan"]["n_microbatches"])) for r in hot_res}) == 2
    # each budget's speedup was measured beside mbs=1 passes (bench.paired): on the hot backend the control file
    # switched to mbs=1 and back for them: they ran fixed mbs=1 slices, and the point kept its own plan (above)
    for res in (cold_res, hot_res):
        for r in res:  # mbs=2 or a budget at every point: none is the baseline, each is paired
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
