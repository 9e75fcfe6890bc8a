"""scripts/gpu_check.py without running a backend: its plan and estimates, the budget's skipping, the reading of
results.json (padded and packed keyed apart, tolerances by device and dtype, feature checks) and summary.json."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

# By the name the ranks import it under for its hooks (backend.hooks=scripts.gpu_check:...)
gpu_check = importlib.import_module("scripts.gpu_check")

KERNELS = {"attention": {"sdpa": 4}, "delta_rule": {"segment-scan": 3}, "short_conv": {"torch-conv1d": 3},
           "moe_experts": {"grouped_mm": 4}, "logprob_head": {"chunked-1024": 4}}
PRECISION = {"params": "bfloat16", "adapters": "float32", "compute": "bfloat16", "reduce": "float32"}
FEATURES = ("bf16", "fp32", "pytorch", "fsdp2", "megatron_ddp", "padded", "packed", "padded vs packed (same backend)",
            "backend.compile", "bench.profile", "bench.memory_snapshot (an induced OOM)", "mtpm=auto",
            "cost_model=calibrated", "collectives (gloo, 2 CPU ranks)")


def _point(sweep: Path, n: int, name: str, backend: str, layout: str, losses, grad_norm: float, status: str = "ok",
           dtype: str = "bfloat16", device: str = "cpu", **extra):
    """One point's folder as a gpu_check launch leaves it: results.json, outputs, Hydra's overrides."""
    folder = sweep / str(n)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(f"- +gpu_check={name}\n- hot=true\n")
    res = {"backend": backend, "status": status, "error": None if status == "ok" else "KeyError: 'x'",
           "world_size": 2, "layout": layout, "plan": {"layout": layout}, "device": {"type": device},
           "passes": {"forward_backward": {"tok_per_s": 1.0, "kernels": KERNELS}},
           "model": {"built": {"dtype": dtype}}, "precision": PRECISION, **extra}
    (folder / "results.json").write_text(json.dumps(res))
    if losses is not None:
        (folder / "example_outputs.json").write_text(
            json.dumps({"forward_backward": {"loss": losses, "grad_norm": grad_norm}}))
    return folder


def test_the_cuda_plan_lists_every_feature_within_five_minutes_on_one_gpu_over_two_runs(capsys):
    """The default run (bf16 and the features) and the second (--only fp32,compile) each fit 300 s with slack, with
    Triton's compile and autotune counted once per dtype and layout at its sourced figure."""
    assert gpu_check.main(["--plan", "--device", "cuda"]) == 0
    printed = capsys.readouterr().out
    target = gpu_check.Target("cuda", 1)
    steps = gpu_check.plan(target)
    rows = gpu_check.estimates(steps, target)
    second = gpu_check.estimates(gpu_check.select(steps, "fp32,compile"), target, "fp32,compile")
    covered = {c for row in rows + second for c in row["covers"]}
    assert set(FEATURES) <= covered, set(FEATURES) - covered
    assert [r["step"] for r in rows if "skipped" in r] == ["fp32", "compile"]
    assert all(r["skipped"] == gpu_check.NOT_DEFAULT and r["estimate_s"] == 0 for r in rows if "skipped" in r)
    total = sum(r["estimate_s"] for r in rows)
    assert 0 < total <= 270 and f"{total:.0f} s  (--budget-s 300)" in printed  # 10% of the budget left
    assert 0 < sum(r["estimate_s"] for r in second) <= 270 and "skipped" not in str(second)
    for row in rows:  # each step printed with its estimate and the parts it adds up, or why it does not run
        assert (f"{row['step']:<10} {row['estimate_s']:6.0f} s" in printed
                or f"{row['step']:<10}  not run: {row.get('skipped')}" in printed)
    # fla's Triton kernels are paid once per dtype and layout: bf16 both, then nothing; fp32 packed in the second
    triton = gpu_check.COSTS["cuda"]["triton"]
    assert triton >= 60 and {r["step"]: r["parts_s"].get("triton", 0) for r in rows} == {
        "bf16": 2 * triton, "fp32": 0, "features": 0, "compile": 0}
    assert second[0]["parts_s"]["triton"] == triton


def test_a_plan_under_a_small_budget_lists_the_steps_it_would_skip(capsys):
    """--plan spends --budget-s as the run does: a step whose estimate exceeds what is left is not run, and the total
    counts only the steps that would run."""
    assert gpu_check.main(["--plan", "--device", "cpu", "--budget-s", "70"]) == 0
    printed = capsys.readouterr().out
    rows = gpu_check.estimates(gpu_check.plan(gpu_check.Target("cpu", 1)), gpu_check.Target("cpu", 1))
    runs = [r for r in rows if "skipped" not in r]
    first = runs[0]["estimate_s"]
    assert first <= 70 < first + runs[1]["estimate_s"]  # the first step fits, the second no longer does
    assert f"{runs[0]['step']:<10} {first:6.0f} s" in printed
    for row in runs[1:]:
        assert f"{row['step']:<10}  not run: estimated {row['estimate_s']:.0f} s" in printed
    assert f"{first:6.0f} s  (--budget-s 70)" in printed


def test_the_cpu_plan_has_no_cuda_only_step_and_the_35b_variant_plans_the_published_model():
    rows = gpu_check.estimates(gpu_check.plan(gpu_check.Target("cpu")), gpu_check.Target("cpu"))
    assert [r["step"] for r in rows if "skipped" not in r] == ["bf16", "features", "fp32"]  # by value
    assert "no CPU form" in next(r for r in rows if r["step"] == "compile")["skipped"]
    assert not any("oom" in p for r in rows for p in r["points"])  # the allocator's history is CUDA's
    big = gpu_check.Target("cuda", 8, "/models/Qwen3.5-35B-A3B")
    steps = gpu_check.plan(big)
    assert {s.name for s in steps} == {"bf16", "features", "compile"}
    assert not any(p.settings.get("backend") == "pytorch" for s in steps for p in s.points)
    args = gpu_check.launch_args(steps[0], Path("/o"), big, None)
    assert {"model=qwen3_5_35b_a3b", "model.path=/models/Qwen3.5-35B-A3B", "gc=true", "workload=smoke",
            "bench.paired=false", "bench.baseline=false", "hot=true"} <= set(args)
    assert 600 < sum(r["estimate_s"] for r in gpu_check.estimates(steps, big)) < gpu_check.BIG_MODEL_BUDGET_S


def test_a_budget_too_small_skips_every_step_with_its_reason_and_runs_nothing(tmp_path, monkeypatch):
    launched = []  # 20 s: not even bf16's shortest form (the in-process backend alone, 21 s) fits
    monkeypatch.setattr(gpu_check, "harness", lambda *a, **k: launched.append(a) or (0, 0.0))
    assert gpu_check.main(["--device", "cpu", "--budget-s", "20", "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert launched == [] and summary["ok"] is False
    assert {"ok", "device", "budget_s", "plan", "tolerances", "environment", "steps", "covered", "not_covered",
            "wall_s"} <= set(summary)
    assert [r["step"] for r in summary["plan"]] == list(summary["steps"]) and summary["budget_s"] == 20
    assert summary["steps"]["bf16"]["status"] == "skipped"
    assert "left of --budget-s" in summary["steps"]["bf16"]["reason"]
    assert "no CPU form" in summary["steps"]["compile"]["reason"]
    assert any(line.startswith("step bf16: estimated") for line in summary["not_covered"])


def test_a_step_that_fits_runs_and_the_next_is_skipped_once_the_budget_is_spent(tmp_path, monkeypatch):
    now = [0.0]

    def fake(cmd, timeout, log, env):  # a launch that spends 60 s and leaves no point behind
        log.write_text("ran\n")
        now[0] += 60.0
        return 0, 60.0

    monkeypatch.setattr(gpu_check, "harness", fake)
    target = gpu_check.Target("cpu")
    steps = gpu_check.plan(target)
    rows = gpu_check.estimates(steps, target)
    summary: dict = {"steps": {}}
    budget = rows[0]["estimate_s"] + 1  # the first step fits; after its 60 s the second does not, nor its shorter forms
    gpu_check.run_steps(steps, rows, target, tmp_path, budget, None, summary, lambda: None, clock=lambda: now[0])
    first, second = summary["steps"]["bf16"], summary["steps"]["features"]
    assert first["status"] == "failed" and first["points"]["bf16.fsdp2.packed"] == {"status": "not reached"}
    assert first["cap_s"] <= budget and second["status"] == "skipped" and "left of --budget-s" in second["reason"]
    written = (tmp_path / "conf" / "gpu_check" / "bf16.fsdp2.packed.yaml").read_text()
    assert "override /backend: fsdp2" in written and 'layout: "packed"' in written and "dtype:" in written


def test_padded_and_packed_of_one_backend_are_keyed_apart_and_compared(tmp_path):
    """Both layouts of fsdp2 in one sweep stay two points: the packed one never replaces the padded reference."""
    _point(tmp_path, 0, "bf16.fsdp2.padded", "fsdp2", "padded", [2.0, 3.0], 1.0)
    _point(tmp_path, 1, "bf16.fsdp2.packed", "fsdp2", "packed", [2.0 * 1.02, 3.0], 1.2)
    runs = gpu_check.runs_in(tmp_path)
    assert set(runs) == {"bf16.fsdp2.padded", "bf16.fsdp2.packed"}
    step = gpu_check.Step("bf16", [], [], [("bf16.fsdp2.packed", "bf16.fsdp2.padded", "across")])
    entry = gpu_check.judge(step, runs)
    (cmp,) = entry["comparisons"]
    assert cmp["layouts"] == ["packed", "padded"] and cmp["rtol"] == gpu_check.BF16_RTOL
    assert cmp["max_rel_loss_diff"] == pytest.approx(0.02) and not cmp["judge_grad"]  # the losses decide
    assert entry["ok"]
    _point(tmp_path / "far", 0, "bf16.fsdp2.padded", "fsdp2", "padded", [2.0, 3.0], 1.0)
    _point(tmp_path / "far", 1, "bf16.fsdp2.packed", "fsdp2", "packed", [2.0 * 1.05, 3.0], 1.0)
    assert not gpu_check.judge(step, gpu_check.runs_in(tmp_path / "far"))["ok"]


def test_a_failed_or_missing_point_fails_its_comparison_with_the_reason(tmp_path):
    _point(tmp_path, 0, "fp32.fsdp2.padded", "fsdp2", "padded", [2.0], 1.0, dtype="float32")
    _point(tmp_path, 1, "fp32.fsdp2.packed", "fsdp2", "packed", None, 0.0, status="error", dtype="float32")
    step = gpu_check.Step("fp32", [], [gpu_check.Point("fp32.fsdp2.packed", {}, "x")],
                          [("fp32.fsdp2.packed", "fp32.fsdp2.padded", "across"),
                           ("fp32.megatron_ddp.padded", "fp32.fsdp2.padded", "same")])
    entry = gpu_check.judge(step, gpu_check.runs_in(tmp_path))
    assert not entry["ok"] and entry["failed_points"] == ["fp32.fsdp2.packed"]
    assert "no fwd+bwd outputs" in entry["comparisons"][0]["error"]
    assert entry["comparisons"][1]["error"] == "not run (run)"


@pytest.mark.parametrize("device,dtype,layouts,rtol", [
    ("cpu", "float32", ("packed", "padded"), 1e-4),
    ("cuda", "float32", ("padded", "padded"), 1e-3),
    ("cuda", "float32", ("packed", "padded"), 1e-2),  # TF32 inside fla, another blocking per layout
    ("cuda", "bfloat16", ("packed", "packed"), 3e-2),
])
def test_the_tolerance_follows_the_device_the_dtype_and_the_kernels(tmp_path, device, dtype, layouts, rtol):
    a = _point(tmp_path, 0, "a", "fsdp2", layouts[0], [1.0], 1.0, dtype=dtype, device=device)
    b = _point(tmp_path, 1, "b", "pytorch", layouts[1], [1.0], 1.0, dtype=dtype, device="cpu")
    runs = gpu_check.runs_in(tmp_path)
    kind = "same" if layouts[0] == layouts[1] else "across"
    assert a != b and gpu_check.judge_comparison(runs["a"], runs["b"], kind)["rtol"] == rtol


def test_summary_records_each_points_kernels_and_the_feature_checks(tmp_path):
    prof = _point(tmp_path, 0, "features.profile", "fsdp2", "packed", [1.0], 1.0,
                  passes={"forward_backward": {"kernels": KERNELS, "profile": {
                      "traces": ["profile/forward_backward-rank0.json.gz"], "slowdown": 1.5, "shares": {"idle": 1}}}})
    (prof / "profile").mkdir()
    (prof / "profile" / "forward_backward-rank0.json.gz").write_bytes(b"x" * 10)
    _point(tmp_path, 1, "features.oom_snapshot", "fsdp2", "packed", None, 0.0, status="oom",
           memory_snapshot=["memory/forward_backward-rank0.pickle"])
    _point(tmp_path, 2, "features.auto", "fsdp2", "packed", [1.0], 1.0, mtpm=2048,
           auto={"candidates": [{"mtpm": 2048, "status": "ok"}]})
    runs = gpu_check.runs_in(tmp_path)
    record = gpu_check.point_record(runs["features.profile"])
    assert record["kernels"] == {"forward_backward": KERNELS} and record["precision"] == PRECISION
    assert record["notes"] == []  # bf16 on CPU: grouped_mm is what ran
    fp32_cuda = _point(tmp_path, 3, "fp32.fsdp2.packed", "fsdp2", "packed", [1.0], 1.0, dtype="float32", device="cuda")
    (note,) = gpu_check.point_record(gpu_check.runs_in(fp32_cuda.parent)["fp32.fsdp2.packed"])["notes"]
    assert "grouped_mm in float32" in note and "per-expert fallback" in note  # torch's own, not its fused kernel
    profile = gpu_check.check_profile(runs["features.profile"], prof)
    assert profile["ok"] and profile["traces"] == {"profile/forward_backward-rank0.json.gz": 10}
    assert profile["shares_of"] == "host time"  # on CPU the whole story; on a GPU it says where the kernels are
    oom = gpu_check.check_oom_snapshot(runs["features.oom_snapshot"], tmp_path / "1")
    assert not oom["ok"] and oom["problems"] == ["no allocator history written"]  # status oom, but no file
    auto = gpu_check.check_auto(runs["features.auto"], tmp_path / "2")
    assert auto["ok"] and auto["chosen"] == 2048 and auto["candidates"][0]["status"] == "ok"


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    for argv in (["--only", "nosuch"], ["--backends", "fsdp3"], ["--model-path", "/models/x"],
                 ["--estimates-from", "/no/summary.json"]):
        assert gpu_check.main(["--plan", "--device", "cpu", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(argv[0])
    for argv in (["--budget-s", "0"], ["--estimate-scale", "0"]):
        with pytest.raises(SystemExit) as exc:
            gpu_check.main(argv)
        assert exc.value.code == 2
    for argv in (["--plan", "--gpus", "4"], ["--device", "cuda", "--gpus", "4"]):  # it plans for GPUs, runs none
        with pytest.raises(SystemExit) as exc:
            gpu_check.main(argv)
        assert exc.value.code == 2
        assert "--gpus: plans for that many GPUs with --plan --device cuda only" in capsys.readouterr().err


def test_an_import_that_fails_is_reported_with_its_error():
    assert gpu_check.try_import("json")["imported"]
    missing = gpu_check.try_import("no_such_kernel_package")
    assert not missing["imported"] and "ModuleNotFoundError" in missing["error"]


def test_without_wheels_or_packages_the_shell_stops_in_one_line_before_running_anything(tmp_path):
    """gpu_check.sh on a machine without .whl/ and with a bare Python (no site-packages: no torch, no hydra): one
    line naming what is missing and what to do, exit 2, and summary.json in $OUT saying so; the check itself never
    starts (it once printed "nvidia-smi: command not found" and a traceback)."""
    import os
    import shutil
    import subprocess
    import sys

    (tmp_path / "scripts").mkdir()
    shutil.copy(Path(gpu_check.REPO) / "scripts" / "gpu_check.sh", tmp_path / "scripts")  # a checkout with no .whl/
    bare = tmp_path / "python3"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # the interpreter without site-packages
    bare.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin", OUT=str(out), GPU_CHECK_SCRATCH=str(tmp_path / "s"))
    env.pop("PYTHON", None)
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_check.sh"), "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=60)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("gpu_check: missing torch,") and "hydra-core" in lines[0] and "no .whl/" in lines[0]
    assert "scripts/gpu_wheels.sh" in lines[0]
    assert json.loads((out / "summary.json").read_text()) == {"ok": False, "error": lines[0].split(": ", 1)[1]}
    assert not (tmp_path / "s" / "runs").exists()


def test_the_wheels_pin_every_runtime_import_at_the_tested_version_and_leave_torch_alone():
    """PINS_ONLY=1 prints what scripts/gpu_wheels.sh would download (nothing is): the closure of the harness's
    runtime imports at this venv's versions, peft's accelerate and huggingface-hub's own needs included."""
    import os
    import subprocess
    import sys
    from importlib import metadata

    script = Path(gpu_check.REPO) / "scripts" / "gpu_wheels.sh"
    proc = subprocess.run(["bash", str(script)], env=dict(os.environ, PINS_ONLY="1", PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pins = dict(line.split("==") for line in proc.stdout.split())
    for dist in ("transformers", "peft", "accelerate", "megatron-core", "hydra-core", "omegaconf",
                 "antlr4-python3-runtime", "huggingface-hub", "safetensors", "tokenizers"):
        assert pins[dist] == metadata.version(dist), dist
    from packaging.requirements import Requirement

    def needs(dist: str) -> set[str]:
        reqs = [Requirement(r) for r in metadata.requires(dist) or []]
        return {r.name.lower().replace("_", "-") for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})}

    # what the hub needs travels too (httpx2 and the like: the GPU image lacks them), unless torch brings it
    assert needs("huggingface-hub") - needs("torch") <= set(pins), needs("huggingface-hub") - set(pins)
    assert not {"torch", "numpy", "triton"} & set(pins)  # the GPU machine's CUDA torch and what it was built with
    lines = (Path(gpu_check.REPO) / "requirements" / "gpu.txt").read_text().splitlines()
    gpu = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert gpu and all(pins[p.split("==")[0]] == p.split("==")[1] for p in gpu)


def test_the_induced_out_of_memory_hooks_resolve_as_the_ranks_name_them_and_leave_a_cpu_pass_alone():
    import torch

    from backends.fsdp2 import FSDP2Hooks
    from backends.registry import import_path
    from backends.specs import BackendSpec

    hooks_class = import_path("scripts.gpu_check:FSDP2OutOfMemoryInTheWarmup")
    assert issubclass(hooks_class, FSDP2Hooks)
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    hooks_class(BackendSpec(name="fsdp2"), 0, 1, torch.device("cpu")).start_pass(model, "forward_backward")
    assert model.weight.grad is None  # FSDP2's own start of a fwd+bwd ran (gradients cleared), nothing raised


def test_estimates_known_to_be_half_the_truth_still_finish_within_the_budget_and_exit_0(tmp_path, monkeypatch):
    """Every estimate halved (--estimate-scale), each step really taking twice its halved estimate (a sleep, after
    its points' results are written): once bf16 has measured the ratio, fp32 no longer fits whole and runs shortened
    or is skipped, the run ends within --budget-s, exits 0 and lists what it skipped. Real processes and real time;
    the launch is a sleep in place of the harness."""
    seconds_per_unit = 0.006  # COSTS' CPU seconds to the real seconds of a step here (bf16: 61 units, 0.37 s)

    def command(step, out, target, examples):
        sweep = out / "runs" / step.name
        for n, p in enumerate(step.points):
            _point(sweep, n, p.name, p.settings["backend"], p.settings["layout"], [2.0, 3.0], 1.0,
                   dtype=p.settings["model.dtype"])
        return ["sleep", f"{sum(step.cost(target.costs, set()).values()) * seconds_per_unit:.3f}"]

    monkeypatch.setattr(gpu_check, "command", command)
    budget = 0.6  # bf16 (0.37 s) and the halved plan's fp32 (0.18 s) fit; fp32's real 0.37 s does not
    argv = ["--device", "cpu", "--only", "bf16,fp32", "--out", str(tmp_path), "--budget-s", str(budget),
            "--estimate-scale", str(seconds_per_unit / 2)]
    assert gpu_check.main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    bf16, fp32 = summary["steps"]["bf16"], summary["steps"]["fp32"]
    assert summary["ok"] and bf16["status"] == "passed" and 1.8 <= summary["timing"]["ratio"] < 3
    assert sum(s.get("wall_s", 0) for s in summary["steps"].values()) <= budget
    if fp32["status"] == "skipped":  # listed, with the measured ratio in its reason
        assert summary["skipped"] == ["fp32"] and "the measured ratio so far" in fp32["reason"] and fp32["ok"] is None
    else:  # fewer loads: the in-process backend only, or with fsdp2
        assert fp32["status"] == "passed" and len(fp32["shortened"]["points"]) < len(summary["plan"][1]["points"])
    assert summary["timing"]["measured"]["bf16"]["wall_s"] >= 2 * summary["plan"][0]["estimate_s"] * 0.95
    # the next run plans with what this one measured
    rows = gpu_check.estimates(gpu_check.select(gpu_check.plan(gpu_check.Target("cpu")), "bf16,fp32"),
                               gpu_check.Target("cpu"), "bf16,fp32")
    gpu_check.estimates_from(rows, tmp_path / "summary.json", "cpu")
    assert rows[0]["estimate_s"] == summary["timing"]["measured"]["bf16"]["wall_s"]
    assert "measured by" in rows[0]["estimate_from"]


def test_the_log_forwarder_stops_without_starting_a_thread():
    """Python 3.12 refuses to start a thread from an atexit handler ("can't create new thread at interpreter
    shutdown"), and the hot backend closes from one (harness/sweep/hot.py): stopping the workers' log forwarder there
    put a sentinel on the log queue, whose first put in this process starts the queue's feeder thread. Here starting
    a thread raises what 3.12 raises at shutdown; the records queued before the stop are still replayed."""
    import logging
    import multiprocessing as mp
    import threading

    from backends.runtime.spawned import _LogForwarder

    log_queue = mp.get_context("spawn").Queue()
    forwarder = _LogForwarder(log_queue)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("gpu_check_forwarder_test")
    logger.addHandler(Keep())
    logger.propagate = False
    # a rank's record, as a rank's put counts it and its feeder thread writes it
    from multiprocessing.reduction import ForkingPickler

    record = logging.LogRecord(logger.name, logging.WARNING, __file__, 1, "from a rank", None, None)
    log_queue._sem.acquire()
    log_queue._writer.send_bytes(bytes(ForkingPickler.dumps(record)))
    start = threading.Thread.start

    def refused(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    threading.Thread.start = refused
    try:
        forwarder.stop()
    finally:
        threading.Thread.start = start
    assert not forwarder.thread.is_alive() and seen == ["from a rank"]
    log_queue.close()


def test_what_comes_back_is_eight_files_at_most_and_the_logs_past_them_ride_in_the_results(tmp_path):
    """Four step logs and kernels.log: summary.json, the two archives and five logs come back as files; the last
    step's log goes into the results archive with every point's results.json and configs, never the traces."""
    import tarfile

    work, dest = tmp_path / "work", tmp_path / "out"
    for n, step in enumerate(["bf16", "features", "fp32", "compile"]):
        _point(work / "runs" / step, 0, f"{step}.fsdp2.packed", "fsdp2", "packed", [1.0], 1.0)
        (work / f"{step}.log").write_text(step)
        os.utime(work / f"{step}.log", (n, n))  # in the order the steps ran
    (work / "runs" / "bf16" / "0" / "profile.json.gz").write_bytes(b"t" * 1000)
    for name in ("summary.json", "gpu_check.log", "kernels.log"):
        (work / name).write_text("{}")
    dest.mkdir()
    (dest / "bf16.log").write_text("an earlier run's")
    (dest / ".gpu_check_results.tar.gz.tmp").write_text("a copy cut half-way")
    back = gpu_check.Back(work, dest)
    back.clear()
    names = back.ship(rest=True)
    assert len(names) == gpu_check.MAX_FILES and all(p.is_file() for p in dest.iterdir()), names
    assert set(names) == {"summary.json", "gpu_check.log", "kernels.log", "bf16.log", "features.log", "fp32.log",
                          gpu_check.RESULTS_TAR, gpu_check.REST_TAR}
    with tarfile.open(dest / gpu_check.RESULTS_TAR) as tar:
        results = set(tar.getnames())
    assert {"compile.log", "runs/bf16/0/results.json", "runs/bf16/0/.hydra/overrides.yaml"} <= results
    assert not any("profile" in n for n in results)
    with tarfile.open(dest / gpu_check.REST_TAR) as tar:
        rest = set(tar.getnames())
    assert "runs/bf16/0/profile.json.gz" in rest and not {"summary.json", "bf16.log"} & rest
