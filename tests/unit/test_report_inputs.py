"""python -m reports in-process: a bad results.json, README or output path is one line (or a warning), and a row says only what its results.json records."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from reports.collect import collect
from tests.conftest import REPO

COMMITTED = REPO / "reports" / "results" / "cpu-2rank-tiny"


def _ok_doc() -> dict:
    return json.loads((COMMITTED / "0" / "results.json").read_text())


def _sweep(root: Path, docs: dict) -> Path:
    """A sweep folder with one point per entry: a dict is written as JSON, a string as it is."""
    for name, doc in docs.items():
        (root / name).mkdir(parents=True)
        (root / name / "results.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return root


BAD_DOCS = {
    "an array": "[]",
    "a string": '"ok"',
    "null": "null",
    "passes not an object": json.dumps({**_ok_doc(), "passes": [1, 2]}),
    "a pass not an object": json.dumps({**_ok_doc(), "passes": {"forward": 3}}),
    "plan not an object": json.dumps({**_ok_doc(), "plan": "greedy"}),
    "mtpm not a number": json.dumps({**_ok_doc(), "mtpm": "big"}),
    "tok/s not a number": json.dumps({**_ok_doc(), "passes": {"forward": {"tok_per_s": "fast"}}}),
    "torn": '{"status": "ok", "pas',
}


@pytest.mark.parametrize("text", BAD_DOCS.values(), ids=BAD_DOCS.keys())
def test_a_bad_results_json_is_a_warning_naming_it_and_the_others_are_reported(text, tmp_path, caplog):
    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc(), "1": text, "2": _ok_doc()})
    with caplog.at_level(logging.WARNING, logger="reports.collect"):
        df = collect([sweep])
    assert list(df["status"]).count("ok") == 2
    bad = df[df["status"] != "ok"]
    assert len(bad) == 1 and bad.iloc[0]["status"] == "unreadable"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(sweep / "1" / "results.json") in warnings[0]

    from reports.__main__ import main

    assert main([str(sweep)]) == 0  # the report is written around it
    report = (sweep / "report.md").read_text()
    assert report.count("| FSDP2") == 2 and "unreadable" in report


def test_the_end_of_sweep_report_is_written_despite_a_bad_results_json(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from harness import state
    from harness.callbacks import ReportCallback

    monkeypatch.setattr(state, "STATE", state.RunState())
    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc(), "1": "[]", "2": _ok_doc()})
    ReportCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert (sweep / "report.md").read_text().count("| FSDP2") == 2
    assert "unreadable" in (sweep / "results.csv").read_text()
    assert state.STATE.exit_code == state.EXIT_FAILED  # the sweep still says a point went wrong
