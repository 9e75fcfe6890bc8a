"""scripts/gpu_check.sh's CPU form as a real run: one hot FSDP2 on 2 CPU ranks, bf16, padded against packed on the
same backend, four examples, no pairing. Everything is written under a scratch folder; at most 8 files come back to
$OUT, none in a folder: summary.json at the top says what it checked and what ran, the rest is in one tarball."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

from tests.conftest import REPO, harness_env


def test_the_cpu_form_checks_padded_against_packed_in_bf16_and_brings_back_eight_files_at_most(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    env = harness_env(OUT=str(out), GPU_CHECK_SCRATCH=str(scratch), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--only", "bf16", "--backends", "fsdp2",
                           "--examples", "4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr + "".join(p.read_text() for p in scratch.glob("*.log"))
    assert proc.returncode == 0, log
    back = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir()) and len(back) <= 8, back  # nothing in a folder
    assert back == ["bf16.log", "gpu_check.log", "gpu_check_rest.tar.gz", "summary.json"], back
    assert "read" in proc.stdout.splitlines()[-1] and "summary.json" in proc.stdout.splitlines()[-1]
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
    # the rest in the tarball: no sweep report, no mbs=1 baseline, no pairing: the two points the step asked for
    with tarfile.open(out / "gpu_check_rest.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./runs/bf16/0/results.json", "./runs/bf16/1/results.json", "./conf/gpu_check/bf16.fsdp2.packed.yaml"
            } <= names and "./runs/bf16/2" not in names and "./runs/bf16/report.md" not in names
    top = {n for n in names if n.count("/") == 1}
    assert not any(n.endswith(".log") or n == "./site" for n in top), top  # the logs came back on their own
