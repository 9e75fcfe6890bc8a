"""workload=dataset from the command line: a point on each backend with a chat dataset's real ids and trainer-style
weights, in float32 and bf16, losses checked against the oracle; the tokens come from the cache after the first
point; a bad dataset is one line and exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends.specs import ModelSpec
from harness.data.workload import WorkloadSpec, load_workload
from tests.conftest import load_json, run_harness, sweep_results
from tests.integration.test_harness_cli import _one_error_line
from tests.loss_oracle import oracle, plain_model

BF16_RTOL = 3e-2  # as tests/integration/test_precision.py
N_EXAMPLES, TRUNCATE_TO, SEED = 8, 160, 5


def _data_args(demo_data, cache) -> list[str]:
    return ["workload=dataset", f"workload.path={demo_data['chats']}", f"workload.tokenizer={demo_data['tokenizer']}",
            f"workload.cache_dir={cache}", f"workload.n_examples={N_EXAMPLES}",
            f"workload.truncate_to={TRUNCATE_TO}", f"workload.seed={SEED}"]


def test_each_backend_runs_the_dataset_and_matches_the_oracle(workdir, demo_data):
    cache = workdir / "cache"
    sweep = workdir / "sweep"
    proc = run_harness(
        "-m",
        "backend=pytorch,fsdp2,megatron_ddp",
        "model.dtype=float32,bfloat16",
        *_data_args(demo_data, cache),
        "mtpm=400",
        "hydra.callbacks.report.plots=true",  # the report's length histogram, drawn from the dataset's lengths
        "bench.warmup=0",
        "bench.repeat=1",
        "bench.save_outputs=true",
        "bench.baseline=false",
        "bench.share_plans=false",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        cwd=workdir,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    docs = sweep_results(sweep)
    assert len(docs) == 6 and all(d["status"] == "ok" for d in docs), [d.get("error") for d in docs]
    # the examples the points ran, rebuilt here the documented way, and the oracle's losses for them
    spec = WorkloadSpec(
        name="dataset",
        kind="dataset",
        path=str(demo_data["chats"]),
        tokenizer=str(demo_data["tokenizer"]),
        cache_dir=str(workdir / "oracle-cache"),
        n_examples=N_EXAMPLES,
        truncate_to=TRUNCATE_TO,
        seed=SEED,
    )
    examples = load_workload(spec, ModelSpec()).examples(2048, 0)
    expected = oracle(examples, plain_model())["losses"]
    hits = []
    folders = sorted((p.parent for p in sweep.glob("*/results.json")), key=lambda f: int(f.name.split("_")[0]))
    for d, folder in zip(docs, folders):
        wl = d["workload"]
        data = wl["dataset"]
        hits.append(data["cache"]["hit"])
        assert (wl["n_examples"], data["format"], data["train_on"], data["rows"]) == (
            N_EXAMPLES,
            "messages",
            "completion",
            300,
        )
        assert data["tokenizer"]["vocab_size"] == 2048 and data["largest_id"] < 2048
        assert wl["max_len"] <= TRUNCATE_TO == data["truncate_to"]
        assert data["truncated"] == sum(1 for e in examples if len(e) == TRUNCATE_TO)
        plan = load_json(folder / "plan.json")
        assert plan["lengths"] == [len(e) for e in examples]  # the same lengths on every point: from the cache
        losses = np.array(load_json(folder / "example_outputs.json")["forward_backward"]["loss"])
        dtype = d["precision"]["compute"]
        assert f"model.dtype={dtype}" in d["overrides"]  # what ran is what the point asked for
        np.testing.assert_allclose(losses, expected, rtol=1e-4 if dtype == "float32" else BF16_RTOL,
                                   err_msg=f"{d['backend']} {dtype}")
    assert hits == [False] + [True] * 5  # tokenized once, by the first point
    assert {(d["backend"], d["precision"]["compute"]) for d in docs} == {
        (b, t) for b in ("pytorch", "fsdp2", "megatron_ddp") for t in ("float32", "bfloat16")}
    report = (sweep / "report.md").read_text()
    assert (
        "workload `dataset` from `chats.jsonl` (8 examples" in report
        and "Sequence lengths: [histogram](plots/lengths-" in report
    )
    assert any(p.name.startswith("lengths-") for p in (sweep / "plots").iterdir())


@pytest.mark.parametrize("case", ["missing_file", "bad_row", "no_template"])
def test_a_bad_dataset_is_one_line_and_exit_2(workdir, demo_data, case):
    chats = workdir / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + "{oops\n")
    tokenizer = demo_data["tokenizer"]
    if case == "no_template":
        import shutil

        tokenizer = workdir / "tok"
        shutil.copytree(demo_data["tokenizer"], tokenizer)
        (tokenizer / "chat_template.jinja").unlink()
    path = workdir / "nope.jsonl" if case == "missing_file" else chats
    proc = run_harness("dry_run=true", "workload=dataset", f"workload.path={path}", f"workload.tokenizer={tokenizer}",
                       f"workload.cache_dir={workdir / 'cache'}", f"hydra.run.dir={workdir / 'run'}", cwd=workdir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error_line(proc)
    needle = {"missing_file": "nope.jsonl", "bad_row": "chats.jsonl:2: not a JSON object",
              "no_template": "has no chat template"}[case]
    assert needle in line, line
    assert load_json(workdir / "run" / "results.json")["status"] == "error"
