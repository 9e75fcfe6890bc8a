"""The answer instead of a table: defaults by budget, a baseline in every sweep, shared plans, mtpm=auto's search.

In-process: the search is driven by a fake device here (its memory and speed are formulas, so what the search
must choose is known); tests/integration/test_answer.py runs it on a real backend.
"""

from __future__ import annotations

import json

import pytest

from backends.errors import UserError
from balance_batch import plan_step
from harness.app.config import resolve_config
from harness.auto.model import (
    Candidate,
    Measured,
    MemoryModel,
    candidates_of,
    fit_memory_model,
    memory_limit,
    power_of_two_budgets,
    search,
)
from harness.data.workload import WorkloadSpec, load_workload
from tests.conftest import REPO, compose_config
from tests.unit.test_max_seqs import _frame  # results.json documents in folders, collected as the report reads them

GiB = 1024**3
COMMITTED = REPO / "reports" / "results" / "cpu-2rank-tiny"


_compose = compose_config


# -- the default is the best planner ------------------------------------------------------------------
@pytest.mark.parametrize("overrides, planner, layout", [
    (["mtpm=16384"], "balanced", "packed"),
    (["mtpm=auto"], "balanced", "packed"),
    ([], "greedy", "padded"),  # fixed mbs slices: the original, as the mbs=1 rows always were
    (["mtpm=16384", "planner=greedy", "layout=padded"], "greedy", "padded"),
    (["batching=greedy_padded16384"], "greedy", "padded"),  # the original procedure's presets stay the original
    (["mtpm=32768", "batching=greedy_padded"], "greedy", "padded"),
    (["mtpm=32768", "layout=padded"], "balanced", "padded"),  # what is set stays set
])
def test_a_budget_defaults_to_the_balanced_packed_planner_and_the_presets_keep_the_original(overrides, planner, layout):
    spec = resolve_config(_compose("dry_run=true", *overrides))
    assert (spec.backend.planner, spec.backend.layout) == (planner, layout)


def test_the_original_presets_plan_bit_exactly_as_the_greedy_planner():
    spec = resolve_config(_compose("batching=greedy_padded32768"))
    lengths = load_workload(spec.workload).lengths
    via_preset = plan_step(lengths, world_size=2, max_tokens_per_microbatch=spec.backend.max_tokens_per_microbatch,
                           layout=spec.backend.layout, planner=spec.backend.planner)
    original = plan_step(lengths, world_size=2, max_tokens_per_microbatch=32768, layout="padded",
                         planner="greedy")  # the original planner, named
    assert via_preset.schedules == original.schedules


@pytest.mark.parametrize("value", ["abc", "0", "-5", "true", "1.5"])
def test_a_bad_budget_is_one_line_naming_mtpm_and_what_is_valid(value):
    with pytest.raises(UserError) as info:
        resolve_config(_compose("dry_run=true", f"mtpm={value}"))
    message = str(info.value)
    assert message.startswith("mtpm: must be a positive integer, null (fixed mbs slices) or auto"), message
    assert "\n" not in message


def test_auto_resolves_with_no_budget_for_the_backend_and_the_record_says_none_yet():
    from harness.point.results import base_document

    cfg = _compose("mtpm=auto")
    spec = resolve_config(cfg)
    assert spec.mtpm == "auto" and spec.backend.max_tokens_per_microbatch is None
    doc = base_document(cfg, ["mtpm=auto"])
    assert doc["mtpm"] is None  # a number once chosen; "auto" would make the row unreadable


# -- every sweep carries its baseline -----------------------------------------------------------------
def _with_baselines(jobs):
    from harness.sweep.points import add_baselines

    return add_baselines(jobs, lambda job: _compose(*job))


def test_a_sweep_without_mbs1_gets_one_ahead_of_each_setting_and_one_that_has_it_gets_none():
    jobs = [["backend=fsdp2", "mtpm=16384"], ["backend=fsdp2", "mtpm=32768"],
            ["backend=megatron_ddp", "mtpm=16384"], ["backend=megatron_ddp", "mtpm=32768"]]
    out = _with_baselines(jobs)
    assert out == [["backend=fsdp2", "mtpm=null", "mbs=1"], *jobs[:2],
                   ["backend=megatron_ddp", "mtpm=null", "mbs=1"], *jobs[2:]]
    # mbs=1 spelled as a preset, or left to the defaults, is a baseline already
    for has in (["backend=fsdp2", "batching=fixed_mbs1"], ["backend=fsdp2"]):
        assert _with_baselines([has, ["backend=fsdp2", "mtpm=16384"]]) == [has, ["backend=fsdp2", "mtpm=16384"]]


def test_the_baseline_drops_batching_keys_and_keeps_the_setting():
    jobs = [["model.dtype=bfloat16", "mtpm=16384", "planner=greedy", "layout=padded", "max_seqs_per_microbatch=4"]]
    assert _with_baselines(jobs)[0] == ["model.dtype=bfloat16", "mtpm=null", "mbs=1"]


@pytest.mark.parametrize("budget", ["backend.max_tokens_per_microbatch=2048", "backend.micro_batch_size=2"])
def test_a_budget_spelled_under_backend_is_refused_as_a_second_spelling_of_the_knob(budget):
    """It once got its baseline as the top-level spelling does; now it is refused before it runs (the results and
    the report read the top-level knob), naming the knob to set instead."""
    key, value = budget.split("=")
    refused = rf"^{key}: {value} is a second spelling of (mtpm|mbs) .* set (mtpm|mbs)={value} instead$"
    with pytest.raises(UserError, match=refused):
        resolve_config(_compose("backend=fsdp2", budget))


@pytest.mark.parametrize("jobs", [
    [["mtpm=16384", "bench.baseline=false"]],  # turned off
    [["mtpm=16384", "dry_run=true"]],  # a dry run times nothing
    [["mtpm=auto", "backend=fsdp2"]],  # the search measures mbs=1 itself
])
def test_no_baseline_is_added_where_it_is_off_or_not_wanted(jobs):
    assert _with_baselines(jobs) == jobs


def test_the_baseline_switch_and_share_switch_are_not_part_of_a_points_identity():
    from harness.sweep.points import identity

    assert identity(["mtpm=1", "bench.baseline=false", "bench.share_plans=false"]) == identity(["mtpm=1"])


# -- the search ------------------------------------------------------------------------------------
def test_the_memory_model_fits_a_line_and_a_square_and_never_predicts_less_for_more():
    line = [(t, 0, int(1 * GiB + 50_000 * t)) for t in (1000, 4000, 9000)]
    model = fit_memory_model(line)
    assert model.predict(20_000, 0) == pytest.approx(1 * GiB + 50_000 * 20_000, rel=1e-6)
    square = [(t, t * t, int(GiB + 10_000 * t + 3 * t * t)) for t in (1000, 2000, 4000, 8000)]
    model = fit_memory_model(square, quadratic=True)
    assert model.quadratic and model.predict(16_000, 16_000**2) == pytest.approx(GiB + 160e6 + 3 * 16_000**2, rel=1e-6)
    noisy = [(1000, 0, 2 * GiB), (1100, 0, int(1.9 * GiB))]  # a smaller peak at a larger size: noise, not a law
    assert fit_memory_model(noisy).per_token == 0
    assert fit_memory_model([(1000, 0, GiB), (1000, 0, GiB)]) is None  # one size: no slope


class FakeDevice:
    """Peak = 1 GiB + 200 kB per token; tok/s grows with the micro-batch; out of memory above ``oom_tokens``."""

    def __init__(self, oom_tokens: float = float("inf")):
        self.oom_tokens = oom_tokens
        self.ran: list[int] = []

    def peak(self, tokens: int) -> int:
        return int(GiB + 200_000 * tokens)

    def measure(self, c: Candidate) -> Measured:
        self.ran.append(c.mtpm)
        if c.tokens > self.oom_tokens:
            return Measured("oom", error="out of memory")
        return Measured("ok", tok_per_s=1000 + c.tokens / 10 - c.steps, peak_bytes=self.peak(c.tokens))


def _cands(sizes):
    return [Candidate(mtpm=t, tokens=t, square=0, steps=100_000 // t) for t in sizes]


def test_the_search_runs_what_fits_skips_what_is_predicted_over_and_chooses_the_fastest():
    device = FakeDevice()
    cands = _cands([2048, 4096, 8192, 16384, 32768, 65536])
    limit = device.peak(20_000)  # 16384 fits, 32768 does not
    found = search(cands, device.measure, limit)
    status = {c.mtpm: c.status for c in found.candidates}
    assert status == {2048: "ok", 4096: "ok", 8192: "ok", 16384: "ok", 32768: "over_limit", 65536: "over_limit"}
    assert 32768 not in device.ran and 65536 not in device.ran  # predicted over: never run
    assert found.chosen.mtpm == 16384
    for c in found.candidates:
        assert c.refit_peak_bytes == pytest.approx(device.peak(c.tokens), rel=1e-3)
        if c.predicted_peak_bytes is not None:
            assert c.prediction == "ahead" and c.predicted_peak_bytes == pytest.approx(device.peak(c.tokens), rel=1e-3)
        if c.status == "ok":
            assert c.measured_peak_bytes <= limit
    assert found.candidates[0].decision == "probe" and found.candidates[0].predicted_peak_bytes is None  # no model yet
    assert [c.decision for c in found.candidates[-2:]] == ["predicted_over", "predicted_over"]


class TablePeaks(FakeDevice):
    """Peaks read from a table of T -> bytes (what a real device measured), tok/s growing with T."""

    def __init__(self, peaks: dict):
        super().__init__()
        self.peaks = peaks

    def peak(self, tokens: int) -> int:
        return self.peaks[tokens]


# A run on the real vocabulary (248,320, cpu_mixed, a 3 GiB cap): the mbs=1 baseline and five candidates' T and
# their measured peaks; the largest is the whole rank in one micro-batch, between the slopes seen (3.1-3.5 GB).
ISSUE_PEAKS = {3841: int(1.97e9), 6269: int(2.41e9), 12372: int(2.65e9), 24716: int(3.3e9)}


def test_each_candidate_records_the_prediction_its_decision_used_made_by_the_model_it_records():
    """A prediction is recomputed from its record: the model a candidate records (coefficients and the points they
    were fitted to) gives its predicted peak, and the search's last model gives every refitted one; a probe run
    before two sizes were measured records no prediction rather than one made later by another model."""
    device = TablePeaks(ISSUE_PEAKS)
    cands = [Candidate(mtpm=m, tokens=t, square=0, steps=s)
             for m, t, s in ((2048, 3841, 16), (4096, 3841, 8), (8192, 6269, 4), (16384, 12372, 2), (32768, 24716, 1))]
    found = search(cands, device.measure, 3 * GiB, baseline_point=(3841, 3841**2, ISSUE_PEAKS[3841]))
    final = MemoryModel.from_dict(found.as_dict(0.1, "test")["memory_model"])
    assert fit_memory_model(final.fitted_to) == final  # the recorded points give the recorded model
    for c in found.candidates:
        record = json.loads(json.dumps(c.as_dict()))  # as results.json holds it
        if record["predicted_peak_bytes"] is None:
            assert record["decision"] == "probe" and record["predicted_by"] is None
        else:
            model = MemoryModel.from_dict(record["predicted_by"])
            assert fit_memory_model(model.fitted_to) == model
            assert model.predict(record["tokens"], record["square"]) == record["predicted_peak_bytes"]
        assert final.predict(record["tokens"], record["square"]) == record["refit_peak_bytes"]
        if record["measured_peak_bytes"] is not None:
            assert record["refit_peak_bytes"] == pytest.approx(record["measured_peak_bytes"], rel=0.15)
    by_mtpm = {c.mtpm: c for c in found.candidates}
    assert by_mtpm[16384].decision == "probe" and by_mtpm[16384].predicted_peak_bytes is None  # not a held-out 3.47 GB
    # the same T, the same refitted prediction (their decisions' models differ, and each says which it was)
    assert by_mtpm[2048].refit_peak_bytes == by_mtpm[4096].refit_peak_bytes
    # 32,768 predicted 15% over a 3 GiB limit, by a model that extrapolating from 6,269 to 12,372 tokens was 33% off:
    # within its own error, so measured rather than refused (here it peaks over: a measured fact)
    assert by_mtpm[32768].decision == "within_error" and by_mtpm[32768].margin["fraction"] > 0.3
    assert "extrapolating to T=12,372" in by_mtpm[32768].margin["from"] and by_mtpm[32768].status == "over_limit"


def test_a_refusal_within_the_models_error_of_the_limit_is_measured_and_one_beyond_states_its_margin():
    device = FakeDevice()  # linear: every prediction checked is exact, so the margin is the floor, 5%
    cands = _cands([2048, 4096, 8192, 16384, 32768])
    found = search(cands, device.measure, limit_bytes=int(device.peak(16384) / 1.03))  # 16384 predicted 3% over
    by = {c.mtpm: c for c in found.candidates}
    assert by[16384].decision == "within_error" and by[16384].status == "over_limit"  # measured: a fact
    assert by[16384].reason.startswith("measured peak") and 16384 in device.ran
    assert by[32768].decision == "above_failure" and 32768 not in device.ran
    found = search(_cands([2048, 4096, 8192, 16384, 32768]), FakeDevice().measure,
                   limit_bytes=int(device.peak(16384) / 1.2))  # 20% over: beyond the 5% the model has shown
    refused = {c.mtpm: c for c in found.candidates}[16384]
    assert refused.decision == "predicted_over" and refused.measured_peak_bytes is None
    assert refused.margin["fraction"] == 0.05 and "largest error" in refused.margin["from"]
    assert "20% over the limit" in refused.reason and "beyond the model's error (5%" in refused.reason


def test_a_refusal_the_last_refit_moves_within_reach_is_revisited_and_measured():
    """T not ascending with the budget (a planner may cut a larger budget's plan smaller): 8,000 is refused on the
    first two points (2.4 GiB, beyond the 15% assumed), 7,000 is measured within that margin and peaks far under
    its prediction; the refit, and the error it showed, put 8,000 within reach, so it runs after all."""
    peaks = {1000: 1 * GiB, 6000: 2 * GiB, 7000: int(1.8 * GiB), 8000: int(1.9 * GiB)}
    device = TablePeaks(peaks)
    cands = [Candidate(mtpm=m, tokens=t, square=0, steps=1) for m, t in ((1, 1000), (2, 8000), (3, 6000), (4, 7000))]
    found = search(cands, device.measure, limit_bytes=2 * GiB)
    by = {c.mtpm: c for c in found.candidates}
    assert by[4].decision == "within_error" and by[4].status == "ok"
    assert by[2].decision == "revisited" and by[2].status == "ok" and by[2].measured_peak_bytes == peaks[8000]
    first = by[2].revisited
    assert first["predicted_peak_bytes"] == pytest.approx(2.4 * GiB, rel=1e-6) and first["margin"]["fraction"] == 0.15
    assert MemoryModel.from_dict(first["predicted_by"]).predict(8000, 0) == first["predicted_peak_bytes"]
    assert device.ran == [1, 3, 4, 2]


def test_an_out_of_memory_probe_is_a_result_and_the_search_goes_on_below_it():
    device = FakeDevice(oom_tokens=10_000)  # the memory says yes, the device says no above 10k tokens
    cands = _cands([2048, 4096, 8192, 16384, 32768, 65536])
    found = search(cands, device.measure, limit_bytes=100 * GiB)
    status = {c.mtpm: c.status for c in found.candidates}
    assert status[2048] == status[4096] == status[8192] == "ok"
    assert status[16384] == "oom" and status[32768] == status[65536] == "over_limit"
    assert 65536 not in device.ran  # nothing above an out-of-memory budget is run
    assert found.chosen.mtpm == 8192


def test_nothing_fits_is_no_choice_and_a_measured_peak_over_the_limit_is_not_chosen():
    device = FakeDevice(oom_tokens=100)
    found = search(_cands([2048, 4096]), device.measure, limit_bytes=100 * GiB)
    assert found.chosen is None and [c.status for c in found.candidates] == ["oom", "over_limit"]
    device = FakeDevice()
    found = search(_cands([2048, 4096]), device.measure, limit_bytes=device.peak(3000))
    assert [c.status for c in found.candidates] == ["ok", "over_limit"] and found.chosen.mtpm == 2048


def greedy_padded(lengths, budget):
    """The original greedy padded plan over 2 lock-step ranks."""
    return plan_step(lengths, world_size=2, max_tokens_per_microbatch=budget, layout="padded", planner="greedy")


def test_candidates_are_distinct_plans_the_smallest_budget_naming_each():
    lengths = load_workload(WorkloadSpec(name="cpu_mixed", kind="mixed", n_examples=24, min_len=64, max_len=4096,
                                         seed=42)).lengths
    budgets = power_of_two_budgets(lengths, 2, "padded")
    # half the longest (3,531) up to the budget holding a rank's 12 sequences padded to the longest (42,372)
    assert budgets == [2048, 4096, 8192, 16384, 32768, 65536]
    published = candidates_of(lengths, [16384, 32768, 65536, 131072],
                              lambda b: greedy_padded(lengths, b), "padded")
    assert [(c.mtpm, c.same_plan) for c in published] == [(16384, []), (32768, []), (65536, [131072])]
    cands = candidates_of(lengths, budgets, lambda b: greedy_padded(lengths, b), "padded")
    assert len({json.dumps(greedy_padded(lengths, c.mtpm).schedules) for c in cands}) == len(cands)
    assert all(a.tokens <= b.tokens for a, b in zip(cands, cands[1:]))


def test_a_peer_planners_refused_budgets_are_no_candidates_and_are_recorded():
    """mtpm=auto with a peer that refuses a sequence over its budget (verl): the budgets under the longest sequence
    are refused as verl refuses them, recorded with its line, and the search keeps to the budgets it plans."""
    from harness.peers.common import PeerRefusal  # importing harness.peers registers verl with the library

    lengths = [3000, 500, 700, 1200, 90, 2500]
    budgets = power_of_two_budgets(lengths, 2, "packed")  # from 2,048: under the longest (3,000)
    assert budgets[0] < max(lengths)

    def plan_at(b):
        return plan_step(lengths, world_size=2, max_tokens_per_microbatch=b, layout="packed", planner="verl")

    refused: list = []
    cands = candidates_of(lengths, budgets, plan_at, "packed", refused=refused)
    assert [r["mtpm"] for r in refused] == [b for b in budgets if b < max(lengths)]
    assert all("verl refuses example 0 of 3000 tokens" in r["reason"] for r in refused)
    assert cands and all(c.mtpm >= max(lengths) for c in cands)
    with pytest.raises(PeerRefusal):  # without a list to record them in, the refusal is the caller's
        candidates_of(lengths, budgets, plan_at, "packed")


def test_the_limit_is_the_given_cap_or_the_device_less_headroom_shared_by_cpu_ranks():
    assert memory_limit(3, {"type": "cpu", "memory_bytes": 24 * GiB}, 2, 0.1) == (3 * GiB, "bench.memory_limit_gb")
    limit, source = memory_limit(None, {"type": "cpu", "memory_bytes": 24 * GiB}, 2, 0.1)
    assert limit == int(24 * GiB * 0.9 / 2) and "2 rank" in source
    limit, _ = memory_limit(None, {"type": "cuda", "memory_bytes": 80 * GiB}, 4, 0.1)
    assert limit == int(80 * GiB * 0.9)


# -- the report's answer ----------------------------------------------------------------------------
def test_an_auto_row_is_the_answer_first_with_its_speedup_over_the_searched_baseline(tmp_path):
    from reports.render import markdown_tables

    doc = json.loads((COMMITTED / "6" / "results.json").read_text())  # fsdp2, balanced packed 16,384
    doc.pop("speedup", None)  # not paired: the speedup is over the baseline the search measured
    fb = doc["passes"]["forward_backward"]
    doc["auto"] = {"candidates": [{"mtpm": doc["mtpm"], "status": "ok"}, {"mtpm": 65536, "status": "over_limit"}],
                   "limit_bytes": 3 * GiB, "baseline": {"status": "ok", "tok_per_s": fb["tok_per_s"] / 2}, "chosen":
                   doc["mtpm"]}
    text = markdown_tables(_frame(tmp_path, {"0": doc}))
    first = text.splitlines()[0]
    assert first.startswith(f"- FSDP2: set mtpm={doc['mtpm']:,} (balanced, packed): {fb['tok_per_s']:,.0f} tok/s "
                            "fwd+bwd, 2.00× mbs=1, peak "), first
    assert "of 3.0 GiB" in first and "mtpm=auto" in first


def test_a_shared_row_says_whose_measurement_it_shows(tmp_path):
    from reports.render import table_frame

    doc = json.loads((COMMITTED / "0" / "results.json").read_text())
    # whatever its repeats' spread: a noisy row says so (tests/unit/test_spread.py)
    for measured in doc["passes"].values():
        measured["noisy"] = False
    shared = {**doc, "mtpm": 131072, "shares": {"folder": "3", "mtpm": 65536, "mbs": 1}}
    frame = table_frame(_frame(tmp_path, {"0": doc, "1": shared}))
    assert list(frame["status"]) == ["ok", "ok (shares mtpm=65,536's measurement: same plan)"]
    assert frame["speedup (fwd+bwd vs mbs 1)"][0] == "1.00× (baseline)"


def test_two_budgets_share_a_measurement_only_when_the_plan_and_everything_else_match():
    from harness.point.sharing import measurement_key

    def key(*overrides):
        cfg = _compose(*overrides)
        spec = resolve_config(cfg)
        b = spec.backend
        lengths = load_workload(spec.workload).lengths
        plan = plan_step(lengths, world_size=2, max_tokens_per_microbatch=b.max_tokens_per_microbatch,
                         micro_batch_size=b.micro_batch_size, layout=b.layout, planner=b.planner)
        return measurement_key(cfg, plan)

    greedy = ("planner=greedy", "layout=padded")
    assert key("mtpm=65536", *greedy) == key("mtpm=131072", *greedy)  # one plan
    assert key("mtpm=65536", *greedy, "logger=none", "bench.share_plans=false") == key("mtpm=131072", *greedy)
    assert key("mtpm=16384", *greedy) != key("mtpm=32768", *greedy)  # another plan (2 micro-batches per rank, not 1)
    assert key("mtpm=65536", *greedy) != key("mtpm=131072", *greedy, "model.dtype=bfloat16")  # another setting
    assert key("mtpm=65536", *greedy) != key("mtpm=131072", *greedy, "bench.repeat=5")  # another protocol
    assert key("mtpm=16384") == key("mtpm=65536")  # balanced packed: one micro-batch per rank at both
    assert key("mtpm=32768") != key("mtpm=32768", "layout=padded")


# -- mtpm=auto's answer line ----------------------------------------------------------------------------
def _auto_doc(speedup=None, tie=None):
    """An mtpm=auto point's results.json, as _record_auto_choice leaves it: the search's mbs=1 run at 100 tok/s
    (measured at another time), the chosen budget at 283 tok/s."""
    return {"backend": "fsdp2", "mtpm": 16384, "planner": "balanced", "layout": "packed",
            "passes": {"forward_backward": {"tok_per_s": 283.0, "mem_peak_bytes": [GiB, 2 * GiB]}},
            "auto": {"baseline": {"status": "ok", "tok_per_s": 100.0}, "limit_bytes": 8 * GiB, "tie": tie},
            "speedup": speedup}


def test_the_auto_answer_line_says_the_paired_speedup_and_its_interval_that_results_json_holds(caplog):
    from harness.point.logs import log_answer as _log_answer

    paired = {"median": 2.14, "ci": [1.9, 2.4], "pairs": [2.0, 2.14, 2.3]}
    with caplog.at_level("INFO", logger="harness"):
        _log_answer("", _auto_doc(paired))
    line = caplog.records[-1].getMessage()
    assert "2.14× mbs=1 (3 pairs, 95% interval 1.90–2.40)" in line and "2.83" not in line, line
    # mbs=1 ran faster, paired, though the unpaired ratio says 2.83×; an interval holding 1.0 is said as such
    for speedup, words in (({"median": 0.9, "ci": [0.85, 0.95], "pairs": [0.9] * 3}, "mbs=1 ran faster"),
                           ({"median": 1.1, "ci": [0.7, 1.6], "pairs": [1.1] * 3}, "not told apart from mbs=1")):
        caplog.clear()
        with caplog.at_level("INFO", logger="harness"):
            _log_answer("", _auto_doc(speedup))
        assert words in caplog.records[-1].getMessage()
    caplog.clear()
    with caplog.at_level("INFO", logger="harness"):
        _log_answer("", _auto_doc(None))  # bench.paired=false: the search's own mbs=1 run, and it says so
    assert "2.83× mbs=1 (unpaired)" in caplog.records[-1].getMessage()


def test_the_auto_answer_line_names_each_budget_refused_without_a_measurement_and_why(caplog):
    """A refusal by prediction is not a measured fact, so the answer line says it was not tried, by how much it
    was predicted over and the model's error it was weighed against; one above an out of memory says that."""
    from harness.point.logs import log_answer

    doc = _auto_doc({"median": 2.14, "ci": [1.9, 2.4], "pairs": [2.0, 2.14, 2.3]})
    doc["auto"]["candidates"] = [
        {"mtpm": 16384, "decision": "predicted_fit", "status": "ok"},
        {"mtpm": 32768, "decision": "predicted_over", "status": "over_limit", "predicted_peak_bytes": int(9.2 * GiB),
         "margin": {"fraction": 0.1, "from": "x"}},
        {"mtpm": 65536, "decision": "above_failure", "status": "over_limit",
         "reason": "larger than mtpm=32768, which ran out of memory"}]
    with caplog.at_level("INFO", logger="harness"):
        log_answer("", doc)
    line = caplog.records[-1].getMessage()
    assert ("not tried: mtpm=32768 (predicted 9.20 GiB, 15% over the limit, beyond the model's 10% error), "
            "mtpm=65536 (larger than mtpm=32768, which ran out of memory)") in line, line


def test_the_reports_auto_line_counts_a_budget_that_ran_over_the_limit_as_measured(tmp_path):
    """The report's answer for an mtpm=auto row: "N budgets measured" counts every candidate that ran (to its end,
    out of memory, or past the limit by its measured peak), never one refused by prediction or above a failure."""
    from reports.render import fastest_lines

    doc = json.loads((REPO / "reports" / "results" / "cpu-2rank-tiny" / "0" / "results.json").read_text())
    doc.update(mtpm=16384, planner="balanced", layout="packed", speedup=None)
    doc["plan"] = {**doc["plan"], "planner": "balanced", "layout": "packed"}
    doc["auto"] = {"baseline": {"status": "ok", "tok_per_s": 100.0}, "limit_bytes": 8 * GiB, "candidates": [
        {"mtpm": 8192, "status": "ok", "measured_peak_bytes": 5 * GiB},
        {"mtpm": 16384, "status": "ok", "measured_peak_bytes": 7 * GiB},
        {"mtpm": 32768, "status": "over_limit", "decision": "predicted_fit", "measured_peak_bytes": 9 * GiB},
        {"mtpm": 65536, "status": "over_limit", "decision": "above_failure", "measured_peak_bytes": None},
        {"mtpm": 131072, "status": "over_limit", "decision": "predicted_over", "measured_peak_bytes": None}]}
    (line,) = [line for line in fastest_lines(_frame(tmp_path, {"0": doc})) if "mtpm=auto" in line]
    assert "(mtpm=auto: the fastest of 3 budgets measured, of 5 distinct plans)" in line, line


def test_planning_the_candidates_shows_progress_while_it_lasts(caplog):
    """A million sequences plan for seconds a budget: a line as planning starts, then one per bench.progress_every_s
    (a fake clock: 4 s a budget, a line every 10 s), none once every budget is planned."""
    from harness.auto.model import PlanningProgress

    lengths = [100, 200, 300, 400]
    budgets = [256, 512, 1024, 2048, 4096, 8192, 16384]
    now = [0.0]

    def plan_at(b):
        now[0] += 4.0
        return plan_step(lengths, world_size=1, max_tokens_per_microbatch=b, layout="packed", planner="balanced",
                         lockstep=False)

    with caplog.at_level("INFO", logger="harness.auto"):
        progress = PlanningProgress("[x] ", budgets, len(lengths), 10.0, clock=lambda: now[0])
        candidates_of(lengths, budgets, plan_at, "packed", on_planned=progress)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["[x] mtpm=auto: planning 7 budgets (mtpm=256 to 16,384) for 4 sequences",
                     "[x] mtpm=auto: planned 3/7 budgets (up to mtpm=1,024) in 12 s",
                     "[x] mtpm=auto: planned 6/7 budgets (up to mtpm=8,192) in 24 s"], lines
