"""python -m harness as a user runs it: results.json, dry runs, multiruns and one-line errors."""

from __future__ import annotations

import json
import math
import os

import pytest

from backends.model.configs import cost_model_for
from backends.specs import ModelSpec
from balance_batch import plan_step
from harness.data.workload import mixed_lengths
from harness.metrics.flops import training_flops_for
from tests.conftest import config_error, load_json, run_harness, sweep_results

FAST = ["workload=smoke", "backend=pytorch", "bench.warmup=0", "bench.repeat=2"]


def test_single_run_writes_results_json(workdir):
    run_dir = workdir / "run"
    # the original greedy padded planner: what a padded run records (its pads' FLOPs, the batch's SDPA)
    proc = run_harness(*FAST, "mtpm=600", "planner=greedy", "layout=padded", "bench.save_outputs=true",
                       f"hydra.run.dir={run_dir}", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = load_json(run_dir / "results.json")
    assert res["status"] == "ok" and res["error"] is None
    assert res["backend"] == "pytorch" and res["world_size"] == 1
    assert res["device"]["type"] == "cpu" and res["device"]["count"] == 1
    assert res["model"]["name"] == "tiny" and res["model"]["lora_rank"] == 32
    built = res["model"]["built"]  # what the backend reports it built, not the config's name
    # the precision that ran: one process (nothing reduced), float32 on CPU by default
    assert res["precision"] == {"params": "float32", "adapters": "float32", "compute": "float32", "reduce": None,
                                "grads": "float32"}
    assert built["architecture"] == "Qwen3_5MoeForCausalLM" and built["source"].startswith("random init")
    assert built["vocab_size"] == 2048 and built["dtype"] == "float32"
    assert 0 < built["n_trainable_params"] < built["n_params"]  # LoRA: only the adapters train
    assert (res["mtpm"], res["mbs"], res["gc"]) == (600, 1, False)
    assert res["bench"] == {"warmup": 0, "repeat": 2, "profile": False, "memory_snapshot": False, "paired": False,
                            "target_ci_pct": None, "max_repeats": 20}
    lengths = mixed_lengths(16, 64, 512, 42)
    assert res["workload"]["name"] == "smoke"
    assert res["workload"]["n_examples"] == 16
    assert res["workload"]["total_tokens"] == sum(lengths)
    assert (res["workload"]["min_len"], res["workload"]["max_len"]) == (min(lengths), max(lengths))
    assert (res["planner"], res["layout"]) == ("greedy", "padded")
    expected = plan_step(lengths, world_size=1, max_tokens_per_microbatch=600, layout="padded", planner="greedy",
                         lockstep=False, cost_model=cost_model_for(ModelSpec())).stats
    assert res["plan"]["n_microbatches"] == expected.n_microbatches
    assert res["plan"]["padded_tokens"] == expected.padded_tokens
    assert math.isclose(res["plan"]["pad_efficiency"], expected.pad_efficiency)
    for pass_type in ("forward", "forward_backward"):
        p = res["passes"][pass_type]
        assert len(p["elapsed_s"]) == 2 and all(t > 0 for t in p["elapsed_s"])
        assert math.isclose(p["tok_per_s"], sum(lengths) / (sum(p["elapsed_s"]) / 2), rel_tol=1e-9)
        assert 0 < p["util_pct"] <= 100
        assert 0 < p["mem_pct"] < 100
        assert len(p["mem_peak_bytes"]) == 1 and 100 * 1024**2 < p["mem_peak_bytes"][0] < res["device"]["memory_bytes"]
        # CPU: no allocator peaks, no NVML; the timed region is inside each call, the rest is host work
        assert p["mem_peak_allocated_bytes"] is None and p["mem_peak_reserved_bytes"] is None
        assert p["device_mem_used_bytes"] is None
        assert len(p["pass_wall_s"]) == len(p["host_s"]) == 2
        for elapsed, wall, host in zip(p["elapsed_s"], p["pass_wall_s"], p["host_s"]):
            assert elapsed < wall and math.isclose(elapsed + host, wall, rel_tol=1e-9)
        # MFU: the training FLOPs of the real sequences (LoRA: well under 3x forward) over the measured time and CPU
        # peak
        training = training_flops_for(ModelSpec())
        assert math.isclose(p["model_flops"], sum(training.sequence(pass_type, n) for n in lengths))
        if pass_type == "forward_backward":
            ratio = p["model_flops"] / res["passes"]["forward"]["model_flops"]
            assert 2.0 < ratio < 2.9, ratio
        # what ran: the padded batch's SDPA, the project's scan and conv, torch's grouped GEMM, the chunked head
        assert set(p["kernels"]) == {"attention", "delta_rule", "short_conv", "moe_experts", "logprob_head"}
        assert set(p["kernels"]["attention"]) == {"sdpa"} and set(p["kernels"]["delta_rule"]) == {"segment-scan"}
        assert p["hardware_flops"] > p["model_flops"]  # the padded layout computes its pads too
        mean_s = sum(p["elapsed_s"]) / 2
        assert math.isclose(p["mfu_pct"], 100 * p["model_flops"] / mean_s / res["peak"]["flops_per_device"])
        assert 0 < p["mfu_pct"] < 100
    outputs = load_json(run_dir / "example_outputs.json")
    assert len(outputs["forward"]["loss"]) == 16
    assert outputs["forward_backward"]["grad_norm"] > 0
    assert "micro-batch" in proc.stdout or "repeat 2/2" in proc.stdout  # progress is visible


def test_dry_run_of_the_seed_workload_plans_every_point(workdir):
    sweep = workdir / "sweep"
    budgets = [16384, 32768, 65536, 131072]
    proc = run_harness(
        "-m",
        "mtpm=" + ",".join(map(str, budgets)),
        "workload=seed_mixed_128",
        "backend=pytorch",
        "dry_run=true",
        f"hydra.sweep.dir={sweep}",
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sweep_results(sweep)
    lengths = mixed_lengths(128, 64, 32768, 42)
    assert [r["mtpm"] for r in results] == budgets
    for r, budget in zip(results, budgets):
        assert r["status"] == "planned"
        assert r["workload"]["total_tokens"] == 1_669_550
        assert r["plan"] == plan_step(lengths, world_size=1, max_tokens_per_microbatch=budget, layout="packed",
                                      planner="balanced", lockstep=False,
                                      cost_model=cost_model_for(ModelSpec())).stats.as_dict()
        assert r["passes"] == {}
    effs = [r["plan"]["pad_efficiency"] for r in results]
    assert effs == sorted(effs, reverse=True)  # bigger budgets pad more on this workload
    assert "1,669,550" in proc.stdout


def test_multirun_outputs_agree_across_mbs_and_mtpm(workdir):
    """Fixed slices of mbs 1 and 3, and mtpm in {600, 100000} x at most {any, 3} sequences per micro-batch: all six
    outputs agree to 1e-5 (batching never changes them). mbs beside a budget is refused (it would be ignored), so
    the slices and the budgets are two sweeps."""
    dirs = []
    for name, grid in (("slices", ["mbs=1,3"]), ("budgets", ["mtpm=600,100000", "max_seqs_per_microbatch=null,3"])):
        sweep = workdir / name
        proc = run_harness(
            "-m",
            "workload=smoke",
            "backend=pytorch",
            "bench.save_outputs=true",
            "bench.warmup=0",
            "bench.repeat=1",
            *grid,
            "bench.share_plans=false",  # measure each grouping, do not share a plan
            "bench.baseline=false",  # the budgets' sweep has no mbs=1 point: the six are the points
            f"hydra.sweep.dir={sweep}",
            cwd=workdir,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        dirs += sorted(p for p in sweep.iterdir() if (p / "example_outputs.json").exists())
    assert len(dirs) == 6
    outs = [load_json(d / "example_outputs.json") for d in dirs]
    ref = outs[0]
    for out in outs[1:]:
        for pass_type in ("forward", "forward_backward"):
            for a, b in zip(out[pass_type]["loss"], ref[pass_type]["loss"]):
                assert math.isclose(a, b, rel_tol=1e-5)
        assert math.isclose(out["forward_backward"]["grad_norm"], ref["forward_backward"]["grad_norm"], rel_tol=1e-5)
    plans = {tuple(load_json(d / "results.json")["plan"]["n_microbatches"]) for d in dirs}
    assert len(plans) >= 4  # the six points really batch differently


def _one_error_line(proc) -> str:
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize("override, key", [("mtpm=-1", "mtpm"), ("backend=nccl_magic", "backend")])
def test_bad_input_is_one_line_naming_the_key_and_exit_2(workdir, override, key):
    """The CLI's contract, once for a value the harness refuses and once for a choice Hydra cannot compose;
    every refused value's line is checked in-process (tests/unit/test_config.py). A new interpreter, as a user's
    (the other CLI tests' runs fork from one that imported torch already: tests/warm_cli.py)."""
    proc = run_harness("dry_run=true", override, f"hydra.run.dir={workdir / 'run'}", cwd=workdir, fresh=True)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert line.split("error: ", 1)[-1].split("] - ", 1)[-1] == config_error(override), line
    assert key in line


def test_zero_length_in_a_lengths_file_is_one_line(workdir):
    f = workdir / "lengths.txt"
    f.write_text("100\n0\n50\n")
    proc = run_harness(
        "dry_run=true", "workload=lengths_file", f"workload.path={f}", f"hydra.run.dir={workdir / 'run'}", cwd=workdir
    )
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "workload.path" in line and "lengths.txt:2" in line
    res = load_json(workdir / "run" / "results.json")
    assert res["status"] == "error" and "length 0" in res["error"]


def test_lengths_files_as_editors_and_tools_write_them(workdir):
    """A BOM is skipped; non-UTF-8 bytes, a folder and 1_000 are one line naming the path."""
    bom = workdir / "bom.txt"
    bom.write_bytes("\ufeff100\n200\n".encode("utf-8"))
    proc = run_harness(
        "dry_run=true", "workload=lengths_file", f"workload.path={bom}", f"hydra.run.dir={workdir / 'bom'}", cwd=workdir
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert load_json(workdir / "bom" / "results.json")["workload"]["total_tokens"] == 300
    latin1, underscores = workdir / "latin1.txt", workdir / "underscores.txt"
    latin1.write_bytes(b"100\n# caf\xe9\n")
    underscores.write_text("100\n1_000\n")
    for i, (path, needle) in enumerate([(latin1, "is not UTF-8 text"), (workdir, "is a folder, not a file"),
                                        (underscores, "underscores.txt:2: '1_000' is not an integer")]):
        proc = run_harness(
            "dry_run=true",
            "workload=lengths_file",
            f"workload.path={path}",
            f"hydra.run.dir={workdir / str(i)}",
            cwd=workdir,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = _one_error_line(proc)
        assert "workload.path" in line and str(path) in line and needle in line, line


def test_a_histogram_lengths_file_plans_a_drawn_batch_and_says_what_it_read(workdir):
    """A histogram: length,count lines, 5,000 sequences drawn from them by count; results.json says what was read."""
    hist = workdir / "lengths.csv"
    hist.write_text("length,count\n# a corpus of 1,000,000 sequences in 4 lines\n48,500000\n200, 300000\n"
                    "450 ,150000\n2000,50000\n")
    run = workdir / "run"
    proc = run_harness("dry_run=true", "workload=lengths_file", f"workload.path={hist}", "workload.n_examples=5000",
                       "planner=balanced", "layout=packed", "mtpm=512", f"hydra.run.dir={run}", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res, plan = load_json(run / "results.json"), load_json(run / "plan.json")
    assert res["status"] == "planned"
    wl = res["workload"]
    assert wl["name"] == "lengths_file" and wl["n_examples"] == 5000 and len(plan["lengths"]) == 5000
    assert wl["file"] == {"path": str(hist), "format": "histogram", "distinct_lengths": 4, "sequences": 1_000_000,
                          "sampled": 5000, "order": "sampled"}
    assert set(plan["lengths"]) == {48, 200, 450, 2000} and wl["total_tokens"] == sum(plan["lengths"])
    assert 0.45 < plan["lengths"].count(48) / 5000 < 0.55  # drawn by count: half the corpus is 48 tokens long
    assert res["plan"]["over_budget"] == plan["lengths"].count(2000)  # only the sequences longer than the budget


def test_missing_checkpoint_is_one_line_naming_the_path(workdir):
    proc = run_harness(
        "model=qwen3_5_35b_a3b", "model.path=/no/such/ckpt", *FAST, f"hydra.run.dir={workdir / 'run'}", cwd=workdir
    )
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "model.path" in line and "/no/such/ckpt" in line


def test_a_bad_point_does_not_stop_the_sweep(workdir):
    sweep = workdir / "sweep"
    proc = run_harness("-m", "mtpm=-5,4096", "dry_run=true", "workload=smoke", f"hydra.sweep.dir={sweep}", cwd=workdir)
    assert proc.returncode == 2
    assert [r["status"] for r in sweep_results(sweep)] == ["error", "planned"]


def test_a_packed_balanced_run_measures_real_tokens_only(workdir):
    run = workdir / "run"
    proc = run_harness(
        "layout=packed", "planner=balanced", "mtpm=4096", "bench.save_outputs=true", *FAST,
        f"hydra.run.dir={run}", cwd=workdir,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = load_json(run / "results.json")
    assert doc["status"] == "ok"
    plan = doc["plan"]
    assert (plan["layout"], plan["planner"]) == ("packed", "balanced")
    # Packed: what is computed is exactly the real tokens, and no micro-batch is over the budget.
    assert plan["padded_tokens"] == plan["real_tokens"] == doc["workload"]["total_tokens"]
    assert plan["pad_efficiency"] == 1.0 and plan["over_budget"] == 0
    assert max(plan["n_microbatches"]) < doc["workload"]["n_examples"]  # sequences really share a row
    assert doc["passes"]["forward_backward"]["tok_per_s"] > 0


def test_dry_runs_plan_every_planner_and_layout_and_write_plan_json(workdir):
    sweep = workdir / "sweep"
    proc = run_harness(
        "-m", "planner=greedy,balanced", "layout=padded,packed", "mtpm=32768", "world_size=4",
        "backend=fsdp2", "model=qwen3_5_35b_a3b", "workload=seed_mixed_128", "dry_run=true",
        f"hydra.sweep.dir={sweep}", cwd=workdir,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lengths = mixed_lengths(128, 64, 32768, 42)
    points = sorted(p for p in sweep.iterdir() if (p / "results.json").exists())
    assert len(points) == 4
    seen = set()
    for point in points:
        res, plan = load_json(point / "results.json"), load_json(point / "plan.json")
        p = res["plan"]
        seen.add((p["planner"], p["layout"]))
        assert res["status"] == "planned" and (res["planner"], res["layout"]) == (p["planner"], p["layout"])
        assert p["lower_bound_steps"] == 13 and p["steps"] >= 13
        assert p["cost_model"]["b"] == 81920 and "qwen3_5_35b_a3b" in p["cost_model"]["source"]
        assert len(p["cost_per_rank"]) == 4 and p["cost_imbalance"] >= 1 and p["critical_path"] >= 1
        # plan.json: what ran where, enough to check or draw the plan
        assert plan["version"] == 1 and plan["backend"] == "fsdp2" and plan["world_size"] == 4 and plan["lockstep"]
        assert (plan["planner"], plan["layout"]) == (p["planner"], p["layout"])
        assert plan["max_tokens_per_microbatch"] == 32768 and plan["cost_model"] == p["cost_model"]
        assert plan["lengths"] == lengths
        assert {len(s) for s in plan["schedules"]} == {p["steps"]}
        assert sorted(i for s in plan["schedules"] for b in s if b for i in b) == list(range(128))
        if p["layout"] == "packed":
            assert p["pad_efficiency"] == 1.0
        if p["planner"] == "balanced":
            assert p["over_budget"] == 0 and p["cost_imbalance"] <= 1.005
        if (p["planner"], p["layout"]) == ("balanced", "packed"):
            assert p["steps"] == 13 and p["critical_path"] <= 1.02
    assert seen == {("greedy", "padded"), ("greedy", "packed"), ("balanced", "padded"), ("balanced", "packed")}
    assert "critical path" in proc.stdout


@pytest.mark.parametrize("planner, layout", [("balanced", "packed"), ("greedy", "padded")])
def test_a_cap_on_sequences_per_micro_batch_holds_in_every_plan_and_in_its_bound(workdir, planner, layout):
    """max_seqs_per_microbatch=3 reaches the plan, plan.json, results.json and the lower bound; on the
    smoke workload (16 short sequences, a few thousand tokens in all) it is what bounds the steps, not the budget."""
    from balance_batch.stats import lower_bound_steps

    sweep = workdir / "sweep"
    proc = run_harness("-m", "dry_run=true", f"planner={planner}", f"layout={layout}", "mtpm=4096",
                       "max_seqs_per_microbatch=3", "workload=cpu_mixed,smoke", f"hydra.sweep.dir={sweep}", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "at most 3 sequences per micro-batch" in proc.stdout + proc.stderr
    points = sorted(p for p in sweep.iterdir() if (p / "results.json").exists())
    assert len(points) == 2
    for point in points:
        res, plan = load_json(point / "results.json"), load_json(point / "plan.json")
        assert res["status"] == "planned" and res["max_seqs_per_microbatch"] == plan["max_seqs_per_microbatch"] == 3
        assert (res["planner"], res["layout"]) == (planner, layout)
        batches = [b for s in plan["schedules"] for b in s if b is not None]
        assert max(len(b) for b in batches) == res["plan"]["max_microbatch_size"] == 3
        assert sorted(i for b in batches for i in b) == list(range(len(plan["lengths"])))
        lengths, world = plan["lengths"], plan["world_size"]
        bound = lower_bound_steps(lengths, world, 4096, 1, max_seqs=3)
        assert res["plan"]["lower_bound_steps"] == bound <= res["plan"]["steps"]
        if res["workload"]["name"] == "smoke":  # 16 sequences, 3 at a time: at least 6 micro-batches over the ranks
            assert bound >= math.ceil(math.ceil(16 / 3) / world) > lower_bound_steps(lengths, world, 4096, 1)


def test_a_real_run_writes_the_plan_it_ran(workdir):
    run_dir = workdir / "run"
    proc = run_harness(*FAST, "mtpm=700", "planner=balanced", "bench.repeat=1", f"hydra.run.dir={run_dir}", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res, plan = load_json(run_dir / "results.json"), load_json(run_dir / "plan.json")
    assert res["status"] == "ok" and res["plan"]["planner"] == "balanced" and plan["planner"] == "balanced"
    assert plan["lockstep"] is False and plan["backend"] == "pytorch"
    ran = [len(b) for b in plan["schedules"][0]]
    assert res["plan"]["n_microbatches"] == [len(ran)]
    assert res["plan"]["steps"] == len(ran) and res["plan"]["max_tokens_per_microbatch"] == 700


def test_a_named_checkpoint_model_without_a_path_is_refused(workdir):
    """Building the tiny model under the 35B model's name would record a toy as the benchmark model."""
    proc = run_harness(
        "model=qwen3_5_35b_a3b",
        "model.path=null",
        *FAST,
        "logger=none",
        f"hydra.run.dir={workdir / 'run'}",
        cwd=workdir,
    )
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "model.path" in line and "qwen3_5_35b_a3b" in line and "model=tiny" in line
    assert load_json(workdir / "run" / "results.json")["status"] == "error"
    # a dry run builds no model, so it needs no checkpoint
    plan = run_harness("model=qwen3_5_35b_a3b", "model.path=null", "dry_run=true", "workload=smoke",
                       f"hydra.run.dir={workdir / 'plan'}", cwd=workdir)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    res = load_json(workdir / "plan" / "results.json")
    assert res["status"] == "planned" and res["model"]["built"] is None and res["precision"] is None


def test_a_duplicated_sweep_value_is_measured_once(workdir):
    sweep = workdir / "sweep"
    proc = run_harness(
        "-m", "mtpm=512,4096,512", "dry_run=true", "workload=smoke", f"hydra.sweep.dir={sweep}", cwd=workdir
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["mtpm"] for r in sweep_results(sweep)] == [512, 4096]
    assert "mtpm=512 workload=smoke is listed 2 times; it is measured once" in proc.stdout + proc.stderr


def _tree_digest(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_folder_holding_results_is_not_reused_without_resume(workdir):
    sweep = workdir / "sweep"
    args = ["-m", "mtpm=512,4096", "dry_run=true", "workload=smoke", f"hydra.sweep.dir={sweep}"]
    assert run_harness(*args, cwd=workdir).returncode == 0
    before = _tree_digest(sweep)
    proc = run_harness(*args, cwd=workdir)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "hydra.sweep.dir" in line and "resume=true" in line and str(sweep) in line
    assert _tree_digest(sweep) == before  # nothing in the folder was touched
    # another sweep running in it (this test's process holds its lock): refused, resumed or not, naming that sweep
    from backends.runtime.liveness import process_record
    from harness.sweep.lock import LOCK_FILE

    (sweep / LOCK_FILE).write_text(json.dumps(process_record()))
    busy = run_harness(*args, "resume=true", cwd=workdir)
    line = _one_error_line(busy)
    assert busy.returncode == 2 and f"in use by another sweep (pid {os.getpid()}" in line and "resume" not in line
    (sweep / LOCK_FILE).unlink()
    assert _tree_digest(sweep) == before

    run = workdir / "run"
    assert run_harness("dry_run=true", "workload=smoke", f"hydra.run.dir={run}", cwd=workdir).returncode == 0
    before = _tree_digest(run)
    again = run_harness("dry_run=true", "workload=smoke", "mtpm=512", f"hydra.run.dir={run}", cwd=workdir)
    assert again.returncode == 2 and "resume=true" in _one_error_line(again)
    other = run_harness(
        "dry_run=true", "workload=smoke", "mtpm=512", "resume=true", f"hydra.run.dir={run}", cwd=workdir
    )
    assert other.returncode == 2 and "another point" in _one_error_line(other)
    assert _tree_digest(run) == before


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_an_unwritable_output_folder_is_one_line(workdir, unwritable_dir, multirun):
    target = unwritable_dir / "out"
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    args = ["-m", "mtpm=512,4096"] if multirun else []
    proc = run_harness(*args, "dry_run=true", "workload=smoke", f"{key}={target}", cwd=workdir)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert key in line and str(target) in line


def test_resume_keeps_finished_results_and_finds_points_by_their_overrides(workdir):
    """A resumed sweep with a new point first must not overwrite the old point 0."""
    import hashlib

    def digests(sweep):
        return {p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sweep.glob("*/results.json")}

    sweep = workdir / "sweep"
    common = ["backend=pytorch", "workload=smoke", "workload.n_examples=4", "bench.warmup=0", "bench.repeat=1",
              "logger=none", "bench.baseline=false", f"hydra.sweep.dir={sweep}"]
    first = run_harness("-m", "mtpm=512,100000", *common, cwd=workdir)
    assert first.returncode == 0, first.stdout + first.stderr
    done = digests(sweep)
    assert [(r["mtpm"], r["status"]) for r in sweep_results(sweep)] == [(512, "ok"), (100000, "ok")]

    first_config = (sweep / "multirun.yaml").read_text()
    resumed = run_harness("-m", "mtpm=2048,512,100000", "resume=true", *common, cwd=workdir)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # The first run's multirun.yaml is kept, not overwritten; multirun.yaml is the latest run's
    assert (sweep / "multirun.0.yaml").read_text() == first_config
    assert "mtpm=2048,512,100000" in (sweep / "multirun.yaml").read_text()
    assert (resumed.stdout + resumed.stderr).count("already ok") == 2
    after = digests(sweep)
    assert {k: after[k] for k in done} == done  # the finished points were not measured again
    assert [(r["mtpm"], r["status"]) for r in sweep_results(sweep)] == [(512, "ok"), (100000, "ok"), (2048, "ok")]

    planned = run_harness("-m", "mtpm=2048,512,100000,300", "resume=true", "dry_run=true", *common, cwd=workdir)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert {k: digests(sweep)[k] for k in after} == after  # a dry run never replaces a measurement
    assert [(r["mtpm"], r["status"]) for r in sweep_results(sweep)][-1] == (300, "planned")
    assert len(sweep_results(sweep)) == 4
    assert sorted(p.name for p in sweep.glob("multirun*.yaml")) == [
        "multirun.0.yaml",
        "multirun.1.yaml",
        "multirun.yaml",
    ]


def test_more_ranks_than_cores_says_so(workdir):
    """On one core, two ranks: a warning that says what is happening, then the run still finishes."""
    import os
    import subprocess
    import sys

    from tests.conftest import harness_env

    core = sorted(os.sched_getaffinity(0))[0]
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "backend=fsdp2", "world_size=2", "workload=smoke", "workload.n_examples=2",
         "bench.warmup=0", "bench.repeat=1", "logger=none", f"hydra.run.dir={workdir / 'run'}"],
        cwd=workdir, env=harness_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "world_size=2 ranks on 1 CPU cores" in text and "starting 2 ranks" in text


def test_a_resume_that_drops_a_failed_point_says_so_and_its_exit_is_its_own(workdir):
    """Resuming without an earlier failed point once exited 1 with no line saying why."""
    sweep = workdir / "sweep"
    common = ["dry_run=true", "workload=smoke", "logger=none", f"hydra.sweep.dir={sweep}"]
    first = run_harness("-m", "mtpm=512,-5", *common, cwd=workdir)
    assert first.returncode != 0  # the bad point is an error of this run
    assert sorted(r["status"] for r in sweep_results(sweep)) == ["error", "planned"]
    again = run_harness("-m", "mtpm=512", "resume=true", *common, cwd=workdir)
    text = again.stdout + again.stderr
    assert again.returncode == 0, text
    line = next(ln for ln in text.splitlines() if "not in this run's list" in ln)
    assert str(sweep / "1") in line and "error" in line
    listed = run_harness("-m", "mtpm=512,-5", "resume=true", *common, cwd=workdir)  # listed again: it counts
    assert listed.returncode != 0
