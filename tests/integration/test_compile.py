"""backend.compile=true for real: inductor-compiled decoder layers on every wrapper, both layouts, both expert forms.

Each cell runs the standard commands compiled and compares them with the same commands run eagerly
(tests/backend_runs.py; the eager runs are the ones test_precision reads): per-example losses and the gradient norm
must agree (float32: to float32 rounding; bf16: within bf16's), a second budget (other row shapes) must compile
nothing, and what compiling cost is recorded per pass. Inductor generates and compiles C++ for every graph (about a
second each on 2 cores, and a cell compiles 40 to 130), so the cells are the fewest that run every wrapper, both
expert forms, both layouts, both precisions and both pass types (a forward-only pass compiles inference graphs
of its own) at least once:

- pytorch float32, packed rows, forward+backward: the plain model, and the experts as transformers' loop (float32
  has no grouped GEMM);
- fsdp2 bfloat16, packed rows, forward+backward: FSDP2 around the compiled layers at the published setting, with
  torch's grouped GEMM experts (FSDP2's bf16 input cast is what once broke packed rows);
- megatron_ddp bfloat16, padded rows, forward+backward: Megatron DDP around them, the other layout;
- the CLI point below: pytorch float32 packed on the first cell's lengths and budget, forward (the inference
  graphs, compiled there alone) and forward+backward (the first cell's graphs, read from inductor's on-disk cache
  when that cell ran first), as results.json records them. The plain model's bf16 graphs (grouped GEMM experts
  without a wrapper) are in no cell: the two wrapped bf16 cells compile the grouped GEMM.

A wrapper does change the graphs (FSDP2's ranks compile other graphs than the plain model's: none of theirs is
found in the plain model's inductor cache), so each wrapper has its cell. Left out: fsdp2 and megatron_ddp in
float32 (the loop experts under a wrapper: the wrapper's hooks are the ones the bf16 cells run, and their eager
float32 answers are test_precision's and test_distributed's) and padded rows forward-only (a padded batch's
inference graphs: its rows and masks are the forward+backward cell's, without the saved activations). The first
pass over a layout pays the most (each graph compiled for its first shape, then once more with the sizes that
changed made symbolic).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.backend_runs import BUDGETS, COMPILED, LENGTHS, cases
from tests.conftest import run_harness, sweep_results

CELLS = tuple(COMPILED)
RTOL = {"float32": 1e-5, "bfloat16": 1e-2}  # compiled code fuses and reorders: rounding of the dtype, no more


def _losses(result) -> np.ndarray:
    return np.array([o.loss for o in result.outputs])


CELL_IDS = ["-".join(cell) for cell in CELLS]  # pytorch-float32, ...


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
    assert compiled["built"]["compile"]["layers"] == 4 and compiled["built"]["compile"]["dynamic"] == "plan_sizes"
    assert eager["built"]["compile"] is None
    ranks = 1 if backend == "pytorch" else 2
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
        assert first.compile["shape_recompilations"] == 0, (label, first.compile)
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


@pytest.mark.xdist_group("backend_runs-pytorch")  # after the pytorch-float32 cell, on its worker (below)
def test_a_compiled_point_records_its_warm_up_and_timed_compiling(workdir):
    """The CLI: results.json says what was compiled, what the warm-up paid, and that the timed repeats paid nothing.

    The point runs the pytorch-float32 cell's lengths, precision and first budget, so its forward+backward graphs
    are the cell's and come from inductor's on-disk cache when the cell ran first (dynamo still traces and counts
    them); its forward-only graphs (inference: no saved activations) are compiled here and nowhere else.
    """
    lengths = workdir / "lengths.txt"
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    sweep = workdir / "sweep"
    proc = run_harness("-m", "backend=pytorch", "backend.compile=true", "model.dtype=float32", f"mtpm={BUDGETS[0]}",
                       "workload=lengths_file", f"workload.path={lengths}", "bench.repeat=2",
                       "bench.baseline=false", "logger=none", f"hydra.sweep.dir={sweep}", cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (doc,) = sweep_results(sweep)
    assert doc["status"] == "ok" and doc["model"]["built"]["compile"]["scope"] == "decoder_layer"
    assert doc["layout"] == "packed" and doc["precision"]["compute"] == "float32"
    for pass_type in ("forward", "forward_backward"):
        record = doc["passes"][pass_type]["compile"]
        assert record["warmup"]["compilations"] > 0 and record["warmup"]["compile_s"] > 0, record
        assert record["timed"]["compilations"] == 0 and record["timed"]["compile_s"] == 0, record
    assert "torch.compile per decoder layer" in (sweep / "report.md").read_text()
