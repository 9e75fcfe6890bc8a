"""backend.compile's records and refusals, without compiling (tests/integration/test_compile.py compiles for real)."""

from __future__ import annotations

import pytest

from backends.errors import UserError
from backends.model import compiling
from backends.model.build import build_model
from backends.specs import ModelSpec
from balance_batch.integrations.transformers import kernels
from harness.app.config import resolve_config
from tests.unit.test_answer import _compose


def _counters(compilations=0, recompilations=0, backward=0, compile_s=0.0, reasons=None, shape=0, over=None):
    reasons, over = reasons or {}, over or {}
    return {"compilations": compilations, "recompilations": recompilations, "shape_recompilations": shape,
            "backward_compilations": backward, "compile_s": compile_s, "graph_breaks": sum(reasons.values()),
            "graph_break_reasons": reasons, "recompile_limit_hits": len(over), "over_recompile_limit": over}


def test_a_pass_records_what_compiling_cost_inside_it():
    before = _counters(3, 1, 0, 2.0, {"conv": 2})
    after = _counters(10, 4, 2, 9.5, {"conv": 5, "attention": 1}, shape=2,
                      over={"'forward' (x.py:1)": "recompile_limit"})
    assert compiling.delta(before, after) == {
        "compilations": 7, "recompilations": 3, "shape_recompilations": 2, "backward_compilations": 2,
        "graph_breaks": 4, "compile_s": 7.5, "graph_break_reasons": {"conv": 3, "attention": 1},
        "recompile_limit_hits": 1, "over_recompile_limit": ["'forward' (x.py:1)"]}
    # nothing new: every count 0, no reason listed
    assert compiling.delta(after, after)["graph_break_reasons"] == {}


def test_ranks_merge_with_the_slowest_ranks_seconds_and_passes_add_up():
    a = {**compiling.delta(_counters(), _counters(4, 1, 0, 10.0, {"conv": 2})), "traced": {"moe_experts": ["loop"]}}
    b = {**compiling.delta(_counters(), _counters(4, 1, 0, 12.5, {"conv": 2})), "traced": {"moe_experts": ["loop"]}}
    merged = compiling.merge([a, b, None])
    assert merged["compilations"] == 8 and merged["compile_s"] == 12.5 and merged["ranks"] == 2
    assert merged["graph_break_reasons"] == {"conv": 4} and merged["traced"] == {"moe_experts": ["loop"]}
    total = compiling.add(merged, merged)
    assert total["compilations"] == 16 and total["compile_s"] == 25.0 and total["graph_break_reasons"] == {"conv": 8}
    assert compiling.add(None, merged) is merged and compiling.merge([None, None]) is None


def test_a_graph_break_reason_is_one_line_naming_the_skipped_function():
    text = ("Skip calling `torch.compiler.disable()`d function\n  Explanation: Skip calling function "
            "`<function causal_conv1d_fn at 0x7f>` since it was wrapped")
    assert compiling._reason(text) == "Skip calling `torch.compiler.disable()`d function: causal_conv1d_fn"
    assert compiling._reason("Data dependent operator\n  more") == "Data dependent operator"


def test_an_op_traced_into_a_graph_is_recorded_once_and_counted_calls_stay_eager():
    kernels.reset()
    kernels.reset_traced()  # an in-process compiled backend earlier in the session traced its own experts
    kernels.note("attention", "sdpa")
    kernels.note(kernels.COMPILED_LAYER, "inductor")
    assert kernels.snapshot() == {"attention": {"sdpa": 1}, "compiled_layer": {"inductor": 1}}
    kernels._note_traced("moe_experts", "grouped_mm")
    assert kernels.traced()["moe_experts"] == ["grouped_mm"]


@pytest.mark.parametrize("overrides, message", [
    (["backend.compile=true", "gc=true"], "backend.compile: a layer under gradient checkpointing is not compiled"),
    (["backend.compile=true", "bench.warmup=0"], "backend.compile: needs bench.warmup >= 1"),
    (["backend.compile_eager_fallback=true"], "backend.compile_eager_fallback=true: says what a compiled layer may do"),
])
def test_a_compile_the_harness_cannot_honour_is_one_line(overrides, message):
    with pytest.raises(UserError) as caught:
        resolve_config(_compose(*overrides))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_checkpointed_model_is_refused_by_the_backend_too():
    model = build_model(ModelSpec(), __import__("torch").device("cpu"), gradient_checkpointing=True)
    with pytest.raises(ValueError, match="gradient checkpointing"):
        compiling.compile_decoder_layers(model)
    assert compiling.compiled_layers(model) == 0


def test_compiling_wraps_each_decoder_layer_once_and_keeps_the_boundary_kernels_eager():
    import torch

    from balance_batch.integrations.transformers import packing

    model = build_model(ModelSpec(), torch.device("cpu"), gradient_checkpointing=False)
    assert compiling.compile_decoder_layers(model) == 4 == compiling.compile_decoder_layers(model)  # idempotent
    assert compiling.describe(model)["layers"] == 4
    # nothing compiles before the first call (the warm-up pays): building and wrapping cost nothing
    modeling = __import__("sys").modules[type(next(m for m in model.modules()
                                                   if type(m).__name__.endswith("GatedDeltaNet"))).__module__]
    for name in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"):
        assert getattr(getattr(modeling, name), "_torchdynamo_disable", False), name
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert getattr(ALL_ATTENTION_FUNCTIONS[packing.PACKED_PREFIX + "sdpa"], "_torchdynamo_disable", False)


# -- bench.memory_snapshot: the CUDA allocator's history; on this machine (no GPU) a clear refusal ------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["bench.memory_snapshot=true"],
            ("bench.memory_snapshot: records the CUDA allocator's history, and this run's "
             "device is cpu (backend.device=auto, no GPU here)"),
        ),
        (
            ["bench.memory_snapshot=true", "backend.device=cpu"],
            ("bench.memory_snapshot: records the CUDA allocator's "
             "history, and this run's device is cpu (backend.device=cpu)"),
        ),
        (["bench.memory_snapshot=true", "bench.warmup=0"], "bench.memory_snapshot: records during the warm-up"),
        (
            ["bench.memory_snapshot=true", "target.url=http://127.0.0.1:1"],
            "bench.memory_snapshot: records the allocator of ranks this run starts",
        ),
    ],
)
def test_a_memory_snapshot_the_run_cannot_take_is_one_line(overrides, message):
    import torch

    if torch.cuda.is_available() and "device=cpu" not in " ".join(overrides) and "no GPU" in message:
        pytest.skip("this machine has a GPU: the auto device is CUDA")
    with pytest.raises(UserError) as caught:
        resolve_config(_compose(*overrides))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_the_allocator_history_is_refused_off_cuda_and_free_when_not_asked():
    import torch

    from backends.runtime.memory import MemoryHistory

    with MemoryHistory(None, "forward", 0, torch.device("cpu")) as history:  # not asked: nothing recorded
        assert history.path is None
    with pytest.raises(RuntimeError, match="records the CUDA allocator, and this rank runs on cpu"):
        MemoryHistory("/tmp/x", "forward", 0, torch.device("cpu"))
    # on CUDA: Python stacks only (no C++ stack per allocation, no symbolizing under the interpreter lock), in
    # keywords this torch's recorder takes
    import inspect

    from backends.runtime.memory import history_options

    options = history_options()
    assert options["stacks"] == "python" and options["context"] == "all"
    inspect.signature(torch.cuda.memory._record_memory_history).bind(**options)


def test_the_meter_counts_again_after_dynamo_is_reset():
    """A second compiled model in one process (a sweep's next point) resets dynamo, which drops compile callbacks."""
    import torch
    from torch._dynamo.callback import callback_handler

    compiling.METER.install()
    torch._dynamo.reset()
    assert compiling.METER._start not in callback_handler.start_callbacks
    compiling.METER.install()
    assert compiling.METER._start in callback_handler.start_callbacks
    assert compiling.METER._end in callback_handler.end_callbacks
    compiling.METER.install()  # once, however often it is asked
    assert callback_handler.start_callbacks.count(compiling.METER._start) == 1


def test_an_eager_model_records_no_compiling_even_where_another_was_compiled():
    """An eager point after a compiled one in one process (a sweep of backend.compile=true,false) records null."""
    import torch

    device = torch.device("cpu")
    compiled = build_model(ModelSpec(), device, gradient_checkpointing=False)
    compiling.compile_decoder_layers(compiled)
    eager = build_model(ModelSpec(), device, gradient_checkpointing=False)
    with compiling.PassMeter(eager) as meter:
        pass
    assert meter.record is None
    with compiling.PassMeter(compiled) as meter:
        pass
    assert meter.record is not None and meter.record["compilations"] == 0


def test_plan_sizes_are_symbolic_from_the_first_compile_and_a_size_guard_is_counted():
    """Dynamo for real (its eager backend: no code generation): across a graph break, a frame called with the plan's
    sizes named compiles once for rows of any length; unnamed, it compiles again for each new length, and the meter
    counts those as shape recompilations."""
    import torch

    def layer_like(x, boundaries):  # a projection, an eager operation (a graph break), a projection after it
        y = x * 2
        y = torch.compiler.disable(lambda t: t.cumsum(1))(y)
        return (y + boundaries.sum()).relu()

    def calls(marked: bool) -> dict:
        torch._dynamo.reset()
        compiling.METER.install()
        fn = torch.compile(layer_like, backend="eager", dynamic=None)
        before = compiling.measure()
        for tokens, sequences in ((300, 3), (280, 4)):
            x, boundaries = torch.randn(1, tokens, 8), torch.arange(sequences + 1, dtype=torch.int32)
            if marked:
                with compiling._plan_sizes_dynamic((x,), {"cu_seq_lens_q": boundaries}, {0, 1, 8}):
                    fn(x, boundaries)
            else:
                fn(x, boundaries)
        return compiling.delta(before, compiling.measure())

    marked, automatic = calls(True), calls(False)
    if not compiling.NAMES_SIZES:  # torch 2.11: the inputs marked, the frame after the break automatic (2 vs 3)
        assert 0 < marked["shape_recompilations"] < automatic["shape_recompilations"], (marked, automatic)
        torch._dynamo.reset()
        return
    assert torch.compiler.config.dynamic_values == ""  # put back after each call
    assert marked["shape_recompilations"] == 0 and marked["recompilations"] == 0, marked
    assert automatic["shape_recompilations"] >= 2 and automatic["compilations"] > marked["compilations"], automatic
    torch._dynamo.reset()


def test_a_recompile_limit_hit_is_recorded_and_fails_the_pass_unless_allowed():
    """Dynamo for real (its eager backend): past the limit a function runs eagerly without an error; the meter
    counts the hit from dynamo's own warning, the pass fails unless the model allows the fallback, and the limits
    grow with the layers (40 layers of the published model: more than torch's 8 and 256)."""
    import torch

    torch._dynamo.reset()
    compiling.METER.install()
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    model = torch.nn.Linear(1, 1)
    setattr(model, compiling.COMPILED_MODEL, True)
    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(compiling.RecompileLimitHit, match="backend.compile_eager_fallback=true"):
            with compiling.PassMeter(model):
                fn(torch.ones(2))
                fn(torch.ones(2, dtype=torch.float64))  # a dtype guard fails: the second graph is over the limit
        setattr(model, compiling.EAGER_FALLBACK, True)
        again = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
        with compiling.PassMeter(model) as meter:
            again(torch.ones(2))
            again(torch.ones(2, dtype=torch.float64))
            fn(torch.ones(3, dtype=torch.float16))  # over its limit already: eager with no second warning
    record = meter.record
    assert record["recompile_limit_hits"] == 1 and len(record["over_recompile_limit"]) == 2, record
    assert all("<lambda>" in f for f in record["over_recompile_limit"])  # both functions run eagerly from now on
    merged = compiling.merge([record, record])
    assert merged["recompile_limit_hits"] == 2 and merged["over_recompile_limit"] == record["over_recompile_limit"]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        assert compiling.recompile_limits(4) == (compiling.RECOMPILE_LIMIT, 256)
        per_function, accumulated = compiling.recompile_limits(40)
        assert per_function >= 40 * 7 and accumulated >= per_function


def test_a_size_guard_is_told_from_other_guards():
    assert compiling.SHAPE_GUARD.search("5/0: tensor 'a' size mismatch at index 1. expected 658, actual 648")
    assert compiling.SHAPE_GUARD.search("5/0: seq_len == 658")
    assert not compiling.SHAPE_GUARD.search("1/0: len(args) == 2")
    assert not compiling.SHAPE_GUARD.search("0/0: tensor 'args[0]' requires_grad mismatch. expected requires_grad=0")


def test_compiling_in_float32_on_cpu_says_in_one_line_that_it_is_the_slowest_form():
    from harness.point.setup import slow_compile_warning

    line = slow_compile_warning(resolve_config(_compose("backend.compile=true", "backend.device=cpu")))
    assert line and line.startswith("backend.compile=true in float32 on CPU") and "\n" not in line
    assert "model.dtype=bfloat16" in line and "backend.compile=false" in line
    for quiet in (("backend.compile=true", "backend.device=cpu", "model.dtype=bfloat16"),
                  ("backend.device=cpu",), ("backend.compile=true", "backend.device=cpu", "dry_run=true")):
        assert slow_compile_warning(resolve_config(_compose(*quiet))) is None, quiet
