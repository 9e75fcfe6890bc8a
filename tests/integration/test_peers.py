"""batching=peers end to end: a real multirun of two planners at one budget beside the same mbs=1 baseline, paired,
and the report's "planners side by side" table built from its results.json files."""

from __future__ import annotations

from reports.collect import collect
from reports.side_by_side import TITLE, side_by_side
from tests.conftest import run_harness, sweep_results


def test_the_peers_preset_measures_planners_in_pairs_beside_one_baseline_and_reports_them_side_by_side(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_harness("-m", "batching=peers", "mtpm=1024", "planner=balanced,fairseq", "backend=pytorch",
                       "workload=smoke", "workload.n_examples=6", "model.dtype=bfloat16", "hot=true",
                       "bench.paired=true", "bench.warmup=0", "bench.repeat=2", f"hydra.sweep.dir={sweep}",
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = sweep_results(sweep)
    assert [(r["mtpm"], r["planner"], r["layout"], r["status"]) for r in results] == [
        (None, "greedy", "padded", "ok"), (1024, "balanced", "packed", "ok"), (1024, "fairseq", "padded", "ok")]
    fairseq = results[2]
    assert fairseq["plan"]["peer"]["name"] == "fairseq" and fairseq["plan"]["peer"]["knobs"]["max_tokens"] == 1024
    assert all(len(r["speedup"]["pairs"]) == 2 for r in results[1:])  # each beside mbs=1 passes, in pairs

    section = side_by_side(collect([sweep]))
    assert section.startswith(TITLE) and section in (sweep / "report.md").read_text()  # the sweep's own report
    header, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
                        if line.startswith("|")]
    table = [dict(zip(header, row)) for row in rows]
    assert [(r["mtpm"], r["planner"]) for r in table] == [("1,024", "balanced"), ("1,024", "fairseq")]
    for r in table:  # a paired speedup with its interval, and its share of the balanced planner's
        # its interval by its bounds (reports/render.py), with its pairs
        assert "2 pairs" in r["speedup vs mbs=1"] and "95%" in r["speedup vs mbs=1"]
        assert r["speedup ÷ balanced's"] != "—" and r["steps / bound"] != "—"
    assert table[0]["speedup ÷ balanced's"] == "1.000"
