"""Batching as one concept (harness/app/batching.py): one key list, presets named for what they run, and knobs that
never override each other silently, composed in-process as python -m harness composes them."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from harness.app.batching import BACKEND_FIELDS, KEYS, is_batching_key
from tests.conftest import CONF, REPO, compose_config, config_error


def _resolved(*overrides: str):
    from harness.app.config import resolve_config

    return resolve_config(compose_config("dry_run=true", *overrides))


# -- what the user types runs, and is recorded --------------------------------------------------------------------
@pytest.mark.parametrize("overrides, ran", [
    (["batching=greedy_padded16384"], (16384, 1, "greedy", "padded")),  # the preset's name says what it runs
    (["mtpm=16384"], (16384, 1, "balanced", "packed")),  # a bare budget: the default planner, said in the record
    (["mtpm=16384", "batching=greedy_padded16384"], (16384, 1, "greedy", "padded")),  # agreeing with a preset
    (["mtpm=16384", "batching=greedy_padded"], (16384, 1, "greedy", "padded")),  # a preset of planner and layout
    (["batching=fixed_mbs2"], (None, 2, "greedy", "padded")),
    (["mtpm=null", "mbs=1", "batching=fixed_mbs1"], (None, 1, "greedy", "padded")),
    (["mtpm=16384", "mbs=1"], (16384, 1, "balanced", "packed")),  # mbs=1 is what a budget's point runs
])
def test_what_is_typed_is_what_runs_and_what_results_json_records(overrides, ran):
    from harness.point.results import base_document

    spec = _resolved(*overrides)
    b = spec.backend
    assert (b.max_tokens_per_microbatch, b.micro_batch_size, b.planner, b.layout) == ran
    assert (spec.mtpm, spec.mbs, spec.planner, spec.layout) == ran
    doc = base_document(compose_config("dry_run=true", *overrides), overrides)
    assert (doc["mtpm"], doc["mbs"], doc["planner"], doc["layout"]) == ran


@pytest.mark.parametrize("overrides, starts, names", [
    # a preset contradicting an explicit knob
    (["mtpm=4096", "batching=greedy_padded16384"], "mtpm: 4096 contradicts",
     ["batching=greedy_padded16384", "mtpm=16384"]),
    (["mtpm=16384", "batching=fixed_mbs1"], "mtpm: 16384 contradicts", ["batching=fixed_mbs1", "mtpm=null"]),
    (["planner=balanced", "batching=greedy_padded16384"], "planner: balanced contradicts",
     ["batching=greedy_padded16384", "planner=greedy"]),
    (["mbs=1", "batching=fixed_mbs2"], "mbs: 1 contradicts", ["batching=fixed_mbs2", "mbs=2"]),
    # mbs beside a budget would be ignored
    (["mbs=2", "mtpm=16384"], "mbs: 2 beside mtpm=16384 would be ignored", ["max_seqs_per_microbatch=2", "mtpm=null"]),
    (["mbs=2", "mtpm=auto"], "mbs: 2 beside mtpm=auto would be ignored", ["mtpm=null"]),
    (["mbs=2", "batching=balanced_packed16384"], "mbs: 2 beside mtpm=16384", ["max_seqs_per_microbatch=2"]),
    # a second spelling of a knob, which results.json and the report would not read
    (["backend.max_tokens_per_microbatch=4096"], "backend.max_tokens_per_microbatch: 4096 is a second spelling of mtpm",
     ["mtpm=null here", "set mtpm=4096"]),
    # the same value under both names: nothing to set instead, only the second spelling to drop
    (["mtpm=4096", "backend.max_tokens_per_microbatch=4096"],
     "backend.max_tokens_per_microbatch: a second spelling of mtpm, which is 4096 here already",
     ["drop backend.max_tokens_per_microbatch=4096"]),
    (["backend.micro_batch_size=2"], "backend.micro_batch_size: 2 is a second spelling of mbs", ["set mbs=2"]),
    (["backend.planner=greedy"], "backend.planner: greedy is a second spelling of planner", ["set planner=greedy"]),
    (["backend.max_seqs_per_microbatch=3"], "backend.max_seqs_per_microbatch: 3 is a second spelling",
     ["set max_seqs_per_microbatch=3"]),
    # the presets named for another planner than what runs are gone: their names are refused, listing the valid
    (["batching=mtpm16384"], "batching: 'mtpm16384' is not an option", ["greedy_padded16384", "balanced_packed16384"]),
])
def test_knobs_that_would_override_each_other_are_refused_in_one_line_naming_both(overrides, starts, names):
    line = config_error(*overrides)
    assert line is not None and "\n" not in line, line
    assert line.startswith(starts) and all(n in line for n in names), line


def test_a_workload_key_the_workload_does_not_read_is_still_refused():
    """The seventh row: workload.train_on on a generated workload (tests/unit/test_config.py has every such key)."""
    line = config_error("workload=smoke", "workload.train_on=all")
    assert line is not None and line.startswith("workload.train_on: ") and "\n" not in line, line


# -- presets named for what they run -------------------------------------------------------------------------------
# a sweep preset (# @package _global_: peers.yaml's planner list for the sweeper) sets no knob: tests/unit/test_peers.py
PRESETS = sorted(p for p in (CONF / "batching").glob("*.yaml") if not p.read_text().startswith("# @package"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_each_preset_names_itself_and_sets_only_knobs_and_runs_what_its_name_says(path):
    preset = yaml.safe_load(path.read_text())
    assert preset.pop("name") == path.stem
    assert set(preset) <= set(KEYS)
    spec = _resolved(f"batching={path.stem}")
    for key, value in preset.items():
        assert getattr(spec, key) == value
    if path.stem.startswith(("greedy_padded", "balanced_packed")):  # planner_layout[budget]
        planner, layout = path.stem.rstrip("0123456789").split("_")
        assert (spec.backend.planner, spec.backend.layout) == (planner, layout)
        budget = path.stem[len(planner) + len(layout) + 1:]
        assert spec.backend.max_tokens_per_microbatch == (int(budget) if budget else None)
    if path.stem.startswith("fixed_mbs"):
        assert spec.backend.max_tokens_per_microbatch is None
        assert spec.backend.micro_batch_size == int(path.stem.removeprefix("fixed_mbs"))


# -- one key list ------------------------------------------------------------------------------------------------
def test_the_config_and_the_backend_take_the_knobs_from_the_one_description():
    from backends.specs import BackendSpec
    from harness.app.config import HarnessConfig

    assert [f.name for f in fields(HarnessConfig)][:len(KEYS)] == list(KEYS)
    assert set(BACKEND_FIELDS.values()) <= {f.name for f in fields(BackendSpec)}
    assert all(is_batching_key(k) for k in ("mtpm", "batching", "backend.layout", "calibration.repeat"))
    assert not any(is_batching_key(k) for k in ("backend", "backend.name", "gc", "model.dtype", "bench.repeat"))


def _key_lists(path: Path) -> list[str]:
    """Literal collections (tuple, list, set, dict keys) in ``path`` that name the budget beside two other batching
    keys, in either spelling: a list of what is batching. A record of one setting's plan (planner and layout) or of
    the baseline's (mbs, planner, layout) names no budget."""
    names = set(KEYS) | set(BACKEND_FIELDS.values())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elts = node.elts
        elif isinstance(node, ast.Dict):
            elts = [k for k in node.keys if k is not None]
        else:
            continue
        named = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
        if named & {"mtpm", BACKEND_FIELDS["mtpm"]} and len(named) >= 3:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {sorted(named)}")
    return found


def test_the_batching_keys_are_listed_in_harness_batching_alone():
    """The sweeper, hot switching, plan sharing, results.json and the config read harness/app/batching.py's list; no
    other module lists them, and no config file spells them out (harness/conf/batching/ presets set values, which is
    their job). backends/ keeps its own spelling (the planner's parameters and the pass command: backends know nothing
    of the harness); reports/ lays out results.json's columns."""
    sources = [p for root in ("harness", "hydra_plugins") for p in sorted((REPO / root).rglob("*.py"))
               if p != REPO / "harness" / "app" / "batching.py"]
    assert len(sources) > 10
    listed = [hit for path in sources for hit in _key_lists(path)]
    assert listed == [], listed
    names = set(KEYS) | set(BACKEND_FIELDS.values())
    for path in [CONF / "config.yaml", *sorted((CONF / "backend").glob("*.yaml"))]:
        doc = yaml.safe_load(path.read_text()) or {}
        spelled = names & (set(doc) | set(doc.get("backend") or {}))
        assert not spelled, f"{path.relative_to(REPO)} sets {sorted(spelled)}: harness/app/batching.py says them"


def test_the_scan_finds_a_key_list(tmp_path, monkeypatch):
    """The scan above can fail: the list points.py once held is found."""
    monkeypatch.setattr("tests.unit.test_batching.REPO", tmp_path)
    listed = tmp_path / "points.py"
    listed.write_text('KEYS = ("mtpm", "mbs", "planner", "layout")\nPLAN = {"planner": 1, "layout": 2}\n')
    assert _key_lists(listed) == ["points.py:1 ['layout', 'mbs', 'mtpm', 'planner']"]


def test_backend_files_say_only_what_differs():
    for path in sorted((CONF / "backend").glob("*.yaml")):
        assert yaml.safe_load(path.read_text()) == {"name": path.stem}
    spec = _resolved("backend=megatron_ddp", "gc=true", "world_size=2", "bench.memory_limit_gb=3", "mtpm=512")
    b = spec.backend
    assert (b.name, b.gradient_checkpointing, b.world_size, b.memory_limit_gb) == ("megatron_ddp", True, 2, 3.0)
    assert b.max_tokens_per_microbatch == 512


def test_the_clis_backend_defaults_are_backendspecs():
    from backends.specs import BackendSpec

    got, default = _resolved().backend, BackendSpec()
    for f in fields(BackendSpec):
        if f.name != "name":  # the CLI's default backend is fsdp2; BackendSpec's, pytorch, needs no processes
            assert getattr(got, f.name) == getattr(default, f.name), f.name


# -- a preset that sweeps: batching=peers runs every planner, or is refused ------------------------------------------
def _with_hydra(*overrides: str):
    """The composed config with its hydra node (its sweep, its overrides), as Hydra hands it to a callback."""
    from hydra import compose, initialize_config_dir

    from harness.app.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_a_sweep_list_holding_peers_runs_every_planner_it_sweeps():
    """-m batching=peers,greedy_padded once ran 2 points: the preset's planner list is Hydra's only when the preset is
    the primary config's, so each of its jobs is expanded as that sweep (here with the sweeper's own parser)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.balance_batch_sweeper.point_sweeper import expand_swept_presets

    parser = OverridesParser.create()
    split = lambda job: BasicSweeper.split_arguments(parser.parse_overrides(job), None)[0]  # noqa: E731
    planners = yaml.safe_load((CONF / "batching" / "peers.yaml").read_text())["hydra"]["sweeper"]["params"]
    planners = planners["planner"].split(",")
    jobs = expand_swept_presets([["batching=peers", "mtpm=4096"], ["batching=greedy_padded", "mtpm=4096"],
                                 ["batching=peers", "mtpm=4096", "planner=fairseq"]], lambda j: _with_hydra(*j), split)
    assert jobs == [["batching=peers", "mtpm=4096", f"planner={p}"] for p in planners] + [
        ["batching=greedy_padded", "mtpm=4096"], ["batching=peers", "mtpm=4096", "planner=fairseq"]]
    assert len(planners) == 9


@pytest.mark.parametrize("overrides, refused", [
    (["batching=peers", "mtpm=4096"], True),  # ran the default planner alone, saying nothing
    (["batching=peers", "mtpm=4096", "planner=verl"], False),  # one planner of the list, as typed
    (["batching=greedy_padded", "mtpm=4096"], False),
    (["experiment=seed_b200", "backend=fsdp2", "mtpm=32768"], False),  # sweeps a preset, not a knob: docs/gpus.md
])
def test_a_single_run_of_a_preset_that_sweeps_a_knob_is_refused_in_one_line(overrides, refused):
    from harness.app.callbacks import SingleRunCallback
    from harness.app.cli import StartRefused

    config = _with_hydra(*overrides)
    if not refused:
        SingleRunCallback().on_run_start(config)
        return
    with pytest.raises(StartRefused) as single:
        SingleRunCallback().on_run_start(config)
    line = str(single.value)
    assert line.startswith("planner: batching=peers sweeps it over greedy,balanced,verl,") and "\n" not in line
    assert line.endswith("add -m to run them all, or set planner=<one of them> for one point"), line
    config.hydra.job.name = "serve"  # python -m harness.serve: a server runs one planner, and -m is no advice
    with pytest.raises(StartRefused, match="and a server runs one: set planner=<one of them>$"):
        SingleRunCallback().on_run_start(config)
