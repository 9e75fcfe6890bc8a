"""bench.profile: a profiled pass writes a trace per rank that reads back to the breakdown it reports, in float32
and bf16 (in-process), and the command line's profiled points on FSDP2 and Megatron DDP (traces, breakdown, report,
W&B artifact)."""

from __future__ import annotations

import gzip
import json

import pytest

from backends.messages import make_command
from backends.pytorch import PyTorchBackend
from backends.runtime.profiling import PASS_RANGE, breakdown, read_trace
from backends.specs import BackendSpec, ModelSpec
from harness.data.workload import make_examples

EXAMPLES = make_examples([40, 96, 17, 128, 64, 33], 2048, seed=3)


@pytest.mark.parametrize("dtype, pass_type", [("float32", "forward"), ("float32", "forward_backward"),
                                              ("bfloat16", "forward_backward")])
def test_a_profiled_pass_writes_a_trace_that_reads_back_to_its_breakdown(tmp_path, dtype, pass_type):
    backend = PyTorchBackend(BackendSpec(device="cpu"), ModelSpec(dtype=dtype))
    try:
        command = make_command(pass_type, EXAMPLES, 256, 1, layout="packed", planner="balanced")
        plain = backend.run_pass(command)
        result = backend.run_pass(command.replace(profile_dir=str(tmp_path)))
    finally:
        backend.close()
    assert plain.profile is None  # only a command with profile_dir is profiled
    (rank0,) = result.profile
    path = tmp_path / f"{pass_type}-rank0.json.gz"
    assert rank0["trace"] == str(path)
    with gzip.open(path, "rt") as f:  # a Chrome trace, as Perfetto and TensorBoard load it
        trace = json.load(f)
    assert any(e.get("name") == PASS_RANGE for e in trace["traceEvents"])
    got = rank0["breakdown"]
    assert breakdown(read_trace(path)) == got
    assert sum(got["shares"].values()) == pytest.approx(1.0)
    assert got["covered_s"] == pytest.approx(got["pass_s"], rel=0.05)
    # the range encloses the timed region and little else (not the trace's export: seconds); the profiler's own
    # entry into the range costs a few milliseconds, a large share of a short pass
    assert result.step_s - 1e-3 <= got["pass_s"] <= 1.05 * result.step_s + 0.05
    for cat in ("attention", "delta_rule", "other_matmuls", "logprob_head", "convolution", "moe_experts"):
        assert got["seconds"][cat] > 0, cat
    assert (got["seconds"]["backward"] > 0) == (pass_type == "forward_backward")
    assert got["seconds"]["collectives"] == 0  # one process
    assert [o.loss for o in result.outputs] == pytest.approx([o.loss for o in plain.outputs], rel=1e-5)


def test_the_command_line_profiles_every_rank_of_fsdp2_and_megatron(workdir):
    """backend.profile on FSDP2 (plus Megatron DDP beside it): a loadable trace per rank and pass type, a breakdown
    whose
    seconds add up to the profiled pass, collectives seen on every rank, the report's figure and the W&B artifact."""
    import glob

    from tests.conftest import harness_env, load_json, run_harness, sweep_results
    from tests.wandb_records import records, run_contents

    sweep = workdir / "sweep"
    proc = run_harness("-m", "backend=fsdp2,megatron_ddp", "bench.profile=true", "layout=packed", "planner=balanced",
                       "bench.profile_ranks=null", "mtpm=2048", "workload=smoke", "bench.warmup=0", "bench.repeat=1",
                       "bench.baseline=false", "hydra.callbacks.report.plots=true",
                       "logger=wandb", "logger.mode=offline", f"hydra.sweep.dir={sweep}", cwd=workdir, timeout=1200,
                       env=harness_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    docs = sweep_results(sweep)
    assert [d["status"] for d in docs] == ["ok", "ok"], [d.get("error") for d in docs]
    folders = sorted((p.parent for p in sweep.glob("*/results.json")), key=lambda f: int(f.name))
    for d, folder in zip(docs, folders):
        for pass_type in ("forward", "forward_backward"):
            passed = d["passes"][pass_type]
            profile = passed["profile"]
            assert len(passed["elapsed_s"]) == 1  # the profiled run is not one of the timed repeats
            assert profile["traces"] == [f"profile/{pass_type}-rank{r}.json.gz" for r in range(2)]
            for rank, (trace, mine) in enumerate(zip(profile["traces"], profile["per_rank"])):
                back = breakdown(read_trace(folder / trace))  # the trace read back gives what was recorded
                assert back["shares"] == pytest.approx(mine["shares"]) and mine["rank"] == rank
                assert sum(back["seconds"].values()) == pytest.approx(back["pass_s"], rel=0.05)
                assert sum(back["shares"].values()) == pytest.approx(1.0)
                if pass_type == "forward_backward" or d["backend"] == "fsdp2":  # FSDP2 gathers weights in forward too
                    assert back["seconds"]["collectives"] > 0, (d["backend"], pass_type, rank)
            assert sum(profile["shares"].values()) == pytest.approx(1.0)
            assert profile["slowdown"] == pytest.approx(profile["elapsed_s"] / passed["elapsed_s"][0])
            slowest = max(r["pass_s"] for r in profile["per_rank"])  # the range encloses each rank's timed region
            assert profile["elapsed_s"] - 1e-3 <= slowest <= 1.05 * profile["elapsed_s"] + 0.05
        wandb_file = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))[0]
        artifacts = [r.artifact for r in records(wandb_file) if r.WhichOneof("record_type") == "artifact"]
        assert [(a.type, sorted(m.path for m in a.manifest.contents)) for a in artifacts if a.type == "profile"] == [
            ("profile", sorted(f"{t}-rank{r}.json.gz" for t in ("forward", "forward_backward") for r in range(2)))]
        assert sum(a.type == "run_table" for a in artifacts) == 2  # each pass's step times, the table timeline/<pass>
        summary = run_contents(wandb_file)["summary"]
        assert summary["passes/forward_backward/profile/shares/backward"] > 0
    report = (sweep / "report.md").read_text()
    assert "[profile](plots/profile-0.png)" in report and (sweep / "plots" / "profile-1.png").is_file()
    assert load_json(folders[0] / "results.json")["bench"]["profile"] is True
