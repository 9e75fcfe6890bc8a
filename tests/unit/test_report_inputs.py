"""python -m reports in-process: a bad results.json, README or output path is one line (or a warning), and a row says
only what its results.json records."""

from __future__ import annotations

import io
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
    """A sweep folder with one point per entry: a dict is written as JSON, a string or bytes as they are."""
    for name, doc in docs.items():
        (root / name).mkdir(parents=True)
        out = root / name / "results.json"
        if isinstance(doc, bytes):
            out.write_bytes(doc)
        else:
            out.write_text(doc if isinstance(doc, str) else json.dumps(doc))
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
    "status not a string": json.dumps({**_ok_doc(), "status": ["ok"]}),
    "peaks not a list": json.dumps({**_ok_doc(), "passes": {"forward": {"mem_peak_bytes": 5}}}),
    "workload size not a number": json.dumps({**_ok_doc(), "workload": {"name": "w", "n_examples": "24"}}),
    "kernels not lists": json.dumps({**_ok_doc(), "passes": {"forward_backward": {"kernels": {"attention": 3}}}}),
    "torn": '{"status": "ok", "pas',
    "not UTF-8": b'{"status": "\xff"}',
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

    assert main([str(sweep), "--no-plots"]) == 0  # the report is written around it (figures: the torn-file test's)
    report = (sweep / "report.md").read_text()
    assert report.count("| FSDP2") == 2 and "unreadable" in report


def test_the_end_of_sweep_report_is_written_despite_a_bad_results_json(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from harness.app import state
    from harness.app.callbacks import ReportCallback

    monkeypatch.setattr(state, "STATE", state.RunState())
    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc(), "1": "[]", "2": _ok_doc()})
    ReportCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert (sweep / "report.md").read_text().count("| FSDP2") == 2
    assert "unreadable" in (sweep / "results.csv").read_text()
    assert state.STATE.exit_code == state.EXIT_FAILED  # the sweep still says a point went wrong


def test_the_end_of_sweep_report_without_figures_when_asked_and_a_bad_setting_is_named(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from harness.app import state
    from harness.app.callbacks import ReportCallback
    from harness.app.config import composition_error_line

    monkeypatch.setattr(state, "STATE", state.RunState())
    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc(), "1": _ok_doc()})
    ReportCallback(plots=False).on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert (sweep / "report.md").read_text().count("| FSDP2") == 2 and not (sweep / "plots").exists()
    with pytest.raises(ValueError) as refused:
        ReportCallback(plots="maybe")
    # as Hydra raises it when it builds the callback from hydra.callbacks.report.plots=maybe: the line is the key's
    from hydra.errors import InstantiationException

    try:
        raise InstantiationException("Error in call to target 'harness.app.callbacks.ReportCallback':") \
            from refused.value
    except InstantiationException as exc:
        assert composition_error_line(exc) == "hydra.callbacks.report.plots: true or false, got 'maybe'"


def _one_line_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("check", [True, False], ids=["--check", "rewrite"])
def test_a_missing_readme_is_one_line_and_nothing_is_written(check, tmp_path, capsys):
    from reports.__main__ import main

    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc()})
    missing = tmp_path / "missing.md"
    assert main([str(sweep), "--readme", str(missing)] + (["--check"] if check else [])) == 2
    _one_line_error(capsys, str(missing), "no such file")
    assert not missing.exists() and not (sweep / "report.md").exists()
    assert main([str(sweep), "--readme", str(tmp_path)] + (["--check"] if check else [])) == 2  # a folder
    _one_line_error(capsys, str(tmp_path), "not a file")


def test_a_readme_block_without_its_figures_is_refused_in_one_line(tmp_path, capsys):
    from reports.__main__ import main

    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc()})
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    assert main([str(sweep), "--readme", str(readme), "--no-plots"]) == 2
    _one_line_error(capsys, "--no-plots", "--readme")
    assert readme.read_text() == "# x\n" and not (sweep / "report.md").exists()


@pytest.mark.parametrize("check", [True, False], ids=["--check", "rewrite"])
def test_a_readme_without_the_markers_says_which_to_add(check, tmp_path, capsys):
    from reports.__main__ import main
    from reports.render import BEGIN, END

    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc()})
    for text in ("# A project\n", f"# A project\n{END}\n{BEGIN}\n", f"# only one\n{BEGIN}\n"):
        readme = tmp_path / "NOMARK.md"
        readme.write_text(text)
        assert main([str(sweep), "--readme", str(readme)] + (["--check"] if check else [])) == 2
        err = _one_line_error(capsys, str(readme), BEGIN, END)
        assert "stale" not in err and "run:" not in err  # not a command that would fail in turn
        assert readme.read_text() == text and not (sweep / "report.md").exists()
    assert capsys.readouterr().out == ""


def test_unwritable_outputs_are_one_line(tmp_path, capsys, monkeypatch):
    from reports.__main__ import main

    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc()})
    assert main([str(sweep), "--csv", "/proc/frame.csv"]) == 2
    _one_line_error(capsys, "/proc/frame.csv", "cannot write")

    import reports.__main__ as cli

    def refuse(df, out_dir):
        raise PermissionError(13, "Permission denied", str(out_dir / "plots" / "tok_per_s.png"))

    monkeypatch.setattr(cli, "write_plots", refuse)  # a read-only sweep folder (tests may run as root)
    assert main([str(sweep)]) == 2
    _one_line_error(capsys, str(sweep / "plots" / "tok_per_s.png"), "cannot write", "Permission denied")


def test_csv_into_a_folder_writes_results_csv_there(tmp_path, capsys):
    from reports.__main__ import main

    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc()})
    (tmp_path / "frames").mkdir()
    assert main([str(sweep), "--csv", str(tmp_path / "frames")]) == 0
    assert (tmp_path / "frames" / "results.csv").read_text().startswith("path,")


def test_csv_paths_are_relative_to_its_folder_so_any_clone_writes_the_committed_file(tmp_path):
    from reports.render import write_csv

    df = collect([COMMITTED])
    committed = (REPO / "reports" / "results.csv").read_text()
    assert str(REPO) not in committed and "/work/" not in committed  # no machine's absolute paths
    out = tmp_path / "results.csv"
    write_csv(df, out, base=REPO / "reports")  # as python -m reports writes reports/results.csv, in this clone
    assert out.read_text() == committed
    import pandas as pd

    assert pd.read_csv(io.StringIO(committed))["path"].iloc[0] == "results/cpu-2rank-tiny/0/results.json"


def test_a_sweeps_csv_names_points_relative_to_it(tmp_path, capsys):
    import pandas as pd

    from reports.__main__ import main

    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc(), "1": _ok_doc()})
    assert main([str(sweep), "--no-plots"]) == 0
    assert sorted(pd.read_csv(sweep / "results.csv")["path"]) == ["0/results.json", "1/results.json"]
    elsewhere = tmp_path / "elsewhere" / "frame.csv"  # not above the results: their absolute paths
    assert main([str(sweep), "--csv", str(elsewhere), "--no-plots"]) == 0
    assert sorted(pd.read_csv(elsewhere)["path"]) == [str((sweep / n / "results.json").resolve()) for n in "01"]


def _failed_at_start(**changes) -> dict:
    """What harness/point/point.py's base_document leaves when a point fails before its backend reports the device."""
    doc = {
        "status": "error", "error": "rank 1 died while starting", "backend": "fsdp2", "world_size": None,
        "device": None, "model": {"name": "tiny", "path": None, "lora_rank": 32}, "mtpm": 65536, "mbs": 1,
        "layout": "packed", "planner": "balanced", "gc": False, "bench": {"warmup": 1, "repeat": 3},
        "workload": {"name": "cpu_mixed"}, "plan": None, "precision": None, "passes": {}, "peak": None,
        "overrides": ["mtpm=65536"], "started_at": "2026-12-01T09:38:24+00:00",
    }
    doc.update(changes)
    return doc


def _report(tmp_path, docs: dict) -> str:
    """report.md of a sweep of ``docs``, text only (--no-plots: the figures are the tests' that draw them)."""
    from reports.__main__ import main

    sweep = _sweep(tmp_path / "sweep", docs)
    assert main([str(sweep), "--no-plots"]) == 0
    report = (sweep / "report.md").read_text()
    assert ".png" not in report and not (sweep / "plots").exists()  # none drawn, none linked
    return report


def _header_and_rows(report: str, backend: str = "FSDP2") -> tuple[list[str], list[str]]:
    lines = report.splitlines()
    return ([line for line in lines if line.startswith(("Measured on", "Setting"))],
            [line for line in lines if line.startswith(f"| {backend}")])


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


UNKNOWN_WORDS = ("unknown", "?", "None", "nan")


def test_an_error_point_says_only_what_its_results_json_records(tmp_path):
    report = _report(tmp_path, {"0": _failed_at_start()})
    (header,), (row,) = _header_and_rows(report)
    assert header.startswith("Measured on model `tiny` (LoRA rank 32), workload `cpu_mixed`,"), header
    assert not any(w in header + row for w in UNKNOWN_WORDS), header + row
    assert _cells(row)[1] == "—"  # the devices column: nothing recorded, nothing claimed

    report = _report(tmp_path / "2", {"0": _failed_at_start(world_size=2)})
    (header,), (row,) = _header_and_rows(report)
    assert _cells(row)[1] == "2 ranks" and not any(w in header + row for w in UNKNOWN_WORDS)

    gpu = {"type": "cuda", "name": "NVIDIA H200", "count": 8}
    report = _report(tmp_path / "3", {"0": _failed_at_start(world_size=8, device=gpu)})
    (header,), (row,) = _header_and_rows(report)
    # what the ranks talk over is the devices': the header is the hardware, shared with a one-process backend's rows
    assert header.startswith("Measured on NVIDIA H200, model `tiny`") and _cells(row)[1] == "8 × NVIDIA H200 (NCCL)"


def test_an_unreadable_row_names_its_file_and_claims_nothing(tmp_path):
    report = _report(tmp_path, {"0": _ok_doc(), "1": "[]"})
    headers, _ = _header_and_rows(report)
    assert (
        headers[0].startswith(f"Measured on {_ok_doc()['device']['name']}") and headers[-1] == "Setting not recorded."
    )
    (row,) = [line for line in report.splitlines() if "unreadable" in line]
    assert "1/results.json" in row
    cells = _cells(row)
    assert not any(w in c for c in cells for w in UNKNOWN_WORDS) and "greedy" not in cells, row


def test_a_dry_run_row_says_it_was_not_timed(tmp_path):
    dry = {**_ok_doc(), "status": "planned", "passes": {}, "precision": None, "peak": None}
    report = _report(tmp_path, {"0": _ok_doc(), "1": dry})
    headers, _ = _header_and_rows(report)
    measured, planned = sorted(headers, key=lambda h: "not timed" in h)
    assert "1 warm-up + 3 timed repeats" in measured
    assert "not timed (dry run)" in planned and "timed repeats" not in planned and "warm-up" not in planned


def test_a_settings_histogram_is_drawn_from_the_point_that_has_a_plan(tmp_path):
    """The setting's first point failed before planning (no plan.json): its histogram comes from the next point."""
    import shutil

    from reports.plots import length_histogram_paths, write_length_histograms

    failed = {**_ok_doc(), "status": "error", "error": "boom"}
    sweep = _sweep(tmp_path / "sweep", {"0": failed, "1": _ok_doc()})
    shutil.copy(COMMITTED / "0" / "plan.json", sweep / "1" / "plan.json")
    df = collect([sweep])
    assert df["setting"].nunique() == 1
    expected = sweep / "plots" / "lengths-1.png"
    assert length_histogram_paths(df, sweep) == [expected, expected]
    assert write_length_histograms(df, sweep) == [expected, expected] and expected.is_file()


def test_a_torn_results_json_beside_an_intact_plan_blames_only_itself_and_the_report_links_only_drawn_figures(
        tmp_path, caplog):
    import re
    import shutil

    from reports.__main__ import main

    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc(), "1": '{"status": "ok", "pas'})
    for name in "01":  # both points planned: their plan.json files are whole
        shutil.copy(COMMITTED / "0" / "plan.json", sweep / name / "plan.json")
    with caplog.at_level(logging.WARNING):
        assert main([str(sweep)]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings and all("plan.json" not in w for w in warnings), warnings
    assert any(str(sweep / "1" / "results.json") in w for w in warnings), warnings
    report = (sweep / "report.md").read_text()
    links = re.findall(r"\]\(([^)]+\.png)\)", report)
    assert links and all((sweep / link).is_file() for link in links), links


def test_a_report_of_several_sweeps_goes_to_its_own_folder_and_each_sweeps_point_has_its_own_figures(
        tmp_path, capsys):
    import re
    import shutil

    from reports.__main__ import main

    sweeps = [_sweep(tmp_path / name, {"0": _ok_doc()}) for name in ("A", "B")]
    for sweep in sweeps:
        shutil.copy(COMMITTED / "0" / "plan.json", sweep / "0" / "plan.json")
    assert main([str(sweeps[0]), "--no-plots"]) == 0  # A's own report, text only: the figures are the combined one's
    own = {f: (sweeps[0] / f).read_text() for f in ("report.md", "results.csv")}
    capsys.readouterr()
    assert main([str(s) for s in sweeps]) == 0
    assert {f: (sweeps[0] / f).read_text() for f in own} == own  # A's own report is left as it was
    combined = tmp_path / "combined-report"  # in the folder both sweeps lie in
    assert str(combined / "report.md") in capsys.readouterr().out  # and the command says where it went
    report = (combined / "report.md").read_text()
    assert report.count("| FSDP2") == 2 and (combined / "results.csv").is_file()
    links = re.findall(r"\]\(([^)]+\.png)\)", report)
    plans = [link for link in links if "/plan-" in link]
    assert sorted(plans) == ["plots/plan-A-0.png", "plots/plan-B-0.png"], links
    assert all((combined / link).is_file() for link in links), links


def test_a_point_that_failed_before_it_ran_says_what_it_was_asked_to_run_never_the_baseline(tmp_path):
    from harness.point.results import base_document
    from reports.render import table_frame
    from tests.conftest import compose_config

    def failed(status: str, *overrides: str) -> dict:  # what a point leaves when it fails before its backend reports
        doc = base_document(compose_config(*overrides), list(overrides))
        return {**doc, "status": status, "error": "failed at start" if status != "planned" else None,
                "process": None}

    docs = {"0": _ok_doc(),  # the real mbs=1 baseline
            "1": failed("error", "mtpm=auto"), "2": failed("oom", "mtpm=auto"), "3": failed("planned", "mtpm=auto"),
            "4": failed("error", "mtpm=4096"), "5": failed("error", "backend.max_tokens_per_microbatch=4096")}
    df = collect([_sweep(tmp_path / "sweep", docs)])
    frame = table_frame(df)
    rows = {Path(p).parent.name: r for p, r in zip(df["path"], frame.to_dict("records"))}
    assert (rows["0"]["mbs"], rows["0"]["mtpm"]) == ("1", "—")
    for name in "123":  # mtpm=auto, whatever became of it
        assert (rows[name]["mbs"], rows[name]["mtpm"]) == ("—", "auto"), rows[name]
    for name in "45":  # a budget defaults to the balanced planner's packed rows, however it is spelled
        assert (rows[name]["mtpm"], rows[name]["planner"], rows[name]["layout"]) == ("4,096", "balanced", "packed")
    assert [rows[n]["status"] for n in "12345"] == ["error", "OOM", "planned", "error", "error"]


def test_a_readme_beside_docs_results_gets_the_short_table_and_the_page_the_full_one(tmp_path, capsys):
    """--readme with a docs/results.md (markers in it) beside the README: the README's block is the answer and a short
    table linking to the page, the page's is every column; --check fails when either is stale, naming it."""
    from reports.__main__ import main
    from reports.render import BEGIN, COLUMNS, END, SHORT_COLUMNS

    budget = json.loads((COMMITTED / "3" / "results.json").read_text())
    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc(), "1": budget})
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    for path in (readme, page):
        path.write_text(f"# {path.stem}\n\n{BEGIN}\n{END}\n\nafter\n")
    assert main([str(sweep), "--readme", str(readme), "--check"]) == 1
    assert main([str(sweep), "--readme", str(readme)]) == 0
    short, full = readme.read_text(), page.read_text()
    assert all(c in short for c in SHORT_COLUMNS)
    assert "[docs/results.md](docs/results.md)" in short and "MFU (fwd+bwd)" not in short
    assert all(c in full for c in COLUMNS) and "- FSDP2: set" in full and full.endswith("after\n")
    capsys.readouterr()
    assert main([str(sweep), "--readme", str(readme), "--check"]) == 0
    page.write_text(full.replace("FSDP2", "FSDP3", 1))
    assert main([str(sweep), "--readme", str(readme), "--check"]) == 1
    out = capsys.readouterr().out
    assert str(page) in out and f"{readme}," not in out and "stale" in out


def test_the_length_histogram_names_the_truncation_length_of_new_and_old_results():
    """A dataset's truncation length is recorded as ``truncate_to``; results written before the rename say
    ``max_len``, and the report reads both."""
    from reports.plots import truncation_note

    assert truncation_note({"truncated": 3, "truncate_to": 1024}) == ", 3 truncated to 1,024"
    assert truncation_note({"truncated": 3, "max_len": 1024}) == ", 3 truncated to 1,024"
    assert truncation_note({"truncated": 0, "truncate_to": 1024}) == truncation_note({}) == ""


# -- a row is what ran ----------------------------------------------------------------------------------------------


def _point(n: int, **changes) -> dict:
    """The committed sweep's point ``n`` (0: FSDP2 mbs=1; 6: FSDP2 16k balanced packed), with ``changes``; ``planner``
    and ``layout`` also change what its plan records, ``ranks`` its device count and world size."""
    doc = json.loads((COMMITTED / str(n) / "results.json").read_text())
    ranks = changes.pop("ranks", None)
    if ranks is not None:
        doc["world_size"] = ranks
        doc["device"] = {**doc["device"], "count": ranks}
    for key in ("planner", "layout"):
        if key in changes:
            doc["plan"] = {**doc["plan"], key: changes[key]}
    doc.update(changes)
    return doc


def _paired(median: float) -> dict:
    return {"pass_type": "forward_backward", "median": median, "ci": [median * 0.9, median * 1.1],
            "pairs": [median * 0.9, median, median * 1.1], "n": 3, "noisy": False}


def test_planners_side_by_side_one_table_per_devices_each_row_divided_by_its_own_balanced_row(tmp_path):
    """two world sizes at one budget are two tables (the devices named), and a balanced row reads 1.000."""
    from reports.side_by_side import side_by_side

    docs = {"0": _point(0), "1": _point(6, speedup=_paired(1.2)),
            "2": _point(6, planner="verl", speedup=_paired(0.6)),
            "3": _point(0, ranks=1), "4": _point(6, ranks=1, speedup=_paired(2.4)),
            "5": _point(6, ranks=1, planner="verl", speedup=_paired(1.2))}
    section = side_by_side(collect([_sweep(tmp_path / "sweep", docs)]))
    captions = [line for line in section.splitlines() if line.startswith("FSDP2")]
    assert [c.split(",")[0] for c in captions] == ["FSDP2 on 2 × CPU ranks (gloo)", "FSDP2 on 1 × CPU rank (gloo)"]
    ratios = [_cells(line)[-2] for line in section.splitlines() if line.startswith("| 16,384")]
    assert ratios == ["1.000", "0.500", "1.000", "0.500"], section


def test_a_combined_report_of_unpaired_sweeps_divides_each_row_by_its_own_sweeps_baseline(tmp_path):
    """sweep B's unpaired budget row reads B's own speedup in a report of A and B, not one over A's mbs=1."""
    from reports.render import speedups

    def sweep(name: str, base_tok: float, ratio: float) -> Path:
        base, budget = _point(0), _point(6)
        budget.pop("speedup", None)
        base["passes"]["forward_backward"]["tok_per_s"] = base_tok
        budget["passes"]["forward_backward"]["tok_per_s"] = base_tok * ratio
        return _sweep(tmp_path / name, {"0": base, "1": budget})

    df = collect([sweep("A", 10_000.0, 1.2), sweep("B", 8_000.0, 1.44)])
    assert df["setting"].nunique() == 1  # the same setting: the old report took A's mbs=1 row for both
    got = {(Path(p).parent.parent.name, m): s for p, m, s in zip(df["path"], df["mtpm"], speedups(df))}
    assert got[("A", 16384)] == pytest.approx(1.2) and got[("B", 16384)] == pytest.approx(1.44)


def test_a_users_readme_holds_its_own_results_and_figures_whose_lines_never_run_through_two_settings(
        tmp_path, monkeypatch):
    """A user's page: no plan figure of the repository's own, a hint that names the results; the figures of a sweep
    over model.dtype draw each precision's own lines, each legend entry once (one drawing for both: figures cost
    seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure

    from reports.__main__ import main
    from reports.plots import _groups
    from reports.render import BEGIN, END

    bf16 = {"params": "bfloat16", "adapters": "float32", "compute": "bfloat16", "reduce": "float32"}
    sweep = _sweep(tmp_path / "sweep", {"0": _point(0), "1": _point(6, speedup=_paired(1.2)),
                                        "2": _point(0, precision=bf16), "3": _point(6, precision=bf16)})
    df = collect([sweep])
    labels = [label for label, _ in _groups(df)]
    assert len(labels) == 2 and len(set(labels)) == 2 and any("bf16 params" in x for x in labels), labels
    shown: list = []
    real = matplotlib.figure.Figure.legend

    def legend(fig, handles, texts, *args, **kwargs):  # the tok/s figure's legend, as drawn
        shown.extend(texts)
        return real(fig, handles, texts, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "legend", legend)
    readme = tmp_path / "NOTES.md"
    readme.write_text(f"# notes\n\n{BEGIN}\n{END}\n")
    assert main([str(sweep), "--readme", str(readme)]) == 0
    assert len(shown) == 4 and len(set(shown)) == 4, shown  # each setting's mbs=1 line and budget line
    text = readme.read_text()
    assert "../" not in text and "plan-" not in text, text  # the repository's plans/ figures are its own pages'
    assert "<!-- generated by `python -m reports sweep --readme NOTES.md`;" in text
    assert main([str(tmp_path / "sweep"), "--readme", str(readme), "--check"]) == 0


def test_a_point_that_ran_out_of_memory_shows_no_peak_of_a_pass_it_finished_before(tmp_path):
    """fwd+bwd ran out; the forward pass's peak is not the row's peak."""
    from reports.render import short_frame, table_frame

    oom = _point(6, status="oom", error="out of memory in forward_backward on rank 0 (largest micro-batch 16,384 "
                 "padded tokens, bench.memory_limit_gb=0.3): CPU memory limit reached")
    oom.pop("speedup")
    oom["passes"] = {"forward": oom["passes"]["forward"]}
    assert max(oom["passes"]["forward"]["mem_peak_bytes"]) > 0
    df = collect([_sweep(tmp_path / "sweep", {"0": _point(0), "1": oom})])
    row = df[df["status"] == "oom"].index[0]
    full, short = table_frame(df).loc[row], short_frame(df).loc[row]
    assert (full["peak mem %"], full["peak mem per rank (GiB)"], short["peak GiB (largest rank)"]) == ("—",) * 3


def test_the_header_says_what_ranks_talk_over_only_where_they_do_and_p99_only_where_it_is_not_the_longest(tmp_path):
    """the PyTorch backend is one process (no "ranks on gloo"); p99 is the nearest-rank percentile."""
    from types import SimpleNamespace

    from harness.point.results import workload_record

    one = _point(0, backend="pytorch", ranks=1)
    report = _report(tmp_path, {"0": _point(0), "1": one})
    (header,), rows = _header_and_rows(report, "")
    assert "gloo" not in header and "p99" not in header  # 24 sequences: their p99 is the longest, shown as the range
    devices = sorted(_cells(r)[1] for r in rows if r.startswith(("| FSDP2", "| PyTorch")))
    assert devices == ["1 × CPU process", "2 × CPU ranks (gloo)"]
    spec = SimpleNamespace(name="w", seed=0, n_tokens=None)
    assert workload_record(spec, list(range(1, 25)))["p99_len"] == 24  # numpy's "lower" gave 23
    assert workload_record(spec, list(range(1, 1001)))["p99_len"] == 990


def test_refused_points_of_a_dry_run_sweep_are_rows_of_its_table_with_their_reasons(tmp_path):
    """one table headed as a dry run, the refusals' reasons under it, a contradiction's mbs shown."""
    planned = {**_point(6), "status": "planned", "passes": {}, "speedup": None}
    refused = _failed_at_start(mtpm=-5, error="mtpm: must be a positive integer, got -5",
                               overrides=["dry_run=true", "mtpm=-5"])
    both = _failed_at_start(mtpm=4096, mbs=2, error="mtpm: 4096 contradicts batching=fixed_mbs2, which sets "
                            "mtpm=null; drop one of the two", overrides=["dry_run=true", "batching=fixed_mbs2",
                                                                        "mtpm=4096"])
    report = _report(tmp_path, {"0": planned, "1": refused, "2": both})
    headers, rows = _header_and_rows(report)
    assert len(headers) == 1 and "not timed (dry run)" in headers[0] and "timed repeats" not in report
    assert len(rows) == 3
    (contradiction,) = [r for r in rows if "| 4,096" in r]
    assert _cells(contradiction)[2] == "2"  # mbs, as asked: the contradiction the reason names
    assert "- FSDP2 mtpm=-5 (balanced, packed) (`1`): error: mtpm: must be a positive integer, got -5" in report
    assert "- FSDP2 mbs=2 mtpm=4,096 (balanced, packed) (`2`): error: mtpm: 4096 contradicts" in report


def test_what_the_report_refuses_and_prints(tmp_path, capsys):
    """a combined report's folder of only /, multirun.yaml as a sweep, an unwritable --csv before any
    output; the terminal's short table names report.md and only what was written beside it; an all-OOM sweep draws
    no empty tok/s axes."""
    from backends.errors import UserError
    from reports.__main__ import main, report_folder
    from reports.plots import plot_paths
    from reports.render import SHORT_COLUMNS

    with pytest.raises(UserError, match="share no folder but /.*--out DIR"):
        report_folder([Path("/tmp/a/sweep"), Path("/var/b/sweep")])
    sweep = _sweep(tmp_path / "sweep", {"0": _point(0), "1": _point(6, speedup=_paired(1.2))})
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    assert main([str(sweep / "multirun.yaml")]) == 2
    _one_line_error(capsys, "multirun.yaml", "not a run or multirun folder")
    assert main([str(sweep), "--no-plots", "--csv", "/proc/x.csv"]) == 2
    assert capsys.readouterr().out == ""  # refused before the table is printed
    assert main([str(sweep), "--no-plots"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| backend"))
    assert _cells(header) == SHORT_COLUMNS and str(sweep / "report.md") in out
    assert "plots/" not in out and "Beside it: results.csv." in out
    oom = _point(6, status="oom", error="out of memory", passes={})
    df = collect([_sweep(tmp_path / "oom", {"0": oom})])
    assert plot_paths(tmp_path / "oom", df) == [tmp_path / "oom" / "plots" / "pad_efficiency.png"]


def test_the_end_of_sweep_callback_names_no_figures_it_did_not_draw(tmp_path, monkeypatch, capsys, caplog):
    from omegaconf import OmegaConf

    from harness.app import state
    from harness.app.callbacks import ReportCallback

    monkeypatch.setattr(state, "STATE", state.RunState())
    sweep = _sweep(tmp_path / "sweep", {"0": _ok_doc()})
    with caplog.at_level(logging.INFO):
        ReportCallback(plots=False).on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    said = capsys.readouterr().out + "\n".join(r.getMessage() for r in caplog.records)
    assert str(sweep / "report.md") in said and "plots" not in said, said
