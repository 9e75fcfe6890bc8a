"""mtpm=auto's two leading budgets when their speedups cannot be told apart: more pairs, then the stated tie rule
(harness/auto/lead.py), driven by a fake device whose true speedups are known; and the report's answer on such a tie."""

from __future__ import annotations

import json
import random

from harness.auto.lead import Leader, settle, settle_ranked

GiB = 1024**3


class FakePairs:
    """Pair ratios drawn around each budget's true speedup with a multiplicative noise; counts what it measured."""

    def __init__(self, true: dict, noise: float, seed: int = 0):
        self.true, self.noise, self.rng = true, noise, random.Random(seed)
        self.measured: dict = {m: 0 for m in true}

    def ratio(self, mtpm: int) -> float:
        return self.true[mtpm] * (1 + self.noise * self.rng.uniform(-1, 1))

    def more(self, lead: Leader, n: int) -> list[float]:
        self.measured[lead.mtpm] += n
        return lead.pairs + [self.ratio(lead.mtpm) for _ in range(n)]


def test_leaders_a_single_pair_misranked_are_measured_until_the_faster_leads_clearly():
    device = FakePairs({16384: 1.5, 32768: 1.3}, noise=0.08)
    # the search's single pairs put the slower budget first, as noise does
    leaders = [Leader(32768, 2 * GiB, [1.45]), Leader(16384, 3 * GiB, [1.40])]
    settled = settle(leaders, device.more, repeat=3, max_repeats=20)
    assert settled.chosen.mtpm == 16384 and not settled.tied and settled.as_dict() is None
    assert 3 <= settled.pairs < 20  # more pairs than the search's one, fewer than the cap: they parted


def test_leaders_that_stay_alike_up_to_the_most_repeats_tie_and_the_rule_chooses_the_one_using_less_memory():
    device = FakePairs({16384: 1.3, 32768: 1.3}, noise=0.2)
    leaders = [Leader(32768, 3 * GiB, [1.5]), Leader(16384, 2 * GiB, [1.1])]
    settled = settle(leaders, device.more, repeat=3, max_repeats=6)
    assert settled.pairs == 6 and device.measured == {16384: 5, 32768: 5}  # measured up to the cap, no further
    assert settled.chosen.mtpm == 16384 and [t.mtpm for t in settled.tied] == [32768]
    assert settled.rule == "the least peak memory" and settled.as_dict() == {
        "with": [32768], "rule": settled.rule, "pairs": 6, "peaks": {"16384": 2 * GiB, "32768": 3 * GiB}}


def test_one_pair_each_and_one_allowed_measures_nothing_more():
    device = FakePairs({16384: 1.3, 32768: 1.2}, noise=0.0)
    settled = settle([Leader(16384, GiB, [1.3]), Leader(32768, GiB, [1.2])], device.more, repeat=1, max_repeats=1)
    assert settled.chosen.mtpm == 16384 and device.measured == {16384: 0, 32768: 0}


def test_a_budget_ranked_third_on_one_pair_not_below_the_chosen_interval_is_measured_again_and_can_win():
    """8,192 at 1.52x on one pair, third behind two budgets whose single pairs flattered them; once
    their medians settle near 1.3x, its one pair is above their interval, so it is measured and wins clearly. A
    budget whose one pair is below the interval (1.0x) is not measured again."""
    device = FakePairs({32768: 1.3, 16384: 1.3, 8192: 1.5, 4096: 1.0}, noise=0.03)
    ranked = [Leader(32768, GiB, [1.6]), Leader(16384, GiB, [1.55]), Leader(8192, GiB, [1.52]),
              Leader(4096, GiB, [1.0])]
    settled, contested = settle_ranked(ranked, device.more, repeat=3, max_repeats=10)
    assert contested == [32768, 16384, 8192] and device.measured[4096] == 0
    assert settled.chosen.mtpm == 8192 and not settled.tied and device.measured[8192] >= 2


def test_with_one_pair_each_nothing_is_measured_again_and_the_answer_says_the_ranking_rests_on_single_pairs(caplog):
    from harness.point.logs import log_answer
    from tests.unit.test_answer import _auto_doc

    device = FakePairs({16384: 1.3, 8192: 1.5}, noise=0.0)
    settled, contested = settle_ranked([Leader(16384, GiB, [1.6]), Leader(8192, GiB, [1.52])], device.more,
                                       repeat=1, max_repeats=1)
    assert settled.chosen.mtpm == 16384 and device.measured == {16384: 0, 8192: 0}
    doc = _auto_doc({"median": 1.6, "ci": None, "pairs": [1.6]})
    doc["auto"]["ranking"] = {"pairs": {"16384": 1, "8192": 1}, "measured_again": contested,
                              "on_one_pair": [], "repeat": 1}
    with caplog.at_level("INFO", logger="harness"):
        log_answer("", doc)
    assert "every budget ranked on one pair (bench.repeat=1" in caplog.records[-1].getMessage()
    doc["auto"]["ranking"] = {"pairs": {"16384": 3, "8192": 3, "4096": 1}, "measured_again": [16384, 8192],
                              "on_one_pair": [{"mtpm": 4096, "speedup": 1.01}], "repeat": 3}
    caplog.clear()
    with caplog.at_level("INFO", logger="harness"):
        log_answer("", doc)
    assert "ranked below the leaders on one pair each: mtpm=4096 (1.01×)" in caplog.records[-1].getMessage()


def test_the_reports_answer_says_a_tie_and_prefers_the_budget_shown_faster_than_mbs1(tmp_path):
    """A `make run` where 16,384 at 1.72x (0.56-3.96) led 32,768 at 1.24x (1.02-1.50) by its median alone."""
    from tests.unit.test_report_inputs import COMMITTED, _report
    from tests.unit.test_spread import _point_doc

    base = json.loads((COMMITTED / "0" / "results.json").read_text())
    base.pop("speedup", None)
    wide = _point_doc({"median": 1.72, "ci": [0.56, 3.96], "pairs": [0.7, 1.72, 3.3], "n": 3})
    narrow = _point_doc({"median": 1.24, "ci": [1.02, 1.50], "pairs": [1.1, 1.24, 1.4], "n": 3})
    narrow["mtpm"] = 32768
    report = _report(tmp_path, {"0": base, "1": wide, "2": narrow})
    (answer,) = [line for line in report.splitlines() if line.startswith("- FSDP2:")]
    assert answer.startswith("- FSDP2: set mtpm=32,768"), answer
    assert "ties with mtpm=16,384 (balanced, packed) (95% intervals overlap): chosen for its interval above 1" in answer
