"""The plan figure through the CLI: python -m reports plan draws a point, python -m reports links a figure per row."""

from __future__ import annotations

import json
import shutil

from harness.data.workload import mixed_lengths
from tests.conftest import REPO, run_cli
from tests.plan_docs import greedy_doc

PNG = b"\x89PNG\r\n\x1a\n"
LENGTHS = mixed_lengths(128, 64, 32768, 42)  # the published workload


def test_cli_draws_a_point_folder_and_names_a_bad_path(tmp_path):
    doc, _ = greedy_doc(LENGTHS, 4, 65536)
    point = tmp_path / "point"
    point.mkdir()
    (point / "plan.json").write_text(json.dumps(doc))
    ok = run_cli("reports", "plan", str(point), "-o", str(tmp_path / "out.png"), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "out.png").read_bytes()[:8] == PNG
    default = run_cli("reports", "plan", str(point / "plan.json"), cwd=tmp_path)
    assert default.returncode == 0 and (point / "plan.png").read_bytes()[:8] == PNG

    (tmp_path / "torn.json").write_text('{"lengths": [1, 2')
    (tmp_path / "empty").mkdir()
    for bad, words in [
        (tmp_path / "nope", "no such file or folder"),
        (tmp_path / "empty", "no plan.json in this folder"),
        (tmp_path / "torn.json", "not a plan.json document"),
    ]:
        proc = run_cli("reports", "plan", str(bad), cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and str(bad) in proc.stderr and words in proc.stderr, proc.stderr


def test_report_links_a_plan_figure_per_row(tmp_path):
    """python -m reports DIR: plots/plan-<point>.png for each point with a plan.json, linked from its row."""
    committed = sorted((REPO / "reports" / "results").glob("*/*/results.json"))[:2]
    sweep = tmp_path / "sweep"
    for name, res in zip(("0", "1"), committed):
        (sweep / name).mkdir(parents=True)
        shutil.copy(res, sweep / name / "results.json")
    doc, _ = greedy_doc(LENGTHS[:24], 2, 16384)
    (sweep / "1" / "plan.json").write_text(json.dumps(doc))  # point 0 predates plan.json: no figure, no link
    proc = run_cli("reports", str(sweep), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "plots" / "plan-1.png").read_bytes()[:8] == PNG
    assert not (sweep / "plots" / "plan-0.png").exists()
    rows = [line for line in (sweep / "report.md").read_text().splitlines() if line.startswith("| FSDP2")]
    assert len(rows) == 2
    assert sum("[plan](plots/plan-1.png)" in r for r in rows) == 1
    assert "plan_png" not in (sweep / "results.csv").read_text()
