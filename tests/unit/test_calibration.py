"""cost_model=calibrated without a backend: the spread of shapes, the fit, the cost model it becomes, the cache and its
key, the refusals, and what the balanced planner does with a per-sequence cost (harness/metrics/calibration.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from backends.errors import UserError
from backends.specs import ModelSpec
from balance_batch import CostModel, plan_step
from balance_batch.cost import microbatch_cost
from balance_batch.stats import plan_stats
from harness.app.config import CalibrationConfig
from harness.metrics.calibration import (
    COEFFICIENTS,
    Shape,
    cache_key,
    calibrated_cost_model,
    calibration_command,
    cost_model_of,
    fit_times,
    identity,
    read_cached,
    spread,
    spread_longest,
    write_cached,
)

CPU = {"type": "cpu", "name": "test cpu", "count": 2, "cores": 2, "memory_bytes": 1}


def test_the_spread_covers_64_tokens_to_the_longest_and_tells_the_four_coefficients_apart():
    assert spread_longest(3531) == 4096 and spread_longest(100) == 512 and spread_longest(4096) == 4096
    for layout in ("packed", "padded"):
        shapes = spread(4096, layout)
        assert shapes == spread(4096, layout)  # deterministic: the same key calibrates the same shapes
        lengths = {n for s in shapes for n in s.lengths}
        assert 48 <= min(lengths) <= 64 and max(lengths) == 4096
        assert sum(n % 64 != 0 for n in lengths) > len(lengths) / 2  # mostly not a multiple of the delta rule's chunk
        assert max(sum(s.lengths) for s in shapes) == 4096  # no micro-batch above the longest sequence's tokens
        X = np.array([s.features(layout) for s in shapes], dtype=float)
        assert np.linalg.matrix_rank(X / X.max(axis=0)) == len(COEFFICIENTS)
    packed = spread(4096, "packed")
    assert any(len(set(s.lengths)) > 1 for s in packed)  # a long sequence with many short ones in one row
    assert Shape((100, 50)).features("padded") == (1, 2, 200, 2 * 100 * 100)  # padded: on the padded shape
    assert Shape((100, 50)).features("packed") == (1, 2, 150, 100 * 100 + 50 * 50)


def test_the_fit_recovers_known_coefficients_and_never_goes_negative():
    shapes = spread(2048, "packed")
    rows = [s.features("packed") for s in shapes]
    truth = np.array([0.03, 2e-4, 1e-4, 2e-8])
    fit = fit_times(rows, [float(np.dot(r, truth)) for r in rows])
    got = [fit["coefficients"][k] for k in COEFFICIENTS]
    assert got == pytest.approx(list(truth), rel=1e-6) and fit["r2"] == pytest.approx(1.0)
    assert fit["worst_rel_err"] == pytest.approx(0.0, abs=1e-9)
    # times that fall with the sequences (no physical cost does): the fit keeps that coefficient at 0, not below
    bent = [float(np.dot(r, [0.03, -5e-4, 1e-4, 0.0])) + 0.05 for r in rows]
    fit = fit_times(rows, bent)
    assert all(v >= 0 for v in fit["coefficients"].values()) and fit["coefficients"]["c_seq"] == 0.0
    with pytest.raises(ValueError, match="at least 4 micro-batches"):
        fit_times(rows[:3], [1.0, 2.0, 3.0])


def test_the_fit_weighs_relative_error_so_short_micro_batches_are_predicted_too():
    rows = [Shape((n,)).features("packed") for n in (64, 128, 256, 512, 1024, 2048)] * 2
    rng = np.random.default_rng(0)
    times = [(0.01 + 1e-4 * r[2]) * (1 + 0.02 * rng.standard_normal()) for r in rows]
    fit = fit_times(rows, times)
    predicted = [fit["coefficients"]["c0"] + fit["coefficients"]["c_seq"] + fit["coefficients"]["c_tok"] * r[2]
                 + fit["coefficients"]["c_sq"] * r[3] for r in rows]
    rel = [abs(p - t) / t for p, t in zip(predicted, times)]
    assert max(rel) < 0.08  # the 64-token micro-batches within noise, not swamped by the 2,048-token ones


def test_a_fit_becomes_a_cost_model_in_seconds_that_prices_packed_and_padded_micro_batches_as_measured():
    k = {"c0": 0.03, "c_seq": 2e-4, "c_tok": 1e-4, "c_sq": 2e-8}
    cm = cost_model_of({"coefficients": k, "r2": 1.0}, "calibrated: test")
    lengths = [300, 100, 50]
    for layout in ("packed", "padded"):
        shape = Shape(tuple(lengths))
        expected = sum(c * x for c, x in zip(k.values(), shape.features(layout)))
        assert microbatch_cost([0, 1, 2], lengths, layout, cm) == pytest.approx(expected)
    assert cm.as_dict()["coefficients"] == k and cm.as_dict()["fixed"] == 0.03 and cm.as_dict()["r2"] == 1.0


def _ident(**change) -> dict:
    args = dict(backend="megatron_ddp", world_size=2, device=CPU, model=ModelSpec(), layout="packed", gc=False,
                compile=False, logprob_chunk_tokens=1024, longest=4096)
    args.update(change)
    return identity(**args)


def test_the_cache_key_changes_with_everything_a_fit_depends_on():
    base = cache_key(_ident())
    assert cache_key(_ident()) == base
    changes = [dict(backend="fsdp2"), dict(world_size=4), dict(device={**CPU, "name": "other cpu"}),
               dict(model=ModelSpec(dtype="bfloat16")), dict(model=ModelSpec(lora_rank=8)),
               dict(model=ModelSpec(vocab_size=4096)), dict(layout="padded"), dict(gc=True), dict(compile=True),
               dict(logprob_chunk_tokens=None), dict(longest=8192)]
    keys = {cache_key(_ident(**c)) for c in changes}
    assert base not in keys and len(keys) == len(changes)
    assert _ident()["model"]["dtype"] == "float32"  # auto on a CPU, as the backend resolves it
    assert "torch" in _ident()["versions"]


def test_a_cached_fit_is_read_back_only_for_the_setting_it_was_made_for(tmp_path, caplog):
    ident = _ident()
    key = cache_key(ident)
    fit = {"coefficients": dict.fromkeys(COEFFICIENTS, 1e-4), "r2": 0.99, "worst_rel_err": 0.05}
    assert read_cached(tmp_path, key, ident) is None
    assert write_cached(tmp_path, key, ident, fit) == tmp_path / f"{key}.json"
    assert read_cached(tmp_path, key, ident) == fit
    with caplog.at_level(logging.WARNING):
        assert read_cached(tmp_path, key, _ident(layout="padded")) is None  # a file under a key it does not match
        (tmp_path / f"{key}.json").write_text("{torn")
        assert read_cached(tmp_path, key, ident) is None
    assert "calibrating again" in caplog.text
    # the right identity, but a fit the planner cannot use: refused like the others, not a KeyError
    import json

    for broken in ({"r2": 0.99, "worst_rel_err": 0.05}, {**fit, "coefficients": {"c0": 1e-4}},
                   {**fit, "coefficients": {**fit["coefficients"], "c_sq": "fast"}}, {**fit, "worst_rel_err": None}):
        (tmp_path / f"{key}.json").write_text(json.dumps({"identity": ident, "fit": broken}))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert read_cached(tmp_path, key, ident) is None
        assert "holds no usable fit" in caplog.text and "calibrating again" in caplog.text
    with pytest.raises(UserError, match="none is cached"):  # a dry run has no backend: the one line, not a KeyError
        calibrated_cost_model(CalibrationConfig(cache_dir=str(tmp_path)), ident)
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        assert write_cached(blocked / "sub", key, ident, fit) is None  # a cache that cannot be written: a warning
    assert "calibration.cache_dir" in caplog.text


def test_without_a_backend_a_calibrated_cost_model_comes_from_the_cache_or_says_why_not_in_one_line(tmp_path):
    ident = _ident(longest=1024)
    cfg = CalibrationConfig(cache_dir=str(tmp_path))
    with pytest.raises(UserError) as err:
        calibrated_cost_model(cfg, ident)
    line = str(err.value)
    assert "\n" not in line and line.startswith("cost_model: calibrated") and "without dry_run=true" in line
    fit = {"coefficients": {"c0": 0.01, "c_seq": 1e-4, "c_tok": 2e-5, "c_sq": 1e-9}, "r2": 0.98, "worst_rel_err": 0.1}
    write_cached(tmp_path, cache_key(ident), ident, fit)
    cm = calibrated_cost_model(cfg, ident)
    assert (cm.fixed, cm.c, cm.a, cm.b) == (0.01, 1e-4, 2e-5, 1e-9) and cm.fit["r2"] == 0.98
    assert "calibrated" in cm.source and "megatron_ddp" in cm.source


def test_a_calibration_pass_runs_every_shape_on_every_rank_at_the_same_step():
    shapes = [Shape((64, 64)), Shape((128,)), Shape((32, 16, 8))]
    cmd = calibration_command(shapes, 3, "packed", 100)
    assert cmd.pass_type == "forward_backward" and len(cmd.schedules) == 3
    for schedule in cmd.schedules:
        assert [tuple(len(cmd.examples[i]) for i in batch) for batch in schedule] == [s.lengths for s in shapes]
    assert len({i for s in cmd.schedules for b in s for i in b}) == len(cmd.examples)  # each example once
    assert all(int(e.input_ids.max()) < 100 for e in cmd.examples)
    plan = cmd.plan(3, lockstep=True)  # the given plan is what every rank runs: no planner
    assert plan.schedules == cmd.schedules and plan.stats.planner == "given"
    with pytest.raises(ValueError, match="2 ranks"):
        cmd.plan(2, lockstep=False)


def test_a_per_sequence_cost_evens_out_the_sequence_counts_the_flop_model_leaves_uneven():
    # one long sequence and many short ones of as many tokens: FLOPs (here tokens) call one of each rank's share
    lengths = [2000] + [20] * 100
    flops = CostModel(1.0, 0.0, "tokens")
    per_seq = CostModel(1.0, 0.0, "calibrated: test", c=200.0)  # each sequence costs as much as 200 tokens more
    plans = {name: plan_step(lengths, world_size=2, max_tokens_per_microbatch=4096, layout="packed", planner="balanced",
                             lockstep=False, cost_model=cm)
             for name, cm in (("flops", flops), ("calibrated", per_seq))}
    # judged by the per-sequence model (what the hardware costs here), the calibrated plan is the even one
    judged = {name: plan_stats(p.schedules, lengths, "packed", per_seq).cost_imbalance for name, p in plans.items()}
    assert judged["flops"] > 1.5 and judged["calibrated"] < 1.01
    counts = {name: sorted(sum(len(b) for b in s) for s in p.schedules) for name, p in plans.items()}
    assert counts["flops"] == [1, 100] and counts["calibrated"] == [46, 55]


def test_calibration_settings_are_checked_in_one_line(tmp_path):
    from backends.specs import BackendSpec
    from harness.app.config import HarnessConfig, validate
    from harness.data.workload import WorkloadSpec

    def spec(**kw):
        s = HarnessConfig(backend=BackendSpec(), model=ModelSpec(), workload=WorkloadSpec(name="smoke", kind="mixed"))
        for k, v in kw.items():
            obj = s
            *outer, last = k.split(".")
            for o in outer:
                obj = getattr(obj, o)
            setattr(obj, last, v)
        return s

    for key, value, word in (("cost_model", "seconds", ("cost_model: 'seconds' is not a cost model "
                                                            "(valid: flops, calibrated)")),
                             ("calibration.repeat", 0, "calibration.repeat: must be a positive integer"),
                             ("calibration.max_len", -5, "calibration.max_len: must be a positive integer or null"),
                             ("calibration.warmup", -1, "calibration.warmup: must be >= 0")):
        with pytest.raises(UserError, match=word.replace("(", r"\(").replace(")", r"\)")):
            validate(spec(**{key: value}))
    validate(spec(cost_model="calibrated"))


@pytest.mark.parametrize("planner, recorded", [("greedy", "flops"), ("balanced", "calibrated")])
def test_the_greedy_planner_uses_no_cost_model_so_nothing_is_calibrated_or_recorded_as_calibrated(tmp_path, planner,
                                                                                                    recorded):
    """A dry run with a fit cached for its setting: the balanced planner plans with it; the greedy planner, which
    balances nothing, neither reads nor measures one, and results.json says the FLOP model (what its stats used)."""
    import json

    from harness.app.config import resolve_config
    from harness.data.workload import load_workload
    from harness.point.point import Point
    from harness.point.setup import HydraRun, Setup
    from tests.conftest import compose_config

    overrides = ["dry_run=true", "workload=smoke", "mtpm=4096", f"planner={planner}", "layout=padded",
                 "cost_model=calibrated", f"calibration.cache_dir={tmp_path / 'cache'}", "logger=none"]
    cfg = compose_config(*overrides)
    spec = resolve_config(cfg)
    setup = Setup.dry_run(spec)
    ident = identity(setup.name, setup.world_size, setup.device, spec.model, setup.layout, False, False,
                     spec.backend.logprob_chunk_tokens, spread_longest(max(load_workload(spec.workload).lengths)))
    fit = {"coefficients": {"c0": 0.01, "c_seq": 1e-4, "c_tok": 2e-5, "c_sq": 1e-9}, "r2": 0.98, "worst_rel_err": 0.1}
    write_cached(tmp_path / "cache", cache_key(ident), ident, fit)
    run = HydraRun(out_dir=tmp_path / "run", overrides=overrides, folder_key="hydra.run.dir", group=None)
    assert Point(cfg, run).run() == 0
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (doc["planner"], doc["cost_model"]) == (planner, recorded)
    assert ("coefficients" in doc["plan"]["cost_model"]) == (recorded == "calibrated")
