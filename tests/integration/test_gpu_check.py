"""scripts/gpu_check.py's CPU form as a real run: one hot FSDP2 on 2 CPU ranks, bf16, padded against packed on the
same backend, four examples, no pairing; summary.json at the top of its folder says what it checked and what ran."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, harness_env


def test_the_cpu_form_checks_padded_against_packed_in_bf16_and_writes_its_summary_at_the_top(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--only", "bf16",
                           "--backends", "fsdp2", "--examples", "4", "--out", str(out)],
                          cwd=REPO, env=harness_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr + "".join(p.read_text() for p in out.glob("*.log"))
    assert proc.returncode == 0, log
    summary = json.loads((out / "summary.json").read_text())
    step = summary["steps"]["bf16"]
    assert summary["ok"] and step["status"] == "passed" and step["exit_code"] == 0, log
    (cmp,) = step["comparisons"]  # fsdp2's packed point against fsdp2's padded point, the losses within bf16's 3e-2
    assert (cmp["run"], cmp["ref"], cmp["layouts"]) == ("bf16.fsdp2.packed", "bf16.fsdp2.padded", ["packed", "padded"])
    assert cmp["agrees"] and cmp["rtol"] == 3e-2 and 0 <= cmp["max_rel_loss_diff"] <= 3e-2
    for name, point in step["points"].items():  # what ran, per point, with the kernels each pass recorded
        assert point["status"] == "ok" and point["backend"] == "fsdp2" and point["world_size"] == 2, name
        assert point["dtype"] == "bfloat16" and point["layout"] == name.rsplit(".", 1)[1]
        assert set(point["kernels"]) == {"forward", "forward_backward"} and point["precision"]["compute"] == "bfloat16"
    assert "fsdp2 x2 on cpu (gloo)" in summary["covered"]["collectives"]
    assert step["wall_s"] > 0 and summary["plan"][0]["estimate_s"] > 0
    # no sweep report, no mbs=1 baseline, no pairing: the two points the step asked for and nothing else
    assert sorted(p.name for p in (out / "runs" / "bf16").iterdir() if p.is_dir()) == ["0", "1"]
    assert not (out / "runs" / "bf16" / "report.md").exists()
