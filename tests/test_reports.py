"""python -m reports: the table, the README block, --check, CSV and plots, from real sweep results."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pandas as pd
import pytest

from reports.collect import collect
from reports.render import BEGIN, END, table_frame
from tests.conftest import REPO, run_cli, run_harness, sweep_results

README_TEXT = f"# A project\n\nIntro stays.\n\n{BEGIN}\nold table\n{END}\n\nOutro stays.\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A real two-point smoke sweep (W&B disabled: harness_env sets WANDB_MODE=disabled; test_tracking has its own offline runs)."""
    root = tmp_path_factory.mktemp("reports")
    sweep = root / "sweep"
    proc = run_harness(
        "-m", "mtpm=600,100000", "backend=pytorch", "workload=smoke", "bench.warmup=0", "bench.repeat=1",
        f"hydra.sweep.dir={sweep}", cwd=root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep


def test_callback_wrote_the_report_into_the_sweep_folder(sweep):
    assert (sweep / "report.md").read_text().count("| PyTorch") == 2
    peaks = table_frame(collect([sweep]))["peak mem per rank (GiB)"]
    assert all(float(p) > 0.05 for p in peaks)  # bytes from results.json, one value per rank (1 here)
    assert (sweep / "results.csv").exists()
    for name in ("tok_per_s.png", "pad_efficiency.png"):
        assert (sweep / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_callback_drew_each_points_plan_and_linked_it(sweep):
    rows = [line for line in (sweep / "report.md").read_text().splitlines() if line.startswith("| PyTorch")]
    for point in ("0", "1"):
        assert (sweep / "plots" / f"plan-{point}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert sum(f"[plan](plots/plan-{point}.png)" in r for r in rows) == 1


def test_readme_check_fails_before_and_passes_after(sweep, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    before = run_cli("reports", str(sweep), "--readme", str(readme), "--check", cwd=tmp_path)
    assert before.returncode == 1 and "stale" in before.stdout
    assert readme.read_text() == README_TEXT  # --check writes nothing
    write = run_cli("reports", str(sweep), "--readme", str(readme), cwd=tmp_path)
    assert write.returncode == 0, write.stderr
    text = readme.read_text()
    head, tail = README_TEXT.split(BEGIN)[0], README_TEXT.split(END)[1]
    assert text.startswith(head) and text.endswith(tail)  # only the marked block changed
    block = text[text.index(BEGIN) : text.index(END)]
    assert "16,384" not in block and "| 100,000 " in block and "| 600 " in block
    assert "plots/tok_per_s.png" in block and "plots/pad_efficiency.png" in block
    after = run_cli("reports", str(sweep), "--readme", str(readme), "--check", cwd=tmp_path)
    assert after.returncode == 0, after.stdout + after.stderr
    for link in ("tok_per_s.png", "pad_efficiency.png"):
        assert (sweep / "plots" / link).exists()


def test_csv_holds_the_frame(sweep, tmp_path):
    csv = tmp_path / "frame.csv"
    proc = run_cli("reports", str(sweep), "--csv", str(csv), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(csv)
    assert sorted(df["mtpm"]) == [600, 100000]
    assert set(df["status"]) == {"ok"}
    assert (df["forward_backward_tok_per_s"] > 0).all()


def _variant(doc: dict, **changes) -> dict:
    out = copy.deepcopy(doc)
    out.update(changes)
    return out


def test_rows_order_and_failed_points_stay(sweep, tmp_path):
    ok = sweep_results(sweep)[0]
    docs = {
        "a": _variant(ok, backend="megatron_ddp", mtpm=65536),
        "b": _variant(ok, backend="fsdp2", mtpm=131072, status="oom", error="out of memory in forward_backward", passes={}),
        "c": _variant(ok, backend="fsdp2", mtpm=None, mbs=2),
        "d": _variant(ok, backend="fsdp2", mtpm=16384),
        "e": _variant(ok, backend="fsdp2", mtpm=None, mbs=1),
        "f": _variant(ok, backend="megatron_ddp", mtpm=None, mbs=1, status="error", error="rank 1 died", passes={}),
    }
    for name, doc in docs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(doc))
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "results.json").write_text("{ half a fi")  # a torn file is shown, not dropped
    df = collect([tmp_path])
    assert len(df) == 7
    known = df[df["status"] != "unreadable"]
    shown = table_frame(known)
    assert list(zip(shown["backend"], shown["mbs"], shown["mtpm"], shown["status"])) == [
        ("FSDP2", "1", "—", "ok"),
        ("FSDP2", "2", "—", "ok"),
        ("FSDP2", "—", "16,384", "ok"),
        ("FSDP2", "—", "131,072", "OOM"),
        ("Megatron DDP", "1", "—", "error"),
        ("Megatron DDP", "—", "65,536", "ok"),
    ]
    oom = shown[shown["status"] == "OOM"].iloc[0]
    assert oom["fwd tok/s"] == "—" and oom["pad efficiency"] != "—"
    assert "unreadable" in set(df["status"])


def test_committed_readme_matches_committed_results():
    proc = run_cli("reports", "--check", cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_missing_folder_is_one_line(tmp_path):
    proc = run_cli("reports", str(tmp_path / "nope"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no such folder" in proc.stderr


def _committed_points() -> list[Path]:
    points = sorted((REPO / "reports" / "results").glob("*/*/results.json"))
    assert points, "no committed results"
    return [p.parent for p in points]


def _workload_lengths(res: dict) -> list[int]:
    """The lengths the point's workload config generates (conf/workload/<name>.yaml plus the point's overrides)."""
    import yaml

    from harness.workload import mixed_lengths

    conf = yaml.safe_load((REPO / "conf" / "workload" / f"{res['workload']['name']}.yaml").read_text())
    for override in res["overrides"]:
        key, _, value = override.partition("=")
        if key.startswith("workload."):
            conf[key.removeprefix("workload.")] = yaml.safe_load(value)
    assert conf["kind"] == "mixed"
    return mixed_lengths(conf["n_examples"], conf["min_len"], conf["max_len"], conf["seed"])


def test_committed_results_are_a_real_sweep_of_this_machine():
    """Everything that can be recomputed is: an edited number, a hand-made plan or a pasted row does not pass.

    Per point: the overrides Hydra recorded; the lengths from the workload config;
    the plan (plan.json and every plan statistic) from those lengths; tokens/s from
    the timings; FLOPs and MFU from the plan, the timings and the recorded peak.
    Across points: one gradient norm (batching must not change the answer).
    """
    import yaml

    from backends.registry import LOCKSTEP_BACKENDS
    from backends.microbatch import CostModel, plan_batch
    from backends.specs import ModelSpec
    from harness.flops import flops_record, training_flops_for

    df = collect([REPO / "reports" / "results"])
    assert not df.empty
    assert set(df["backend"]) >= {"fsdp2", "megatron_ddp"}
    assert {16384, 32768, 65536, 131072} <= set(df["mtpm"].dropna().astype(int))
    assert (df["status"] == "ok").all()
    grad_norms = []
    for point in _committed_points():
        res = _load(point / "results.json")
        assert yaml.safe_load((point / ".hydra" / "overrides.yaml").read_text()) == res["overrides"], point
        lengths = _workload_lengths(res)
        wl = res["workload"]
        assert (wl["n_examples"], wl["total_tokens"], wl["min_len"], wl["max_len"]) == (
            len(lengths), sum(lengths), min(lengths), max(lengths)), point
        stored_plan = json.loads((point / "plan.json").read_text())
        assert stored_plan["lengths"] == lengths, point
        plan = plan_batch(lengths, res["world_size"], res["mtpm"], res["mbs"], align=res["backend"] in LOCKSTEP_BACKENDS,
                          layout=res["layout"], planner=res["planner"],
                          cost_model=CostModel.from_dict(res["plan"]["cost_model"]))
        assert [[None if b is None else list(b) for b in s] for s in plan.schedules] == stored_plan["schedules"], point
        recomputed = plan.stats.as_dict()
        for key, value in recomputed.items():
            assert res["plan"][key] == (pytest.approx(value) if isinstance(value, float) else value), (point, key)
        assert res["plan"]["pad_efficiency"] == pytest.approx(res["plan"]["real_tokens"] / res["plan"]["padded_tokens"])
        assert res["device"]["type"] == "cpu" and res["device"]["count"] == res["world_size"]
        assert res["peak"]["source"].startswith("measured:")  # a CPU peak measured on the machine that ran it
        m = res["model"]
        for pass_type, p in res["passes"].items():
            assert len(p["elapsed_s"]) == res["bench"]["repeat"] and min(p["elapsed_s"]) > 0, (point, pass_type)
            assert p["real_tokens"] == sum(lengths)
            assert p["tok_per_s"] == pytest.approx(sum(lengths) / (sum(p["elapsed_s"]) / len(p["elapsed_s"])))
            assert len(p["mem_peak_bytes"]) == res["world_size"] and min(p["mem_peak_bytes"]) > 0
            assert 0 < p["util_pct"] <= 100 * res["device"]["cores"]
            # FLOPs from the training-FLOPs model (LoRA rank and config of the point's model), hardware from the plan
            training = training_flops_for(ModelSpec(name=m["name"], path=m["path"], lora_rank=m["lora_rank"],
                                                    vocab_size=m["built"]["vocab_size"]))  # backend.logprob_chunk_tokens is not recorded: the default (chunked) head; LoRA points recompute nothing there
            flops = flops_record(pass_type, lengths, training, res["plan"], res["gc"], p["elapsed_s"], res["world_size"],
                                 res["peak"], cost_model=CostModel.from_dict(res["plan"]["cost_model"]),
                                 schedules=plan.schedules)
            for key, value in flops.items():
                if key == "flops":  # the description of what was counted
                    assert p.get(key) == value, (point, pass_type, key)
                else:
                    assert p[key] == pytest.approx(value), (point, pass_type, key)
        assert res["passes"]["forward"]["grad_norm"] is None
        grad_norms.append(res["passes"]["forward_backward"]["grad_norm"])
    assert min(grad_norms) > 0 and max(grad_norms) == pytest.approx(min(grad_norms), rel=1e-6)


@pytest.mark.slow
def test_committed_gradient_is_the_tiny_models_own():
    """The committed gradient norm is what a plain forward of the tiny model gives on the point's examples (tests/loss_oracle.py)."""
    from harness.workload import make_examples
    from tests.loss_oracle import oracle

    res = _load(_committed_points()[0] / "results.json")
    assert res["model"]["name"] == "tiny" and res["model"]["lora_rank"] == 32 and not any("seed" in o for o in res["overrides"])
    examples = make_examples(_workload_lengths(res), res["model"]["built"]["vocab_size"], seed=0)  # conf/config.yaml's seed
    assert res["passes"]["forward_backward"]["grad_norm"] == pytest.approx(oracle(examples)["grad_norm"], rel=1e-4)


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())
