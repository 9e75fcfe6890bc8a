"""scripts/gpu_check.sh's CPU form as a real run: one hot FSDP2 on 2 CPU ranks, bf16 then fp32, padded against packed
on the same backend, four examples, no pairing, stopped by SIGTERM while fp32's ranks run, as an outer time limit
stops it. Everything is written under a scratch folder; after every step at most 8 files come back to $OUT, none in
a folder: summary.json at the top says what it checked, what ran and what was cut; the points' results and configs
are in a small archive, the rest in another."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

from tests.conftest import REPO, harness_env


def _ours(marker: str) -> dict[int, str]:
    """The live processes (zombies left out) whose environment carries ``marker``, with their command lines."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"GPU_CHECK_TEST_MARKER={marker}".encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def test_the_cpu_form_stopped_mid_step_returns_what_finished_and_leaves_no_rank_alive(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    marker = uuid.uuid4().hex
    env = harness_env(OUT=str(out), GPU_CHECK_SCRATCH=str(scratch), PYTHON=sys.executable,
                      GPU_CHECK_TEST_MARKER=marker)
    # an outer time limit, as a lent machine's: its SIGTERM is sent below, once fp32's ranks run
    proc = subprocess.Popen(["timeout", "-s", "TERM", "280", "bash", "scripts/gpu_check.sh", "--device", "cpu",
                             "--only", "bf16,fp32", "--backends", "fsdp2", "--examples", "4"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            running = (out / "summary.json").is_file() and json.loads(
                (out / "summary.json").read_text()).get("running") == "fp32"
            ranks = [c for c in _ours(marker).values() if "forkserver" in c]
            if running and len(ranks) >= 3:  # the fork server and fp32's two ranks
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)  # to timeout, which passes it on as at its limit
        stdout, stderr = proc.communicate(timeout=60)
        left = _ours(marker)
    finally:
        for pid in _ours(marker):  # nothing of this test outlives it, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log = stdout + stderr + "".join(p.read_text() for p in scratch.glob("*.log"))
    assert left == {}, (left, log)  # the harness, its fork server and the ranks ended with the check
    assert proc.returncode == 128 + signal.SIGTERM, log
    back = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir()) and len(back) <= 8, back  # nothing in a folder
    assert back == ["bf16.log", "fp32.log", "gpu_check.log", "gpu_check_rest.tar.gz", "gpu_check_results.tar.gz",
                    "summary.json"], back
    assert "read" in stdout.splitlines()[-1] and "summary.json" in stdout.splitlines()[-1]
    summary = json.loads((out / "summary.json").read_text())
    cut = summary["cut"]
    assert (cut["by"], cut["step"], cut["finished"]) == ("SIGTERM", "fp32", ["bf16"]), cut
    assert 0 < cut["group_stopped_in_s"] and "running" not in summary and summary["steps"]["fp32"]["status"] == (
        "cut by SIGTERM")
    assert summary["ok"] and summary["steps"]["fp32"]["ok"] is not False  # a cut is no failed check
    assert "SIGTERM: stopped the launch and its process group" in (out / "gpu_check.log").read_text()
    step = summary["steps"]["bf16"]
    assert step["status"] == "passed" and step["exit_code"] == 0, log
    (cmp,) = step["comparisons"]  # fsdp2's packed point against fsdp2's padded point, the losses within bf16's 3e-2
    assert (cmp["run"], cmp["ref"], cmp["layouts"]) == ("bf16.fsdp2.packed", "bf16.fsdp2.padded", ["packed", "padded"])
    assert cmp["agrees"] and cmp["rtol"] == 3e-2 and 0 <= cmp["max_rel_loss_diff"] <= 3e-2
    for name, point in step["points"].items():  # what ran, per point, with the kernels each pass recorded
        assert point["status"] == "ok" and point["backend"] == "fsdp2" and point["world_size"] == 2, name
        assert point["dtype"] == "bfloat16" and point["layout"] == name.rsplit(".", 1)[1]
        assert set(point["kernels"]) == {"forward", "forward_backward"} and point["precision"]["compute"] == "bfloat16"
    assert "fsdp2 x2 on cpu (gloo)" in summary["covered"]["collectives"]
    assert step["wall_s"] > 0 and summary["plan"][0]["estimate_s"] > 0
    assert summary["timing"]["measured"]["bf16"]["wall_s"] == step["wall_s"] and summary["timing"]["ratio"] > 0
    # the points' results and configs, apart and small: the two points bf16 asked for, no sweep report, no baseline
    assert (out / "gpu_check_results.tar.gz").stat().st_size < 1_000_000
    with tarfile.open(out / "gpu_check_results.tar.gz") as tar:
        results = set(tar.getnames())
    assert {"runs/bf16/0/results.json", "runs/bf16/1/results.json", "runs/bf16/0/.hydra/overrides.yaml",
            "conf/gpu_check/bf16.fsdp2.packed.yaml"} <= results and not any("bf16/2" in n for n in results)
    with tarfile.open(out / "gpu_check_rest.tar.gz") as tar:
        rest = set(tar.getnames())
    assert "runs/bf16/0/.hydra/hydra.yaml" in rest and "runs/bf16/report.md" not in rest
    assert not {n for n in rest if "/" not in n and (n.endswith(".log") or n == "summary.json")}  # came on their own


def test_the_plan_through_the_shell_installs_nothing_and_writes_nothing(tmp_path):
    """--plan prints the steps before anything is installed: a checkout whose .whl/ holds a wheel that cannot install
    still prints its plan, and no scratch folder or $OUT is made."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu_check.sh").write_text((REPO / "scripts" / "gpu_check.sh").read_text())
    (tmp_path / "scripts" / "gpu_check.py").symlink_to(REPO / "scripts" / "gpu_check.py")  # it finds the repo
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    env = harness_env(OUT=str(tmp_path / "out"), GPU_CHECK_SCRATCH=str(tmp_path / "scratch"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--plan", "--device", "cuda"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_check plan (cuda, 1 GPU(s)" in proc.stdout and "bf16" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("plan only: nothing installed, run or written")
    assert not (tmp_path / "scratch").exists() and not (tmp_path / "out").exists()
