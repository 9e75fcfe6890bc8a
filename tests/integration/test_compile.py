"""backend.compile=true for real: inductor-compiled decoder layers on every wrapper, both layouts, both expert forms.

Each cell runs the standard commands compiled and compares them with the same commands run eagerly
(tests/backend_runs.py; the eager runs are the ones test_precision reads): per-example losses and the gradient norm
must agree (float32: to float32 rounding; bf16: within bf16's), a second budget (other row shapes) must compile
nothing, and what compiling cost is recorded per pass. Inductor generates and compiles C++ for every graph (seconds
each on 2 cores, and a cell compiles 20 to 60), so the cells are the fewest that run every wrapper, both expert
forms, both layouts, both precisions and both pass types (a forward-only pass compiles inference graphs of its
own) at least once:

- pytorch float32, packed rows, forward and forward+backward, from the command line (a hot sweep of both budgets,
  as a user runs it, results.json and example_outputs.json read back): the plain model, the experts as
  transformers' loop (float32 has no grouped GEMM), the inference graphs, and the warm-up / timed split;
- fsdp2 bfloat16, packed rows, forward+backward: FSDP2 around the compiled layers at the published setting, with
  torch's grouped GEMM experts (FSDP2's bf16 input cast is what once broke packed rows);
- megatron_ddp bfloat16, padded rows, forward+backward: Megatron DDP around them, the other layout.

Each wrapper's cell runs on 1 rank (tests/backend_runs.py's COMPILED_RANKS says why) and is compared with its
backend's eager run on 2.

The plain model's bf16 graphs (grouped GEMM experts without a wrapper) are in no cell: the two wrapped bf16 cells
compile the grouped GEMM. A wrapper does change the graphs (FSDP2's ranks compile other graphs than the plain
model's: none of theirs is found in the plain model's inductor cache), so each wrapper has its cell. Left out:
fsdp2 and megatron_ddp in float32 (the loop experts under a wrapper: the wrapper's hooks are the ones the bf16
cells run, and their eager float32 answers are test_precision's and test_distributed's), a wrapper's forward-only
pass (inference graphs: the command-line cell's, around which a wrapper adds only its eager hooks) and padded rows
forward-only (a padded batch's inference graphs: its rows and masks are the forward+backward cell's, without the
saved activations).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from backends.model.compiling import NAMES_SIZES
from tests.backend_runs import BUDGETS, COMPILED, COMPILED_RANKS, LENGTHS, PASS_TYPES, cases
from tests.conftest import load_json, run_harness, sweep_results

CELLS = tuple(COMPILED)
RTOL = {"float32": 1e-5, "bfloat16": 1e-2}  # compiled code fuses and reorders: rounding of the dtype, no more
DYNAMIC = "plan_sizes" if NAMES_SIZES else "marked_inputs"  # what results.json records, by torch's features


def _losses(result) -> np.ndarray:
    return np.array([o.loss for o in result.outputs])


CELL_IDS = ["-".join(cell) for cell in CELLS]  # fsdp2-bfloat16, megatron_ddp-bfloat16


@pytest.mark.parametrize("backend, dtype", CELLS, ids=CELL_IDS)
def test_compiled_layers_give_the_eager_answer_on_every_layout(backend_runs, backend, dtype):
    eager, compiled = backend_runs[backend, dtype, False], backend_runs[backend, dtype, True]
    for key in [(label, budget, p) for label, p in cases(backend, dtype, True) for budget in BUDGETS]:
        got, want = compiled[key], eager[key]
        assert got.plan["layout"] == want.plan["layout"] == key[0]
        np.testing.assert_allclose(_losses(got), _losses(want), rtol=RTOL[dtype], err_msg=str(key))
        if key[2] == "forward_backward":
            assert math.isclose(got.grad_norm, want.grad_norm, rel_tol=10 * RTOL[dtype]), key


@pytest.mark.parametrize("backend, dtype", CELLS, ids=CELL_IDS)
def test_what_compiling_cost_is_recorded_and_new_shapes_compile_nothing(backend_runs, backend, dtype):
    compiled, eager = backend_runs[backend, dtype, True], backend_runs[backend, dtype, False]
    assert compiled["built"]["compile"]["layers"] == 4 and compiled["built"]["compile"]["dynamic"] == DYNAMIC
    assert eager["built"]["compile"] is None
    ranks = COMPILED_RANKS[backend, dtype]
    covered = cases(backend, dtype, True)
    for label, pass_type in covered:
        first = compiled[label, BUDGETS[0], pass_type]
        # every layer call ran compiled code, and the boundary operations eagerly, counted per call
        steps = sum(first.plan["n_microbatches"]) + sum(first.plan.get("n_dummy") or [0])
        assert first.kernels["compiled_layer"] == {"inductor": 4 * steps}, label
        assert set(first.kernels) >= {"attention", "delta_rule", "short_conv", "compiled_layer"}
        assert "moe_experts" not in first.kernels  # inside the graphs: recorded as traced, not per call
        assert first.compile["ranks"] == ranks
        # the plan's sizes were symbolic from each graph's first compile: no graph compiled again for a new size
        # (torch 2.11 marks only the layers' inputs: the frames after a graph break compile once more)
        assert first.compile["shape_recompilations"] == 0 or DYNAMIC != "plan_sizes", (label, first.compile)
        # the experts, as dynamo traced them: torch's grouped GEMM in bf16; transformers' loop in float32
        traced = first.compile["traced"]["moe_experts"]
        assert traced == (["grouped_mm"] if dtype == "bfloat16" else ["grouped_mm-fallback-loop"])
        again = compiled[label, BUDGETS[1], pass_type].compile  # other lengths, same graphs
        assert again["compilations"] == again["recompilations"] == again["backward_compilations"] == 0, \
            (label, pass_type, again)
    # the first pass of all paid for compiling: graphs, seconds, and the graph breaks at the eager operations
    start = compiled[covered[0][0], BUDGETS[0], covered[0][1]].compile
    assert start["compilations"] > 0 and start["compile_s"] > 0 and start["graph_breaks"] > 0
    assert all("disable()" in reason for reason in start["graph_break_reasons"]), start["graph_break_reasons"]
    assert eager[covered[0][0], BUDGETS[0], covered[0][1]].compile is None  # the eager path records nothing


@pytest.mark.xdist_group("backend_runs-pytorch")  # reads the pytorch float32 eager run, made on that worker
def test_a_compiled_hot_sweep_gives_the_eager_answer_and_compiles_only_in_its_first_warm_up(backend_runs, workdir):
    """The plain model's cell, from the command line: pytorch float32, packed rows, both pass types, both budgets.

    A hot sweep (one backend for both points) of the standard commands' lengths: every example's loss of either
    pass type, and the gradient norm, are the eager run's (example_outputs.json); the first point's warm-ups pay for
    compiling (forward: the inference graphs; forward+backward: the training graphs), its timed repeats and the
    second budget's whole point (other row shapes) compile nothing, and results.json and the report say so.
    """
    eager = backend_runs["pytorch", "float32", False]
    lengths = workdir / "lengths.txt"
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    sweep = workdir / "sweep"
    proc = run_harness("-m", "backend=pytorch", "backend.compile=true", "model.dtype=float32",
                       "mtpm=" + ",".join(map(str, BUDGETS)), "hot=true", "workload=lengths_file",
                       f"workload.path={lengths}", "bench.warmup=1", "bench.repeat=1", "bench.save_outputs=true",
                       "bench.baseline=false", "logger=none", f"hydra.sweep.dir={sweep}", cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    docs = sweep_results(sweep)
    assert [d["mtpm"] for d in docs] == list(BUDGETS) and all(d["status"] == "ok" for d in docs)
    assert eager["built"]["compile"] is None
    for point, (doc, budget) in enumerate(zip(docs, BUDGETS)):
        built = doc["model"]["built"]["compile"]
        assert built["scope"] == "decoder_layer" and built["layers"] == 4 and built["dynamic"] == DYNAMIC
        assert doc["layout"] == "packed" and doc["precision"]["compute"] == "float32"
        outputs = load_json(sweep / str(point) / "example_outputs.json")
        steps = sum(doc["plan"]["n_microbatches"])
        assert doc["plan"]["max_tokens_per_microbatch"] == budget
        for pass_type in PASS_TYPES:
            want = eager["packed", budget, pass_type]
            # the hot backend ran the point's own budget (switched through its control file): the eager run's plan
            assert doc["plan"]["n_microbatches"] == want.plan["n_microbatches"], (budget, pass_type)
            np.testing.assert_allclose(outputs[pass_type]["loss"], _losses(want), rtol=RTOL["float32"],
                                       err_msg=f"{budget} {pass_type}")
            record = doc["passes"][pass_type]
            # every layer call ran compiled code, and the boundary operations eagerly, counted per call
            assert record["kernels"]["compiled_layer"] == {"inductor": 4 * steps}, (budget, pass_type)
            assert {"attention", "delta_rule", "short_conv"} <= set(record["kernels"])
            assert "moe_experts" not in record["kernels"]  # inside the graphs: recorded as traced, not per call
            warm, timed = record["compile"]["warmup"], record["compile"]["timed"]
            assert timed["compilations"] == timed["backward_compilations"] == timed["compile_s"] == 0, timed
            if point == 0:  # compiled in the warm-up, each graph once, symbolic in the plan's sizes from the start
                assert warm["compilations"] > 0 and warm["compile_s"] > 0 and warm["graph_breaks"] > 0, warm
                assert warm["shape_recompilations"] == 0 or DYNAMIC != "plan_sizes", warm
                assert all("disable()" in reason for reason in warm["graph_break_reasons"]), warm
                # the experts as dynamo traced them: float32 has no grouped GEMM, transformers' loop
                assert warm["traced"]["moe_experts"] == ["grouped_mm-fallback-loop"], warm
            else:  # other lengths, the same graphs
                assert warm["compilations"] == warm["recompilations"] == warm["backward_compilations"] == 0, warm
        want_norm = eager["packed", budget, "forward_backward"].grad_norm
        assert math.isclose(outputs["forward_backward"]["grad_norm"], want_norm, rel_tol=10 * RTOL["float32"]), budget
    assert "torch.compile per decoder layer" in (sweep / "report.md").read_text()
