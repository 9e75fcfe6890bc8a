"""The cap on sequences per micro-batch (max_seqs_per_microbatch) in-process: the knob, a pass in bf16, and every
record of it.

Dry runs through the CLI: tests/integration/test_harness_cli.py; a server and its client:
tests/integration/test_serve.py; spawned ranks: tests/integration/test_distributed.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backends.errors import UserError
from backends.messages import make_command
from backends.specs import BackendSpec, ModelSpec
from balance_batch.stats import lower_bound_steps
from harness.app.config import composition_error_line, register_configs, resolve_config, validate
from tests.conftest import CONF, REPO
from tests.loss_oracle import tiny_examples

COMMITTED = REPO / "reports" / "results" / "cpu-2rank-tiny"


def _resolved(*overrides: str):
    """The config as ``python -m harness`` composes and checks it; a bad value raises the one line the CLI prints."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            cfg = compose("config", overrides=["dry_run=true", *overrides])
        except HydraException as exc:  # what harness/app/cli.py turns into its one error line
            raise UserError(composition_error_line(exc)) from None
    return cfg, resolve_config(cfg)


@pytest.mark.parametrize("value, valid", [("0", "a positive integer or null"), ("-1", "a positive integer or null"),
                                          ("true", "could not be converted to Integer"),
                                          ("abc", "could not be converted to Integer")])
def test_a_bad_cap_is_one_line_naming_the_key_and_what_is_valid(value, valid):
    with pytest.raises(UserError) as info:
        _resolved(f"max_seqs_per_microbatch={value}")
    message = str(info.value)
    assert message.startswith("max_seqs_per_microbatch: ") and valid in message and "\n" not in message, message


def test_true_is_no_cap_of_one_even_where_the_schema_is_not_asked():
    """bool is an int in Python: a config built in code with True must not plan one sequence per micro-batch."""
    _, spec = _resolved()
    spec.backend.max_seqs_per_microbatch = True
    with pytest.raises(UserError, match=r"^max_seqs_per_microbatch: must be a positive integer or null, got True$"):
        validate(spec)


def test_the_knob_reaches_the_backend_config_and_the_record():
    from harness.point.results import base_document

    cfg, spec = _resolved("max_seqs_per_microbatch=3")
    assert spec.max_seqs_per_microbatch == spec.backend.max_seqs_per_microbatch == 3
    assert base_document(cfg, [])["max_seqs_per_microbatch"] == 3
    cfg, spec = _resolved()
    assert spec.backend.max_seqs_per_microbatch is None and base_document(cfg, [])["max_seqs_per_microbatch"] is None


def test_run_names_say_the_cap_only_when_there_is_one():
    from harness.point.tracking import run_name

    assert run_name("fsdp2", 4096, 1) == "fsdp2-mtpm4096"  # the names runs always had
    assert run_name("fsdp2", 4096, 1, "balanced", "packed") == "fsdp2-mtpm4096-balanced-packed"
    assert run_name("fsdp2", 4096, 1, "balanced", "packed", 8) == "fsdp2-mtpm4096-balanced-packed-seqs8"
    assert run_name("pytorch", None, 4, max_seqs=2) == "pytorch-mbs4-seqs2"


def test_the_hot_backend_is_reused_across_caps():
    """The cap rides in every pass's command, so changing it between points must not reload the model."""
    from dataclasses import replace

    from harness.sweep.hot import HotBackends

    hot, spec = HotBackends(), BackendSpec(name="pytorch", device="cpu")
    try:
        first = hot.get(spec, ModelSpec())
        assert hot.get(replace(spec, max_seqs_per_microbatch=2), ModelSpec()) is first
    finally:
        hot.close()


# --- a real pass: batching never changes the answer, in the published precision ------------------------------------
# float32 against the hand-computed oracle: tests/unit/test_loss_oracle.py ("mtpm=30 balanced packed ≤2 seqs").

BF16_RTOL = 3e-2  # as tests/integration/test_precision.py: bf16 keeps 8 bits of mantissa
EXAMPLES = tiny_examples()
PACKED = {"planner": "balanced", "layout": "packed"}


@pytest.fixture(scope="module")
def bf16():
    """A bf16 backend and its uncapped balanced packed pass (mtpm=30 puts 3+ sequences in a row)."""
    from backends.pytorch import PyTorchBackend

    b = PyTorchBackend(BackendSpec(device="cpu"), ModelSpec(dtype="bfloat16"))
    try:
        free = b.run_pass(make_command("forward_backward", EXAMPLES, 30, 1, **PACKED))
        assert free.plan["max_microbatch_size"] > 2 and free.plan["max_seqs_per_microbatch"] is None
        yield b, free
    finally:
        b.close()


@pytest.mark.parametrize(
    "mtpm, options", [(30, PACKED), (28, {})], ids=["balanced packed mtpm=30", "greedy padded mtpm=28"]
)
def test_a_capped_bf16_pass_gives_the_uncapped_answer_and_keeps_the_cap(bf16, mtpm, options):
    b, free = bf16
    capped = b.run_pass(make_command("forward_backward", EXAMPLES, mtpm, 1, max_seqs_per_microbatch=2, **options))
    assert capped.plan["max_microbatch_size"] == 2 and capped.plan["max_seqs_per_microbatch"] == 2
    lengths = [len(e) for e in EXAMPLES]
    assert capped.plan["lower_bound_steps"] == lower_bound_steps(lengths, 1, mtpm, 1, max_seqs=2) == 3
    np.testing.assert_allclose([o.loss for o in capped.outputs], [o.loss for o in free.outputs], rtol=BF16_RTOL)
    assert capped.grad_norm > 0 and capped.grad_norm == pytest.approx(free.grad_norm, rel=5e-2)


def test_without_a_budget_the_cap_narrows_fixed_slices():
    """mtpm=null: slices of min(mbs, cap) sequences, as every rank plans them from the command."""
    command = make_command("forward", EXAMPLES, None, 4, max_seqs_per_microbatch=2)
    assert [len(b) for b in command.plan(1, lockstep=False).schedules[0]] == [2, 2, 2]
    assert [len(b) for b in command.replace(max_seqs_per_microbatch=None).plan(1, lockstep=False).schedules[0]] == [
        4,
        2,
    ]


# --- reports: old results read as no cap and render as they always did ---------------------------------------------


def _ok_doc() -> dict:
    return json.loads((COMMITTED / "0" / "results.json").read_text())


def _frame(tmp_path: Path, docs: dict):
    from reports.collect import collect

    for name, doc in docs.items():
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "results.json").write_text(json.dumps(doc))
    return collect([tmp_path])


def test_results_without_the_cap_render_as_before_and_a_capped_row_says_its_cap(tmp_path):
    from reports.render import fastest_lines, markdown_tables

    old = _ok_doc()  # a point of the committed sweep, as written before the cap existed (no key at all)
    old.pop("max_seqs_per_microbatch", None)
    old["plan"].pop("max_seqs_per_microbatch", None)
    before = _frame(tmp_path / "old", {"0": old})
    assert before["max_seqs_per_microbatch"].isna().all()
    table = markdown_tables(before)
    assert "max seqs" not in table and "seqs" not in " ".join(fastest_lines(before))

    faster = {**old["passes"]["forward_backward"], "tok_per_s": 2 * old["passes"]["forward_backward"]["tok_per_s"]}
    capped = {**old, "mtpm": 4096, "planner": "balanced", "layout": "packed", "max_seqs_per_microbatch": 8,
              "plan": {**old["plan"], "planner": "balanced", "layout": "packed"},
              "passes": {**old["passes"], "forward_backward": faster}}  # the fastest line names the capped row
    both = _frame(tmp_path / "new", {"0": old, "1": capped})
    assert list(both["max_seqs_per_microbatch"].fillna(0)) == [0, 8]
    table = [block for block in markdown_tables(both).split("\n\n") if block.startswith("|")][-1]
    header, _, *rows = table.splitlines()
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[cells.index("layout") + 1] == "max seqs"
    assert [[c.strip() for c in r.strip("|").split("|")][cells.index("max seqs")] for r in rows] == ["—", "8"]
    assert any("set mtpm=4,096 max_seqs_per_microbatch=8 (balanced, packed)" in line for line in fastest_lines(both))


def test_the_plan_figure_title_says_the_cap_only_when_there_is_one():
    from balance_batch import plan_step
    from reports.plan_blocks import plan_blocks
    from reports.plan_figure import describe
    from reports.plan_json import plan_json

    lengths = [len(e) for e in EXAMPLES]

    def title(cap):
        plan = plan_step(lengths, world_size=2, max_tokens_per_microbatch=30, layout="packed", planner="greedy",
                         lockstep=False, max_seqs_per_microbatch=cap)
        return describe(plan_blocks(plan_json(plan)))[0]

    free, capped = title(None), title(2)
    assert capped == [*free, "≤ 2 sequences / micro-batch"] and not any("sequences" in t for t in free)
