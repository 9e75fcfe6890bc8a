"""The harness runs a local checkpoint end to end (python -m harness)."""

from __future__ import annotations

import torch

from backends.model.build import build_model
from backends.specs import ModelSpec
from tests.conftest import load_json, run_harness

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
