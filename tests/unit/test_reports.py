"""The committed results recomputed in-process: plans, statistics and FLOPs (python -m reports and the gradient oracle:
tests/integration/test_reports.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reports.collect import collect
from tests.conftest import CONF, REPO


def _committed_points() -> list[Path]:
    points = sorted((REPO / "reports" / "results").glob("*/*/results.json"))
    assert points, "no committed results"
    return [p.parent for p in points]


def _workload_lengths(res: dict) -> list[int]:
    """The lengths the point's workload config generates (harness/conf/workload/<name>.yaml plus the point's
    overrides), at the size the point recorded (the committed sweep ran when cpu_mixed's default was 24 examples; now
    16)."""
    import yaml

    from harness.data.workload import mixed_lengths

    conf = yaml.safe_load((CONF / "workload" / f"{res['workload']['name']}.yaml").read_text())
    conf["n_examples"] = res["workload"]["n_examples"]
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
    from backends.specs import ModelSpec
    from balance_batch import CostModel, plan_step
    from harness.metrics.balance import balance_fields, ran_schedules
    from harness.metrics.flops import flops_record, training_flops_for
    from harness.metrics.spread import paired_speedup, summary

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
        plan = plan_step(
            lengths,
            world_size=res["world_size"],
            max_tokens_per_microbatch=res["mtpm"],
            micro_batch_size=res["mbs"],
            lockstep=res["backend"] in LOCKSTEP_BACKENDS,
            layout=res["layout"],
            planner=res["planner"],
            cost_model=CostModel.from_dict(res["plan"]["cost_model"]),
        )
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
                                                    # backend.logprob_chunk_tokens is not recorded: the default
                                                    # (chunked) head; LoRA points recompute nothing there
                                                    vocab_size=m["built"]["vocab_size"]))
            flops = flops_record(
                pass_type,
                lengths,
                training,
                res["plan"],
                res["gc"],
                p["elapsed_s"],
                res["world_size"],
                res["peak"],
                cost_model=CostModel.from_dict(res["plan"]["cost_model"]),
                schedules=plan.schedules,
            )
            for key, value in flops.items():
                if key == "flops":  # the description of what was counted
                    assert p.get(key) == value, (point, pass_type, key)
                else:
                    assert p[key] == pytest.approx(value), (point, pass_type, key)
            # every rank's step times: each repeat's steps are the plan's, they add up to the rank's timed region,
            # the slowest rank's region is the repeat's elapsed_s, and the balance figures are the timeline's own
            tl = p["timeline"]
            lockstep = res["backend"] in LOCKSTEP_BACKENDS
            ran = ran_schedules(plan.schedules, lockstep)
            assert tl["repeats"] == res["bench"]["repeat"] == len(tl["busy_s"]), (point, pass_type)
            for i in range(tl["repeats"]):
                assert [len(s) for s in tl["step_s"][i]] == [len(s) for s in ran], (point, pass_type)
                for r in range(res["world_size"]):
                    parts = tl["start_s"][i][r] + sum(tl["step_s"][i][r]) + tl["sync_s"][i][r]
                    assert parts == pytest.approx(tl["elapsed_s"][i][r], rel=0.05), (point, pass_type, i, r)
                assert max(tl["elapsed_s"][i]) == pytest.approx(p["elapsed_s"][i], rel=0.05), (point, pass_type, i)
            lengths_model = {"flops": CostModel.from_dict(res["plan"]["cost_model"])}
            recorded = balance_fields(tl, plan.schedules, lengths, res["layout"], lockstep, lengths_model)
            for key in ("measured_critical_path", "idle_fraction", "busy_s", "cost_prediction"):
                assert p[key] == recorded[key], (point, pass_type, key)
            # the spread of its repeats, recomputed from them (harness/metrics/spread.py)
            spread = summary([sum(lengths) / t for t in p["elapsed_s"]])
            assert (p["tok_per_s_median"], p["tok_per_s_min"], p["tok_per_s_max"], p["noisy"], p["repeats"]) == (
                pytest.approx(spread["median"]), pytest.approx(spread["min"]), pytest.approx(spread["max"]),
                spread["noisy"], len(p["elapsed_s"])), (point, pass_type)
            assert p["tok_per_s_ci"] == pytest.approx(spread["ci"]) and p["tok_per_s_ci"][0] < p["tok_per_s_median"]
        # a budget's speedup over mbs=1: measured in pairs beside mbs=1 passes, one pair per timed repeat
        speed = res.get("speedup")
        if res["mtpm"] is None and res["mbs"] == 1:
            assert speed is None, point
        else:
            assert res["bench"]["paired"] and len(speed["pairs"]) == res["bench"]["repeat"], point
            fb = res["passes"]["forward_backward"]
            again = paired_speedup([sum(lengths) / t for t in fb["elapsed_s"]],
                                   [sum(lengths) / t for t in speed["baseline_elapsed_s"]])
            assert speed["pairs"] == pytest.approx(again["pairs"]) and speed["median"] == pytest.approx(again["median"])
            assert speed["ci"] == pytest.approx(again["ci"]) and speed["noisy"] == again["noisy"], point
            assert speed["baseline_plan"]["planner"] == "greedy" and speed["baseline_plan"]["max_microbatch_size"] == 1
            assert sum(speed["baseline_plan"]["n_microbatches"]) == len(lengths), point
        assert res["passes"]["forward"]["grad_norm"] is None
        grad_norms.append(res["passes"]["forward_backward"]["grad_norm"])
    assert min(grad_norms) > 0 and max(grad_norms) == pytest.approx(min(grad_norms), rel=1e-6)


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def test_the_readme_balance_table_is_the_committed_sweeps_and_they_compare_both_cost_models():
    """The calibrated cost model's measurement page quotes ``python -m reports balance`` over reports/balance/run*: real
    sweeps in which every setting ran with both cost models, the calibrated plans with a fit on record."""
    from reports.__main__ import main
    from reports.balance_table import balance_markdown, balance_rows

    runs = sorted((REPO / "reports" / "balance").glob("run*"))
    assert [r.name for r in runs] == ["run1", "run2", "run3"]
    page = REPO / "docs" / "measurements" / "2026-12-02-calibrated-cost-model.md"
    assert balance_markdown(runs) in page.read_text()
    rows = balance_rows(runs)
    by_setting: dict = {}
    for row in rows:
        by_setting.setdefault(tuple(row[:5]), set()).add(row[5])
    assert by_setting and all(models == {"flops", "calibrated"} for models in by_setting.values())
    assert {row[6] for row in rows if row[0] == "Megatron DDP"} == {"3"}  # the three sweeps ran every Megatron point
    for path in runs[0].glob("*/results.json"):
        doc = _load(path)
        model = doc["plan"]["cost_model"]
        assert (doc["cost_model"] == "calibrated") == ("coefficients" in model), path
        if doc["cost_model"] == "calibrated":
            assert model["r2"] > 0.9 and model["fixed"] == model["coefficients"]["c0"] and model["residuals"]
    assert main(["balance", str(REPO / "no-such-folder")]) == 2


def _block_tables(path: Path) -> list[list[str]]:
    """The header cells of each Markdown table inside ``path``'s results block."""
    from reports.render import current_block

    block = current_block(path.read_text())
    assert block is not None, path
    lines = block.splitlines()
    return [[c.strip() for c in line.strip("|").split("|")] for line, below in zip(lines, lines[1:])
            if line.startswith("|") and below.startswith("|:")]


def test_the_readme_table_is_short_and_docs_results_holds_every_column():
    """The README's generated table fits a page (at most 8 columns, fwd+bwd with its interval, the speedup and the
    status among them); docs/results.md's is the full table, every column, from the same results."""
    from reports.render import COLUMNS

    short = _block_tables(REPO / "README.md")
    full = _block_tables(REPO / "docs" / "results.md")
    assert short and full
    for header in short:
        assert len(header) <= 8 and {"backend", "fwd+bwd tok/s", "pad efficiency", "status"} <= set(header), header
    for header in full:
        assert set(COLUMNS) <= set(header), header
    assert "(docs/results.md)" in (REPO / "README.md").read_text()
