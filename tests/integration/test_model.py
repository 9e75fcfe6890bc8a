"""The harness runs a local checkpoint end to end (python -m harness)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.model.build import build_model
from backends.specs import ModelSpec
from tests.conftest import load_json, run_harness
from tests.integration.test_harness_cli import _one_error_line
from tests.unit.test_checkpoint import checkpoint_copy, llama_checkpoint

CPU = torch.device("cpu")


def test_harness_runs_a_local_checkpoint(tmp_path):
    build_model(ModelSpec(lora_rank=0), CPU, False).save_pretrained(tmp_path / "ckpt")
    run_dir = tmp_path / "run"
    proc = run_harness(
        "model=qwen3_5_35b_a3b",
        f"model.path={tmp_path / 'ckpt'}",
        "workload=smoke",
        "backend=pytorch",
        "bench.warmup=0",
        "bench.repeat=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = load_json(run_dir / "results.json")
    assert res["status"] == "ok" and res["model"]["path"] == str(tmp_path / "ckpt")
    load = res["load"]  # how the weights were loaded and what it cost
    assert load["method"] == "from_pretrained" and load["elapsed_s"] > 0
    assert len(load["host_peak_bytes"]) == 1 and load["host_peak_bytes"][0] > 0 and load["device_peak_bytes"] is None


# ---------------------------------------------------------------- a row is what ran


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_model(ModelSpec(lora_rank=0), CPU, False).save_pretrained(path)
    return path


QUICK = ["workload=smoke", "bench.warmup=0", "bench.repeat=1", "logger=none"]


def _model_args(path: Path, *extra: str, backend: str = "pytorch") -> list[str]:
    return ["model=qwen3_5_35b_a3b", f"model.path={path}", f"backend={backend}", *QUICK, *extra]


@pytest.mark.parametrize("backend", ["pytorch", "fsdp2"])
def test_a_checkpoint_missing_layers_is_refused_before_any_process_starts(saved, tmp_path, backend):
    """Config 6 layers, weights 4: layers 4-5 would run random and the row say ok. One line, exit 2, nothing started."""
    path = checkpoint_copy(saved, tmp_path, layers=6)
    proc = run_harness(*_model_args(path, backend=backend), f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error_line(proc)
    assert (
        "model.path" in line
        and "missing" in line
        and "model.layers.4." in line
        and "allow_missing_weights=true" in line
    )
    assert "starting" not in proc.stdout + proc.stderr  # refused before the backend (and its ranks) started
    res = load_json(tmp_path / "run" / "results.json")
    assert res["status"] == "error" and "model.layers.4." in res["error"]


def test_allowed_missing_weights_are_measured_and_listed_in_results_json(saved, tmp_path):
    path = checkpoint_copy(saved, tmp_path, layers=6)
    run = tmp_path / "run"
    proc = run_harness(*_model_args(path, "model.allow_missing_weights=true"), f"hydra.run.dir={run}",
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    built = load_json(run / "results.json")["model"]["built"]
    assert built["n_layers"] == 6 and built["unexpected_weights"] == []
    assert built["missing_weights"] and all(
        k.startswith(("model.layers.4.", "model.layers.5.")) for k in built["missing_weights"]
    )
    assert "allow_missing_weights=true: measured anyway" in proc.stdout + proc.stderr  # and the log says so


def test_a_corrupt_config_json_or_safetensors_is_one_line_naming_the_file(saved, tmp_path):
    bad_config = checkpoint_copy(saved, tmp_path / "a")
    text = (bad_config / "config.json").read_text()
    (bad_config / "config.json").write_text(text[: len(text) // 2])
    for mode in ("dry_run=true", "dry_run=false"):  # a dry run reads config.json for its cost model
        proc = run_harness(
            *_model_args(bad_config, mode), f"hydra.run.dir={tmp_path / ('a-' + mode.replace('=', '-'))}", cwd=tmp_path
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = _one_error_line(proc)
        assert str(bad_config / "config.json") in line and "not valid JSON" in line
    bad_weights = checkpoint_copy(saved, tmp_path / "b")
    data = (bad_weights / "model.safetensors").read_bytes()
    (bad_weights / "model.safetensors").write_bytes(data[: len(data) // 2])
    proc = run_harness(*_model_args(bad_weights), f"hydra.run.dir={tmp_path / 'b-run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error_line(proc)
    assert str(bad_weights / "model.safetensors") in line and "did not finish" in line


def test_packed_layout_on_a_llama_checkpoint_is_refused_before_loading(tmp_path):
    path = llama_checkpoint(tmp_path / "llama")
    for mode in ("dry_run=true", "dry_run=false"):
        proc = run_harness(
            "model.path=" + str(path),
            "backend=pytorch",
            *QUICK,
            "layout=packed",
            "planner=balanced",
            "mtpm=4096",
            mode,
            f"hydra.run.dir={tmp_path / mode.replace('=', '-')}",
            cwd=tmp_path,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = _one_error_line(proc)
        assert "layout: packed" in line and "'llama'" in line and "qwen3_5_moe" in line and "layout=padded" in line
        assert "starting" not in proc.stdout + proc.stderr


def test_vocab_size_with_a_checkpoint_is_refused(saved, tmp_path):
    for mode in ("dry_run=true", "dry_run=false"):
        proc = run_harness(
            *_model_args(saved, "model.vocab_size=4096", mode),
            f"hydra.run.dir={tmp_path / mode.replace('=', '-')}",
            cwd=tmp_path,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = _one_error_line(proc)
        assert "model.vocab_size" in line and "tiny model" in line and "2048" in line
