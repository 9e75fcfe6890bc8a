"""The plan figure: the numbers behind it are the plan's, it is drawn for every kind of plan, one CLI line draws it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.data.workload import mixed_lengths
from reports.plan_blocks import MAX_COLUMNS, kind_totals, plan_blocks, plan_layout
from reports.plan_figure import draw_plan, draw_side_by_side, figure_notes, readme_plan_lines
from reports.plan_files import published_plans
from tests.plan_docs import COST_MODEL, greedy_doc, plan_doc

PNG = b"\x89PNG\r\n\x1a\n"
LENGTHS = mixed_lengths(128, 64, 32768, 42)  # the published workload
A, B = COST_MODEL["a"], COST_MODEL["b"]


def cost(n: int) -> float:
    return A * n + B * n * n


def reference(doc: dict) -> dict:
    """What the plan costs, computed here straight from the plan.json format of reports/plan_json.py
    (independently of reports.plan_blocks)."""
    lengths, padded = doc["lengths"], doc["layout"] == "padded"
    def mb_cost(mb) -> float:
        if mb is None:
            return 0.0
        return len(mb) * cost(max(lengths[i] for i in mb)) if padded else sum(cost(lengths[i]) for i in mb)

    per_step = [[mb_cost(mb) for mb in sched] for sched in doc["schedules"]]
    rank_cost = [sum(row) for row in per_step]
    mean = sum(rank_cost) / len(rank_cost)
    if doc["lockstep"]:
        makespan = sum(max(row[s] for row in per_step) for s in range(len(per_step[0])))
    else:
        makespan = max(rank_cost)
    return {"rank_cost": rank_cost, "mean": mean, "makespan": makespan, "critical_path": makespan / mean}


# (name, doc, the original greedy planner's Plan or None): padded and packed, with and without dummies, 1 and 8 ranks.
def _cases():
    out = []
    doc, plan = greedy_doc(LENGTHS, 4, 65536)
    out.append(("greedy padded, 4 ranks, no dummies", doc, plan))
    doc, plan = greedy_doc(LENGTHS[:13], 8, 16384)
    out.append(("greedy padded, 8 ranks, dummies", doc, plan))
    doc, plan = greedy_doc(LENGTHS[:20], 1, 32768)
    out.append(("greedy padded, 1 rank", doc, plan))
    doc, plan = greedy_doc(LENGTHS, 8, 16384, lockstep=False)
    out.append(("greedy padded, 8 independent ranks", doc, plan))
    lengths = [5000, 3000, 3000, 2500, 1000, 800, 600, 100, 60]
    out.append(("packed by hand, 1 rank", plan_doc(lengths, [[[0, 8], [1, 2, 6], [3, 4, 5, 7]]], layout="packed",
                                                 planner="balanced", max_tokens=8192), None))
    out.append(("packed by hand, 8 ranks, dummies", plan_doc(lengths, _eight_rank_packed(), layout="packed",
                                                           planner="balanced", max_tokens=8192), None))
    out.append(("packed by hand, 8 independent ranks, nulls", plan_doc(lengths, _eight_rank_packed(), layout="packed",
                                                                     planner="balanced", max_tokens=8192,
                                                                     lockstep=False), None))
    return out


def _eight_rank_packed():
    # Every sequence exactly once; ranks 5-7 hold only dummies, ranks 1, 3, 4 one.
    return [[[0], [8]], [[1, 7], None], [[2], [6]], [[3, 5], None], [[4], None]] + [[None, None]] * 3


CASES = _cases()


@pytest.mark.parametrize("name,doc,plan", CASES, ids=[c[0] for c in CASES])
def test_totals_behind_the_figure_are_the_plans_numbers(name, doc, plan):
    pb = plan_blocks(doc)
    ref = reference(doc)
    lengths = doc["lengths"]
    scheduled = [i for sched in doc["schedules"] for mb in sched if mb for i in mb]
    assert sorted(scheduled) == list(range(len(lengths)))  # the cases are valid plans: every sequence once
    assert pb.real_tokens == sum(lengths)
    assert pb.n_sequences == len(lengths)
    assert pb.rank_cost == pytest.approx(ref["rank_cost"])
    assert pb.critical_path == pytest.approx(ref["critical_path"])
    if doc["layout"] == "packed":
        assert pb.padded_tokens == pb.real_tokens and pb.pad_efficiency == 1.0
        assert all(b.padding_tokens == 0 and b.padding_cost == 0 for row in pb.blocks for b in row)
    if plan is not None:  # the original greedy planner's own statistics
        st = plan.stats
        assert pb.real_tokens == st.real_tokens
        assert pb.padded_tokens == st.padded_tokens
        assert pb.pad_efficiency == pytest.approx(st.pad_efficiency)
        assert pb.rank_real_tokens == st.real_tokens_per_rank
        assert pb.rank_padded_tokens == st.padded_tokens_per_rank
        assert pb.n_microbatches == st.n_microbatches and pb.n_dummy == st.n_dummy

    # What is drawn: each kind's widths sum to its cost in units of the ideal pass (the
    # sequences' own cost spread evenly, no padding), and every row is as long as the
    # pass (lock-step: padded out with waiting), which is the critical path in mean-rank units.
    lay = plan_layout(pb)
    real_cost = sum(cost(n) for n in lengths)
    all_cost = sum(ref["rank_cost"])
    unit = real_cost / len(doc["schedules"])
    totals = kind_totals(lay)
    assert totals["real"] == pytest.approx(real_cost / unit)
    assert totals["padding"] == pytest.approx((all_cost - real_cost) / unit)
    assert totals["idle"] + totals["dummy"] == pytest.approx((pb.world_size * ref["makespan"] - all_cost) / unit)
    for rank in range(pb.world_size):
        row = sum(kind_totals(lay, [rank]).values())
        assert row == pytest.approx(ref["makespan"] / unit)
        assert row * unit / ref["mean"] == pytest.approx(ref["critical_path"])
    if doc["lockstep"]:
        for rank, row in enumerate(pb.blocks):
            dummy_width = sum(pb.step_cost[b.step] for b in row if b.dummy) / unit
            assert kind_totals(lay, [rank])["dummy"] == pytest.approx(dummy_width)
        assert (totals["dummy"] > 0) == any(pb.n_dummy)
    else:
        assert totals["dummy"] == 0  # independent ranks skip null entries: nothing to wait through


@pytest.mark.parametrize("name,doc,plan", CASES, ids=[c[0] for c in CASES])
def test_a_figure_is_drawn_for_every_kind_of_plan(name, doc, plan, tmp_path):
    png = draw_plan(doc, tmp_path / "plan.png")
    assert png.read_bytes()[:8] == PNG


def test_the_cases_cover_what_the_figure_must_handle():
    kinds = {(d["layout"], d["lockstep"], len(d["schedules"]), any(mb is None for s in d["schedules"] for mb in s))
             for _, d, _ in CASES}
    for layout in ("padded", "packed"):
        assert {(layout, True, 8, True), (layout, True, 1, False), (layout, False, 8, False) if layout == "padded"
                else (layout, False, 8, True)} <= kinds
    assert ("padded", True, 4, False) in kinds


def test_a_dummy_step_idles_the_whole_step_and_idle_is_the_wait_for_the_slowest_rank():
    doc = plan_doc([1000, 10, 10], [[[0]], [[1, 2]], [None]], cost_model={"a": 1.0, "b": 0.0, "source": "tokens"})
    pb = plan_blocks(doc)
    slow, fast, dummy = (row[0] for row in pb.blocks)
    assert (slow.cost, slow.idle_cost) == (1000, 0)
    assert (fast.real_tokens, fast.padding_tokens, fast.idle_cost) == (20, 0, 980)
    assert dummy.dummy and dummy.idle_cost == 1000
    assert pb.critical_path == pytest.approx(1000 / (1020 / 3))


def test_many_steps_are_grouped_and_the_figure_says_so(tmp_path):
    doc, plan = greedy_doc(mixed_lengths(3200, 64, 4096, 1), 8, 8192)
    pb = plan_blocks(doc)
    assert pb.world_size == 8 and pb.n_steps >= 100
    grouped, full = plan_layout(pb), plan_layout(pb, max_columns=10**6)
    assert grouped.group > 1 and len(grouped.columns) <= MAX_COLUMNS
    assert full.group == 1 and len(full.columns) == pb.n_steps
    for kind, width in kind_totals(full).items():  # grouping moves nothing between real, padding and waiting
        assert kind_totals(grouped)[kind] == pytest.approx(width)
    assert any(n.startswith("Aggregated") for n in figure_notes(pb, grouped))
    assert not any(n.startswith("Aggregated") for n in figure_notes(*_small()))
    assert draw_plan(doc, tmp_path / "big.png").read_bytes()[:8] == PNG


def _small():
    pb = plan_blocks(greedy_doc(LENGTHS, 4, 65536)[0])
    return pb, plan_layout(pb)


def test_an_invalid_plan_is_named():
    doc, _ = greedy_doc(LENGTHS[:8], 2, 65536)
    for change, words in [
        ({"schedules": None}, "'schedules'"),
        ({"layout": "zigzag"}, "'layout'"),
        ({"schedules": [[[0, 99]], [[1]]]}, "schedules[0][0]"),
        ({"schedules": [[[0], [1]], [[2]]]}, "'lockstep'"),
        ({"world_size": 3}, "'world_size'"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            plan_blocks({**doc, **change})


def test_readme_shows_published_plans_side_by_side(tmp_path):
    plans = tmp_path / "plans"
    for planner, layout in (("balanced", "packed"), ("greedy", "padded")):
        doc, _ = greedy_doc(LENGTHS, 4, 65536, layout=layout)
        (plans / f"{planner}-{layout}").mkdir(parents=True)
        (plans / f"{planner}-{layout}" / "plan.json").write_text(json.dumps({**doc, "planner": planner}))
    found = published_plans(plans)
    # the original greedy planner's plan on the left
    assert [p.parent.name for p in found] == ["greedy-padded", "balanced-packed"]
    pngs = [tmp_path / "plots" / f"plan-{p.parent.name}.png" for p in found]
    lines = readme_plan_lines(pngs, found, tmp_path)
    images = [line for line in lines if line.startswith("<p>")]
    assert len(images) == 1 and images[0].count("<img") == 2
    assert images[0].index("plots/plan-greedy-padded.png") < images[0].index("plots/plan-balanced-packed.png")
    assert readme_plan_lines([], [], tmp_path) == []
    assert [png.read_bytes()[:8] for png in draw_side_by_side(found, pngs)] == [PNG, PNG]
    assert math.isfinite(plan_blocks(json.loads(found[0].read_text())).critical_path)


def _plan_point(tmp_path, name: str = "point"):
    doc, _ = greedy_doc(LENGTHS[:24], 2, 16384)
    point = tmp_path / name
    point.mkdir()
    (point / "plan.json").write_text(json.dumps(doc))
    return point


def _plan_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from reports.__main__ import main

    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out.strip(), err.strip()


def test_plan_out_folder_or_bare_name_writes_the_png_it_prints(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    point = _plan_point(tmp_path, "3")
    (tmp_path / "figs").mkdir()
    for out, written in [
        ("figs", tmp_path / "figs" / "plan-3.png"),  # an existing folder: the point's name, as the report's plots/
        ("new/", tmp_path / "new" / "plan-3.png"),  # a trailing slash: a folder, made
        ("noext", tmp_path / "noext.png"),  # no extension: .png appended
        ("Shot.PNG", tmp_path / "Shot.PNG"),
    ]:
        rc, printed, err = _plan_cli(capsys, str(point), "-o", out)
        assert rc == 0, err
        assert Path(printed).resolve() == written.resolve() and written.read_bytes()[:8] == PNG, (out, printed)
    assert not (tmp_path / "figs.png").exists() and not (tmp_path / "figs" / "plan.png").exists()
    rc, printed, _ = _plan_cli(capsys, str(point / "plan.json"), "-o", "figs")
    assert rc == 0 and Path(printed).resolve() == (tmp_path / "figs" / "plan-3.png").resolve()


def test_plan_out_of_another_format_or_unwritable_is_one_line(tmp_path, capsys):
    point = _plan_point(tmp_path)
    for out, words in [
        (tmp_path / "out.txt", "only .png"),
        (tmp_path / "out.pdf", "only .png"),
        (Path("/proc/x.png"), "cannot write"),
        (Path("/proc/nope/x.png"), "cannot write"),
    ]:
        rc, printed, err = _plan_cli(capsys, str(point), "-o", str(out))
        assert rc == 2 and printed == "", (out, printed)
        assert err.count("\n") == 0 and err.startswith("error: ") and str(out) in err and words in err, err
        assert not out.exists()


@pytest.mark.parametrize("version", [2, 0, "1", None, True], ids=["2", "0", "'1'", "missing", "true"])
def test_a_plan_json_of_another_version_is_one_line_naming_the_versions_read(version, tmp_path, capsys):
    from reports.plan_json import PLAN_JSON_VERSION

    doc, _ = greedy_doc(LENGTHS[:24], 2, 16384)
    doc = {**doc, "version": version} if version is not None else {k: v for k, v in doc.items() if k != "version"}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    rc, printed, err = _plan_cli(capsys, str(path))
    assert rc == 2 and printed == "" and not (tmp_path / "plan.png").exists()
    assert err.count("\n") == 0 and str(path) in err and "'version'" in err, err
    assert f"this code reads version {PLAN_JSON_VERSION}" in err, err
