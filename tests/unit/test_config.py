"""Config mistakes, presets and the W&B sweep grids, composed in-process as python -m harness composes them.

The CLI's own contract (one line, exit 2) is run as a real process for one value and one choice in
tests/integration/test_harness_cli.py; here every refused value is checked through the same composition
and validation the CLI runs (tests/conftest.py's compose_config / config_error).
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.conftest import compose_config, config_error
from tests.unit.test_sweeps import SWEEP_FILES, grid_points


@pytest.mark.parametrize(
    "override, key, valid",
    [
        ("mtpm=-1", "mtpm", "positive integer, null (fixed mbs slices) or auto"),
        ("mtpm=0", "mtpm", "positive integer, null (fixed mbs slices) or auto"),
        ("mtpm=1.5", "mtpm", "positive integer, null (fixed mbs slices) or auto (search), got 1.5"),
        ("mtpm=abc", "mtpm", "positive integer, null (fixed mbs slices) or auto (search), got 'abc'"),
        ("mbs=0", "mbs", "positive integer"),
        ("backend=nccl_magic", "backend", "pytorch"),
        ("model=gpt5", "model", "tiny"),
        ("workload=huge", "workload", "smoke"),
        ("workload.n_examples=0", "workload.n_examples", "positive integer"),
        ("mtmp=1000", "mtmp", "not a config key"),
        ("layout=zigzag", "layout", "valid: padded, packed"),
        ("planner=magic", "planner", "valid: greedy, balanced"),
        ("planner=balanced", "planner", "mtpm"),  # mtpm is null here: fixed slices have no budget to balance
        ("max_seqs_per_microbatch=0", "max_seqs_per_microbatch", "positive integer or null"),
        ("max_seqs_per_microbatch=true", "max_seqs_per_microbatch", "Integer"),  # a bool is not a count
        ("token_seed=-1", "token_seed", ">= 0"),
        ("workload.seed=-1", "workload.seed", "0..4294967295"),
        ("backend.logprob_chunk_tokens=0", "backend.logprob_chunk_tokens", "positive integer or null"),
        ("backend.startup_timeout_s=0", "backend.startup_timeout_s", "positive number of seconds or null"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(override, key, valid):
    line = config_error("dry_run=true", override)
    assert line is not None and "\n" not in line, line
    assert key in line and valid in line, line


@pytest.mark.parametrize("override, line_starts, valid", [
    ("+zzz=3", "zzz: not a config key", "valid at the top level: mtpm, "),
    ("+bench.x=1", "bench.x: not a config key", "valid under bench: warmup, repeat, "),
    ("+model.foo=1", "model.foo: not a config key", "valid under model: name, path, "),
])
def test_a_key_added_with_plus_that_the_schema_lacks_is_refused_naming_it(override, line_starts, valid):
    """``+key=value`` adds a key Hydra's schema check lets through and the run would never read."""
    line = config_error("dry_run=true", override)
    assert line is not None and "\n" not in line, line
    assert line.startswith(line_starts) and valid in line, line


def test_a_thread_count_or_a_logger_mode_that_would_be_ignored_is_one_line_naming_it(monkeypatch):
    """OMP_NUM_THREADS=abc or 0 (torch would take its own count) and logger.mode=bogus (a 4-line warning from W&B's
    settings, then exit 0) are refused before anything runs."""
    for value in ("abc", "0"):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        line = config_error("dry_run=true")
        assert line is not None and line.startswith(f"OMP_NUM_THREADS: '{value}' is not a positive integer"), line
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert config_error("dry_run=true") is None
    line = config_error("dry_run=true", "logger.mode=bogus")
    assert line == ("logger.mode: 'bogus' is not a W&B mode (valid: online, offline, disabled; its default follows "
                    "WANDB_MODE)"), line
    assert config_error("dry_run=true", "logger=none") is None


def test_the_defaults_are_valid():
    assert config_error() is None


@pytest.mark.parametrize("sweep_file", SWEEP_FILES, ids=lambda p: p.stem)
def test_every_grid_point_is_accepted_by_hydra(sweep_file):
    """Each point of each W&B sweep file, as its agent would pass it (name=value), composes and validates."""
    import yaml

    spec = yaml.safe_load(sweep_file.read_text())
    command = [part for part in spec["command"] if part != "${env}"]
    assert command[:3] == ["python", "-m", "harness"] and "${args_no_hyphens}" in command, spec["command"]
    fixed = [part for part in command[3:] if part != "${args_no_hyphens}"]
    for point in grid_points(spec):
        args = [*fixed, *(f"{k}={v}" for k, v in point.items())]
        cfg = compose_config(*args)
        job = OmegaConf.to_container(cfg, resolve=False)
        assert config_error(composed=cfg) is None, args
        if "mtpm" in point:
            assert job["backend"]["max_tokens_per_microbatch"] == "${mtpm}" and job["mtpm"] == point["mtpm"]
        ran = OmegaConf.to_container(cfg, resolve=True)  # a preset's knobs follow it (harness/app/batching.py)
        if "batching" in point and point["batching"].startswith("greedy_padded"):
            assert ran["mtpm"] == int(point["batching"][len("greedy_padded"):])
        if "batching" in point and point["batching"].startswith("fixed_mbs"):
            assert ran["mtpm"] is None and ran["mbs"] == int(point["batching"][9:])
        assert job["logger"]["mode"] == "online"


def test_a_value_with_a_comma_is_one_line_that_keeps_hydras_advice():
    line = config_error("dry_run=true", "workload=dataset", "workload.path=/data/a,b.jsonl")
    assert "\n" not in line and line.startswith("workload.path: the value /data/a,b.jsonl has a comma"), line
    assert "\"workload.path='/data/a,b.jsonl'\"" in line and "add -m" in line, line
    # the quoted form the line offers is one string
    assert compose_config("workload=dataset", "workload.path='/data/a,b.jsonl'").workload.path == "/data/a,b.jsonl"


@pytest.mark.parametrize("overrides, key, users", [
    (["workload.train_on=all"], "workload.train_on: all", "only workloads of kind dataset do"),
    (["workload=cpu_chat", "workload.train_on=bogus"], "workload.train_on: bogus", "only workloads of kind dataset"),
    (["workload=smoke", "workload.format=text"], "workload.format: text", "only workloads of kind dataset"),
    (["workload=lengths_file", "workload.path={lengths}", "workload.min_len=5"], "workload.min_len: 5",
     "only workloads of kind mixed or chat do"),
    (["workload=lengths_file", "workload.path={lengths}", "workload.max_len=100"], "workload.max_len: 100",
     "only workloads of kind mixed or chat do"),
    (["workload=smoke", "workload.truncate_to=100"], "workload.truncate_to: 100", "only workloads of kind dataset do"),
    (["workload=dataset", "workload.path={lengths}", "workload.min_len=16"], "workload.min_len: 16",
     "only workloads of kind mixed or chat do"),
])
def test_a_workload_key_the_workload_does_not_read_is_refused_not_recorded(tmp_path, overrides, key, users):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n200\n")
    line = config_error("dry_run=true", *(o.format(lengths=lengths) for o in overrides))
    assert line is not None and "\n" not in line, line
    assert line.startswith(key + " is set, but workload ") and users in line, line
    kept = [o.format(lengths=lengths) for o in overrides[:-1]]  # the same workload without the key: accepted
    assert config_error("dry_run=true", *kept) is None or kept[0] == "workload=dataset"


def test_the_token_seed_on_a_dataset_is_refused_as_ignored_and_its_default_accepted(tmp_path):
    """``token_seed`` seeds generated token ids; a dataset's ids are its text's (its draw is workload.seed's)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n')
    dataset = ["dry_run=true", "workload=dataset", f"workload.path={rows}", "workload.format=text"]
    line = config_error(*dataset, "token_seed=5")
    assert line is not None and "\n" not in line, line
    assert line.startswith("token_seed: 5 seeds generated token ids") and "would be ignored" in line, line
    assert not (config_error(*dataset, "token_seed=0") or "").startswith("token_seed:")  # the default
    assert config_error("dry_run=true", "workload=smoke", "token_seed=5") is None  # generated ids read it


def test_the_old_spellings_of_the_token_seed_and_the_truncation_length_are_refused_naming_the_new(tmp_path):
    """``seed`` became ``token_seed``, a dataset's ``workload.max_len`` became ``workload.truncate_to``: the old
    spelling is one line naming the new one (tests/unit/test_dataset.py truncates with the new one)."""
    for typed in ("seed=3", "+seed=3"):  # added with +, it would be kept and do nothing
        line = config_error("dry_run=true", typed)
        assert line == ("seed: renamed token_seed (it seeds the generated token ids; workload.seed draws lengths or "
                        "examples, model.init_seed the weights)"), line
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n')
    line = config_error("dry_run=true", "workload=dataset", f"workload.path={rows}", "workload.max_len=64")
    assert line is not None and "\n" not in line, line
    assert line.startswith("workload.max_len: renamed workload.truncate_to for a dataset") and line.endswith(
        "workload.truncate_to=64"), line
