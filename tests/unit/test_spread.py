"""Numbers that hold on a noisy machine: intervals on every figure, speedups measured in pairs, repeats until the
interval is tight, and a machine that drifts (harness/metrics/spread.py, harness/measuring/measure.py)."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from backends.backend import Backend
from backends.messages import PassResult, make_command
from backends.specs import BackendSpec, ModelSpec
from harness.data.workload import make_examples
from harness.measuring.measure import measure_pass
from harness.measuring.records import merge_records
from harness.measuring.runner import Pairing
from harness.metrics.spread import NOISY_RATIO, half_width_pct, interval, paired_speedup, summary, t_quantile

EXAMPLES = make_examples([100, 200, 300, 400], 64, seed=0)
TOKENS = sum(len(e) for e in EXAMPLES)


def test_the_interval_is_students_t_on_the_logs_and_covers_the_geometric_mean_as_often_as_it_says():
    assert t_quantile(2) == pytest.approx(4.303) and t_quantile(1000) == pytest.approx(1.962, abs=1e-3)
    lo, hi = interval([100.0, 110.0, 121.0])  # logs equally spaced: the centre is the middle value
    assert math.sqrt(lo * hi) == pytest.approx(110.0)
    logs = np.log([100.0, 110.0, 121.0])
    assert math.log(hi / 110.0) == pytest.approx(4.303 * np.std(logs, ddof=1) / math.sqrt(3), rel=1e-3)
    assert interval([5.0]) is None and half_width_pct(None) is None
    # coverage: 2,000 samples of 5 repeats with 4% multiplicative noise around 1,000 tok/s
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        lo, hi = interval(1000.0 * np.exp(rng.normal(0, 0.04, 5)))
        hits += lo <= 1000.0 <= hi
    assert 0.93 <= hits / 2000 <= 0.97


def test_a_figure_records_its_median_spread_interval_and_whether_it_is_noisy():
    s = summary([1000.0, 1020.0, 990.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (1000.0, 990.0, 1020.0, 3) and not s["noisy"]
    assert s["ci"][0] < 990.0 and s["ci"][1] > 1020.0 and 0 < s["ci_pct"] < 10
    assert summary([1000.0, 1000.0 * NOISY_RATIO * 1.01])["noisy"]
    assert summary([])["median"] is None
    speed = paired_speedup([150.0, 140.0, 160.0], [100.0, 100.0, 100.0])
    assert speed["pairs"] == [1.5, 1.4, 1.6] and speed["median"] == 1.5 and speed["ci"][0] < 1.4 < 1.6 < speed["ci"][1]
    with pytest.raises(ValueError, match="as many baseline runs"):
        paired_speedup([1.0, 2.0], [1.0])


class DriftingBackend(Backend):
    """A machine that slows down steadily: each pass takes its work × (1 + drift × the passes run before it).

    The point (a budget) does 1 unit of work, the mbs=1 baseline 1.5: the true speedup is 1.5 at any moment.
    """

    name = "drifting"

    def __init__(self, drift: float, noise: float = 0.0, seed: int = 0):
        super().__init__(BackendSpec(), ModelSpec())
        self.drift, self.noise, self.calls = drift, noise, 0
        self.rng = np.random.default_rng(seed)

    def _run_pass(self, command) -> PassResult:
        plan = command.plan(1, lockstep=False)
        work = 1.5 if command.max_tokens_per_microbatch is None else 1.0
        step_s = work * (1 + self.drift * self.calls) * math.exp(self.noise * self.rng.standard_normal())
        self.calls += 1
        return PassResult(outputs=[], plan=plan.stats.as_dict(), step_s=step_s)


def _commands(mtpm):
    return lambda pass_type: make_command(pass_type, EXAMPLES, mtpm, 1)


def test_a_drifting_machine_fools_points_measured_one_after_the_other_and_not_paired_repeats():
    backend = DriftingBackend(drift=0.03)
    # one after the other, as a sweep's points run: the baseline, then the point, on a machine 3% slower per pass
    base, _ = measure_pass(backend, EXAMPLES, "forward_backward", 1, 5, _commands(None), sample_interval_s=0.05)
    point, _ = measure_pass(backend, EXAMPLES, "forward_backward", 1, 5, _commands(1000), sample_interval_s=0.05)
    sequential = point.tok_per_s / base.tok_per_s
    assert sequential < 1.5 * 0.88  # the drift between the two points eats more than a tenth of the speedup
    # side by side: every repeat of the point beside an mbs=1 pass, in alternating order
    paired, _ = measure_pass(DriftingBackend(drift=0.03), EXAMPLES, "forward_backward", 1, 6, _commands(1000),
                             sample_interval_s=0.05, pairing=Pairing(_commands(None), point=(1000, 1)))
    speed = paired.spread_fields()["speedup"]
    assert len(speed["pairs"]) == 6 and speed["ci"][0] <= 1.5 <= speed["ci"][1]
    assert speed["median"] == pytest.approx(1.5, rel=0.02)
    assert abs(speed["median"] - 1.5) < abs(sequential - 1.5) / 5
    assert speed["baseline_tok_per_s"]["n"] == 6 and len(speed["baseline_elapsed_s"]) == 6
    assert speed["baseline_plan"]["planner"] == "greedy" and speed["baseline_plan"]["n_microbatches"] == [4]


class SwitchingBackend(DriftingBackend):
    """A machine whose first pass after a change of shape is slower (caches released, pages faulted in again), and
    more so into the point's bigger micro-batches (+60%) than into mbs=1 (+10%); otherwise steady. True speedup 1.5."""

    def __init__(self):
        super().__init__(drift=0.0)
        self.previous = None

    def _run_pass(self, command) -> PassResult:
        out = super()._run_pass(command)
        shape = command.max_tokens_per_microbatch
        if self.previous is not None and shape != self.previous:
            out.step_s *= 1.1 if shape is None else 1.6
        self.previous = shape
        return out


def test_every_timed_pass_of_a_pair_follows_one_of_its_own_shape_so_a_switch_costs_neither_side():
    paired, _ = measure_pass(SwitchingBackend(), EXAMPLES, "forward_backward", 1, 6, _commands(1000),
                             sample_interval_s=0.05, pairing=Pairing(_commands(None), point=(1000, 1)))
    speed = paired.spread_fields()["speedup"]
    assert speed["pairs"] == pytest.approx([1.5] * 6) and speed["median"] == pytest.approx(1.5)
    # one settling pass per pair (the pairs alternate, so only the switch inside each pair needs one)
    assert speed["settling_passes"] == 6 and not speed["noisy"]


def test_repeats_go_on_until_the_interval_is_as_tight_as_asked_and_stop_at_the_most_allowed():
    loose, _ = measure_pass(DriftingBackend(drift=0.0, noise=0.05), EXAMPLES, "forward", 0, 3, _commands(1000),
                            sample_interval_s=0.05)
    assert loose.spread_fields()["repeats"] == 3 and loose.spread_fields()["tok_per_s_ci_pct"] > 3
    tight, _ = measure_pass(DriftingBackend(drift=0.0, noise=0.05), EXAMPLES, "forward", 0, 3, _commands(1000),
                            sample_interval_s=0.05, target_ci_pct=3.0, max_repeats=40)
    fields = tight.spread_fields()
    assert 3 < fields["repeats"] < 40 and fields["tok_per_s_ci_pct"] <= 3.0 and fields["target_ci_pct"] == 3.0
    capped, _ = measure_pass(DriftingBackend(drift=0.0, noise=0.2), EXAMPLES, "forward", 0, 3, _commands(1000),
                             sample_interval_s=0.05, target_ci_pct=0.5, max_repeats=6)
    assert capped.spread_fields()["repeats"] == 6 and capped.spread_fields()["tok_per_s_ci_pct"] > 0.5
    # paired: the target holds for the speedup's interval too
    paired, _ = measure_pass(DriftingBackend(drift=0.02, noise=0.03), EXAMPLES, "forward_backward", 1, 3,
                             _commands(1000), sample_interval_s=0.05, target_ci_pct=2.0, max_repeats=40,
                             pairing=Pairing(_commands(None), point=(1000, 1)))
    assert paired.spread_fields()["speedup"]["ci_pct"] <= 2.0


def test_more_repeats_of_a_paired_pass_merge_into_one_speedup():
    backend = DriftingBackend(drift=0.01)
    pairing = Pairing(_commands(None), point=(1000, 1))
    first, _ = measure_pass(backend, EXAMPLES, "forward_backward", 1, 2, _commands(1000), sample_interval_s=0.05,
                            pairing=pairing)
    more, _ = measure_pass(backend, EXAMPLES, "forward_backward", 0, 2, _commands(1000), sample_interval_s=0.05,
                           release_first=False, pairing=pairing)
    merged = merge_records(first, more).spread_fields()
    assert merged["repeats"] == 4 and len(merged["speedup"]["pairs"]) == 4
    assert statistics.median(merged["speedup"]["pairs"]) == merged["speedup"]["median"]


def _point_doc(speedup, noisy=False):
    """The committed sweep's FSDP2 balanced packed 16k point, with the paired speedup (and noise flag) given."""
    from tests.unit.test_report_inputs import COMMITTED

    doc = json.loads((COMMITTED / "6" / "results.json").read_text())
    for pass_type, measured in doc["passes"].items():
        measured["noisy"] = noisy and pass_type == "forward_backward"
    if speedup is None:
        doc.pop("speedup", None)
    else:
        doc["speedup"] = {"pass_type": "forward_backward", "noisy": False, **speedup}
    return doc


def _fsdp2_report(tmp_path, point) -> tuple[str, str, str]:
    """(the point's table row, the FSDP2 answer line, the whole report) of a sweep of the mbs=1 baseline and
    ``point``."""
    from tests.unit.test_report_inputs import COMMITTED, _report

    base = json.loads((COMMITTED / "0" / "results.json").read_text())
    base.pop("speedup", None)
    for measured in base["passes"].values():
        measured["noisy"] = False
    report = _report(tmp_path, {"0": base, "1": point})
    rows = [line for line in report.splitlines() if line.startswith("| FSDP2") and "| 16,384" in line]
    answers = [line for line in report.splitlines() if line.startswith("- FSDP2:")]
    assert len(rows) == 1 and len(answers) == 1, report
    return rows[0], answers[0], report


def test_the_table_and_the_answer_show_the_paired_interval_and_say_when_it_cannot_tell_or_is_noisy(tmp_path):
    from reports.render import NOISY_NOTE

    row, answer, report = _fsdp2_report(tmp_path / "a", _point_doc({"median": 1.2, "ci": [1.1, 1.3],
                                                                    "pairs": [1.1, 1.2, 1.3], "n": 3}))
    assert "| 1.20× (95% 1.10–1.30, 3 pairs)" in row and "1.20× mbs=1 (3 pairs, 95% interval 1.10–1.30)" in answer
    # the interval is the pairs' geometric mean's, the figure their median: by its bounds, never a ± around the
    # median (0.95× ±19.8% read as 0.76–1.14 where the interval was 0.86–1.23)
    row, _, _ = _fsdp2_report(tmp_path / "skew", _point_doc({"median": 0.95, "ci": [0.86, 1.23],
                                                             "pairs": [0.9, 0.95, 1.2], "n": 3}))
    assert "| 0.95× (95% 0.86–1.23, 3 pairs)" in row and "±" not in row.split("|")[11], row
    assert "noisy" not in row + answer and NOISY_NOTE not in report and "not told apart" not in answer
    # an interval that holds 1.0: neither side is declared faster
    _, answer, _ = _fsdp2_report(tmp_path / "b", _point_doc({"median": 1.05, "ci": [0.9, 1.2],
                                                             "pairs": [0.9, 1.05, 1.2], "n": 3}))
    assert "not told apart from mbs=1 here" in answer and "no budget pays" not in answer
    # a pass whose repeats spread more than 10%: flagged in its status, the answer and a line under the table
    row, answer, report = _fsdp2_report(tmp_path / "c", _point_doc({"median": 1.2, "ci": [1.1, 1.3],
                                                                    "pairs": [1.1, 1.2, 1.3], "n": 3}, noisy=True))
    assert "| ok, noisy |" in row and ", noisy" in answer and NOISY_NOTE in report
    # the answer ranks by the pairs: a point whose tok/s was measured while the machine ran fast does not win on that
    from tests.unit.test_report_inputs import COMMITTED, _report

    base = json.loads((COMMITTED / "0" / "results.json").read_text())
    slow = _point_doc({"median": 1.3, "ci": [1.2, 1.4], "pairs": [1.2, 1.3, 1.4], "n": 3})
    lucky = _point_doc({"median": 1.1, "ci": [1.05, 1.15], "pairs": [1.05, 1.1, 1.15], "n": 3})
    lucky["mtpm"] = 32768
    lucky["passes"]["forward_backward"]["tok_per_s"] = 2 * slow["passes"]["forward_backward"]["tok_per_s"]
    report = _report(tmp_path / "e", {"0": base, "1": slow, "2": lucky})
    (answer,) = [line for line in report.splitlines() if line.startswith("- FSDP2:")]
    assert answer.startswith("- FSDP2: set mtpm=16,384") and "1.30× mbs=1" in answer, answer
    # not paired (bench.paired=false): the ratio to the sweep's own mbs=1 row, said to be unpaired
    point = _point_doc(None)
    row, answer, report = _fsdp2_report(tmp_path / "d", point)
    base = json.loads((tmp_path / "d" / "sweep" / "0" / "results.json").read_text())
    ratio = point["passes"]["forward_backward"]["tok_per_s"] / base["passes"]["forward_backward"]["tok_per_s"]
    assert f"{ratio:.2f}× (unpaired)" in row and f"{ratio:.2f}× mbs=1" in answer and "pairs" not in answer


def test_two_repeats_show_the_intervals_bounds_never_a_plus_minus_below_zero_and_say_two_is_the_cause(tmp_path):
    point = _point_doc({"median": 3.63, "ci": list(interval([1.1, 12.0])), "pairs": [1.1, 12.0], "n": 2})
    fb = point["passes"]["forward_backward"]
    fb["elapsed_s"] = fb["elapsed_s"][:2]
    fb["elapsed_s"][1] = fb["elapsed_s"][0] * 1.6  # two repeats far apart, as on a loaded machine
    fb["tok_per_s_ci"] = list(interval([fb["real_tokens"] / t for t in fb["elapsed_s"]]))
    fb["repeats"] = 2
    assert half_width_pct(fb["tok_per_s_ci"]) > 100  # as a ± it would reach below zero
    row, _, report = _fsdp2_report(tmp_path, point)
    lo, hi = fb["tok_per_s_ci"]
    assert f"(95% {lo:,.0f}–{hi:,.0f}, only 2 repeats)" in row, row
    slo, shi = interval([1.1, 12.0])
    assert f"3.63× (95% {slo:.2f}–{shi:.2f}, only 2 pairs)" in row, row
    assert "±" not in row.split("|")[9] + row.split("|")[11], row  # the fwd+bwd tok/s and speedup cells
    from reports.render import TWO_VALUES_NOTE

    assert TWO_VALUES_NOTE in report and "t(1) = 12.7" in TWO_VALUES_NOTE


def test_a_target_interval_not_reached_after_the_most_repeats_is_one_warning_and_recorded(caplog):
    with caplog.at_level("WARNING", logger="harness.measure"):
        capped, _ = measure_pass(DriftingBackend(drift=0.0, noise=0.2), EXAMPLES, "forward", 0, 3, _commands(1000),
                                 sample_interval_s=0.05, target_ci_pct=0.5, max_repeats=4)
    lines = [r.getMessage() for r in caplog.records if "target_ci_pct" in r.getMessage()]
    assert len(lines) == 1 and "bench.target_ci_pct=0.5 not reached after 4 repeats" in lines[0], lines
    assert capped.as_dict()["target_ci_reached"] is False
    caplog.clear()
    with caplog.at_level("WARNING", logger="harness.measure"):
        loose, _ = measure_pass(DriftingBackend(drift=0.0, noise=0.01), EXAMPLES, "forward", 0, 3, _commands(1000),
                                sample_interval_s=0.05, target_ci_pct=50.0, max_repeats=4)
    assert loose.as_dict()["target_ci_reached"] is True and not caplog.records
