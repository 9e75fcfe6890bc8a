"""scripts/gpu_check.py's reading of results.json: packed vs padded agreement, kernels and precision copied per run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "gpu_check", Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
)
gpu_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_check)

KERNELS = {"attention": {"sdpa": 4}, "delta_rule": {"torch_segments": 3}, "short_conv": {"torch_segments": 3},
           "moe_experts": {"torch": 4}, "logprob_head": {"chunked": 4}}
PRECISION = {"params": "bfloat16", "adapters": "float32", "compute": "bfloat16", "reduce": "float32"}


def _point(sweep: Path, n: int, layout: str, losses, grad_norm: float, status: str = "ok", recorded: bool = True):
    folder = sweep / str(n)
    folder.mkdir(parents=True)
    passes = {"forward_backward": {"tok_per_s": 1.0, **({"kernels": KERNELS} if recorded else {})}}
    res = {"backend": "fsdp2", "status": status, "error": None if status == "ok" else "KeyError: 'linear_attention'",
           "world_size": 2, "layout": layout, "plan": {"layout": layout}, "passes": passes,
           "model": {"built": {"dtype": "bfloat16"}}, **({"precision": PRECISION} if recorded else {})}
    (folder / "results.json").write_text(json.dumps(res))
    if status == "ok":
        (folder / "example_outputs.json").write_text(
            json.dumps({"forward_backward": {"loss": losses, "grad_norm": grad_norm}})
        )


def test_bf16_packed_agrees_with_padded_within_its_tolerance_and_the_kernels_come_along(tmp_path):
    _point(tmp_path, 0, "padded", [2.0, 3.0], 1.0)
    _point(tmp_path, 1, "packed", [2.0 * 1.02, 3.0], 1.2)  # the gradient norm is reported, the losses decide
    entry = gpu_check.layouts_agree(tmp_path, gpu_check.BF16_RTOL)
    assert entry["ok"] and entry["packed_vs_padded"]["max_rel_loss_diff"] == pytest.approx(0.02)
    assert entry["layouts"]["packed"]["kernels"] == {"forward_backward": KERNELS}
    assert entry["layouts"]["packed"]["precision"] == PRECISION


def test_losses_past_the_tolerance_or_a_failed_packed_run_fail_the_check(tmp_path):
    _point(tmp_path / "a", 0, "padded", [2.0, 3.0], 1.0)
    _point(tmp_path / "a", 1, "packed", [2.0 * 1.05, 3.0], 1.0)
    assert not gpu_check.layouts_agree(tmp_path / "a", gpu_check.BF16_RTOL)["ok"]
    _point(tmp_path / "b", 0, "padded", [2.0, 3.0], 1.0)
    _point(tmp_path / "b", 1, "packed", None, 0.0, status="error")
    entry = gpu_check.layouts_agree(tmp_path / "b", gpu_check.BF16_RTOL)
    assert not entry["ok"] and "linear_attention" in entry["layouts"]["packed"]["error"]


def test_runs_without_kernel_or_precision_records_are_read_as_unknown(tmp_path):
    _point(tmp_path, 0, "padded", [2.0], 1.0, recorded=False)
    _point(tmp_path, 1, "packed", [2.0], 1.0, recorded=False)
    entry = gpu_check.layouts_agree(tmp_path, 1e-4)
    assert (
        entry["ok"]
        and entry["layouts"]["padded"]["kernels"] is None
        and entry["layouts"]["padded"]["precision"] is None
    )


def test_the_default_budget_fits_a_600_s_device_run_with_room_for_the_install():
    assert gpu_check.DEFAULT_BUDGET_S <= 450


def test_an_import_that_fails_is_reported_with_its_error():
    assert gpu_check.try_import("json")["imported"]
    missing = gpu_check.try_import("no_such_kernel_package")
    assert not missing["imported"] and "ModuleNotFoundError" in missing["error"]
