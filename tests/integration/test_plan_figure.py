"""The plan figure through the CLI: python -m reports plan draws a point, python -m reports links a figure per row."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.data.workload import mixed_lengths
from reports.plan_files import published_plans
from tests.conftest import REPO, run_cli
from tests.plan_docs import COST_MODEL, greedy_doc
from tests.unit.test_plan_figure import CASES

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


# In this tier: every case drawn and measured at two widths takes seconds (4-5 s on 2 cores).
def _texts_outside(fig) -> list[str]:
    """The drawn texts (title, subtitle, notes, legend, rank totals) that cross the figure's left or right edge."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = list(fig.texts) + [t for ax in fig.axes for t in ax.texts]
    texts += [t for legend in fig.legends for t in legend.get_texts()]
    out = []
    for t in texts:
        if not t.get_text():
            continue
        box = t.get_window_extent(renderer)
        if box.x0 < -0.5 or box.x1 > fig.bbox.x1 + 0.5:
            out.append(t.get_text())
    return out


LONG_SOURCE = {**COST_MODEL, "source": "backends/model_configs.py:qwen3_5_35b_a3b (checkpoint not on disk) from a very "
                                      "long path /mnt/checkpoints/some/team/qwen3.5-35b-a3b-instruct/config.json"}


@pytest.mark.parametrize("width_in", [13.0, 6.5])
def test_every_text_of_the_figure_fits_its_width(width_in):
    """Every case at the narrow width, where texts wrap most; at the report's width, the published plans (the longest
    texts) and the longest source line, with the wide figure's one-row legend."""
    import matplotlib.pyplot as plt

    from reports.plan_figure import plan_figure

    docs = [json.loads(p.read_text()) for p in published_plans(REPO / "reports" / "plans")]
    docs.append({**greedy_doc(LENGTHS, 4, 65536)[0], "cost_model": LONG_SOURCE})
    if width_in < 10:
        docs += [d for _, d, _ in CASES]
    for doc in docs:
        fig = plan_figure(doc, workload="seed_mixed_128", width_in=width_in)
        try:
            assert _texts_outside(fig) == [], (width_in, doc["layout"], doc["lockstep"])
        finally:
            plt.close(fig)
