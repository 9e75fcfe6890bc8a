"""Kernels on record: what ran is counted as it runs, both layouts get the same fallbacks, CPU tensors never reach a
GPU kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.model.build import build_model
from backends.model.packing import collate_packed, model_layer_types
from backends.model.step import outputs_to_host, run_steps
from backends.specs import ModelSpec
from balance_batch.integrations.transformers import kernels, packing, segments
from harness.data.workload import make_examples

CPU = torch.device("cpu")
EXAMPLES = make_examples([130, 70, 200, 9], 2048, seed=3)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelSpec(), CPU, False)


def _run(model, layout: str, chunk=1024, pass_type="forward_backward"):
    pending = run_steps(model, EXAMPLES, [[0, 1], [2, 3]], pass_type, 100.0, CPU, layout=layout,
                        logprob_chunk_tokens=chunk)
    return kernels.snapshot(), outputs_to_host(pending, EXAMPLES)


def test_each_layout_records_what_ran_and_both_run_the_same_scan_and_convolution(model):
    padded, _ = _run(model, "padded")
    packed, _ = _run(model, "packed")
    n_linear = sum(t == "linear_attention" for t in model.config.layer_types)
    n_full = len(model.config.layer_types) - n_linear
    steps = 2
    # Padded rows run SDPA over the batch with its mask; a packed row SDPA once per sequence.
    assert padded["attention"] == {kernels.SDPA: n_full * steps}
    assert packed["attention"] == {kernels.SDPA_PER_SEQUENCE: n_full * steps}
    for record in (padded, packed):
        # The same fallbacks for both layouts: the project's scan and torch's convolution, once per layer and step.
        assert record["delta_rule"] == {kernels.SEGMENT_SCAN: n_linear * steps}
        assert record["short_conv"] == {kernels.TORCH_CONV1D: n_linear * steps}
        assert record["logprob_head"] == {"chunked-1024": steps}
        # torch's grouped GEMM (gate-up and down) in every MoE layer, on this torch
        assert sum(record["moe_experts"].values()) == 2 * len(model.config.layer_types) * steps
    full, _ = _run(model, "padded", chunk=None)
    assert full["logprob_head"] == {"full-logits": steps}


def test_padded_rows_through_the_scan_give_the_stock_answer(model):
    """The padded delta rule runs the project's scan, each row one segment: the numbers of transformers' own
    functions, one sequence at a time (the oracle restores them while it runs)."""
    from tests.loss_oracle import oracle

    _, ours = _run(model, "padded")
    expected = oracle(EXAMPLES)
    for i in range(len(EXAMPLES)):
        np.testing.assert_allclose(ours[i].loss, expected["losses"][i], rtol=1e-5)
        np.testing.assert_allclose(ours[i].logprobs, expected["logprobs"][i], rtol=1e-4, atol=1e-5)


def test_merge_sums_calls_over_ranks():
    a = {"attention": {"sdpa": 2}, "delta_rule": {"segment-scan": 6}}
    b = {"attention": {"sdpa": 1, "sdpa-per-sequence": 3}}
    assert kernels.merge([a, b, None]) == {
        "attention": {"sdpa": 3, "sdpa-per-sequence": 3}, "delta_rule": {"segment-scan": 6}}
    assert kernels.summary(kernels.merge([a, b])) == "attention=sdpa+sdpa-per-sequence, delta_rule=segment-scan"


class _TritonOnly:
    """Stands in for transformers' module function bound to a GPU kernel when fla / causal-conv1d import on a
    GPU host: calling it at all is the failure (no such kernel exists on this machine); ``__wrapped__`` is the
    torch function, as transformers' dispatch wrapper has it."""

    def __init__(self, torch_function):
        self.__wrapped__ = torch_function
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("CPU tensors reached a GPU kernel")


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cpu_tensors_never_reach_a_gpu_kernel_even_where_the_kernel_packages_import(model, monkeypatch, layout):
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as modeling

    from tests.loss_oracle import stock_transformers

    with stock_transformers():
        stock_conv, stock_rule = modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule
    reference, expected = _run(model, layout)
    bound = {"causal_conv1d_fn": _TritonOnly(stock_conv.__wrapped__),
             "torch_chunk_gated_delta_rule": _TritonOnly(stock_rule.__wrapped__)}
    # a GPU host: the packages import, and transformers bound its module functions to their kernels
    monkeypatch.setattr(packing, "_cuda_kernel_available", lambda name: True)
    for name, fake in bound.items():
        monkeypatch.setattr(modeling, name, packing._MODULE_FUNCTIONS[name](fake))
    record, got = _run(model, layout)
    assert all(f.calls == 0 for f in bound.values())
    assert record["delta_rule"] == reference["delta_rule"] and record["short_conv"] == reference["short_conv"]
    for i in range(len(EXAMPLES)):
        np.testing.assert_allclose(got[i].loss, expected[i].loss, rtol=1e-6)


def test_a_packed_row_reads_its_bounds_from_the_host_not_the_device(model):
    """Each layer used to call cu_seqlens.tolist() (a device-to-host sync per layer on CUDA); now collate's copy
    serves."""
    from torch.overrides import TorchFunctionMode

    batch = collate_packed(EXAMPLES, [0, 1, 2], CPU)
    reads = []

    class CountReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.tolist, torch.Tensor.item) and args and args[0] is batch.cu_seqlens:
                reads.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), CountReads():
        model(input_ids=batch.ids, use_cache=False, **batch.model_kwargs(model_layer_types(model)))
    assert reads == []
    assert segments.host_bounds(batch.cu_seqlens) == [0, 130, 200, 400]


class _FlaRecorder:
    """Stands in for transformers' delta rule bound to fla's kernel on a GPU host: records the boundary tensors each
    layer hands it, returns zeros of the output's shape."""

    def __init__(self, torch_function):
        self.__wrapped__ = torch_function
        self.seen: list = []

    def __call__(self, query, key, value, **kwargs):
        self.seen.append((kwargs.get("cu_seqlens"), kwargs.get("cu_seqlens_cpu")))
        return torch.zeros_like(value), None


def test_fla_gets_the_same_int64_bounds_from_every_layer_of_a_micro_batch(model, monkeypatch):
    """fla caches its chunk indices by the boundary tensors it is given: a new ``cu_seqlens.long()`` per layer missed
    that cache, and each layer recomputed them from device counts (a device-to-host copy per layer, forward and
    backward). Every linear-attention layer of one micro-batch must hand fla the same int64 tensor and host copy."""
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as modeling

    from tests.loss_oracle import stock_transformers

    with stock_transformers():
        stock_rule = modeling.torch_chunk_gated_delta_rule
    fla = _FlaRecorder(stock_rule.__wrapped__)
    monkeypatch.setattr(packing, "_fla_runs", lambda query, bound: True, raising=False)  # a GPU host with fla
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule",
                        packing._MODULE_FUNCTIONS["torch_chunk_gated_delta_rule"](fla))
    layers = sum(type(m).__name__.endswith("GatedDeltaNet") for m in model.modules())
    for rows, bounds in (([0, 1, 2], [0, 130, 200, 400]), ([3], [0, 9])):
        batch = collate_packed(EXAMPLES, rows, CPU)
        fla.seen.clear()
        with torch.no_grad():
            model(input_ids=batch.ids, use_cache=False, **batch.model_kwargs(model_layer_types(model)))
        assert layers >= 2 and len(fla.seen) == layers, (layers, len(fla.seen))
        device, host = fla.seen[0]
        assert all(d is device and h is host for d, h in fla.seen)
        assert device.dtype == host.dtype == torch.int64 and host.device.type == "cpu"
        assert device.tolist() == host.tolist() == bounds


def test_a_plain_dict_of_masks_survives_a_rebuild_as_fsdp2s_input_cast_does(model):
    """FSDP2's mixed-precision cast rebuilds every dict as a plain dict: the masks must be one already."""
    batch = collate_packed(EXAMPLES, [0, 1], CPU)
    kwargs = batch.model_kwargs(model_layer_types(model))
    masks = kwargs["attention_mask"]
    assert (
        type(masks) is dict and set(masks) == set(model.config.layer_types) and all(v is None for v in masks.values())
    )
    rebuilt = {k: v for k, v in masks.items()}  # what torch's _apply_to_tensors does to a dict
    with torch.no_grad():
        out = model(input_ids=batch.ids, use_cache=False, **{**kwargs, "attention_mask": rebuilt}).logits
    assert out.shape[:2] == (1, 200)


def test_missing_cuda_kernels_warn_or_stop_before_loading():
    none = lambda name: False  # noqa: E731
    lines = kernels.check_cuda_kernels("cuda", require=False, available=none)
    assert [line.split()[0] for line in lines] == ["flash-attn", "flash-linear-attention", "causal-conv1d"]
    assert all("does not import" in line and "pip install" in line for line in lines)
    with pytest.raises(kernels.MissingKernels, match="backend.require_kernels=true: flash-attn does not import"):
        kernels.check_cuda_kernels("cuda", require=True, available=none)
    assert kernels.check_cuda_kernels("cuda", require=True, available=lambda name: True) == []
    # the CPU runs the torch paths: nothing is missing there
    assert kernels.check_cuda_kernels("cpu", require=True, available=none) == []


def test_attention_is_chosen_once_for_both_layouts():
    has_all = lambda name: True  # noqa: E731
    assert kernels.attention_implementation(None, "cuda", True, available=has_all) == "flash_attention_2"
    assert kernels.attention_implementation(None, "cuda", False, available=has_all) == "sdpa"  # flash-attn is half only
    assert kernels.attention_implementation(None, "cuda", True, available=lambda name: False) == "sdpa"
    assert kernels.attention_implementation(None, "cpu", True, available=has_all) == "sdpa"
    assert kernels.attention_implementation("eager", "cuda", True, available=has_all) == "eager"


def test_the_record_follows_what_transformers_bound_at_import_not_what_imports_now(monkeypatch):
    """transformers binds a kernel package's function (or its own torch one) once, when its modeling module is
    imported; a package that imports now but was not bound then does not run, so it is not what a pass records."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    def reference(x):
        return x

    # transformers' own wrapper, bound to a package function that exists (math.sqrt) and to one that does not
    bound = use_kernel_func_from_hub_with_fallback("sqrt", "math")(reference)
    unbound = use_kernel_func_from_hub_with_fallback("sqrt", "no_such_kernel_package")(reference)
    assert kernels.transformers_bound_kernel(bound) is True
    assert kernels.transformers_bound_kernel(unbound) is False
    assert kernels.transformers_bound_kernel(reference) is None  # no wrapper: the import check decides
    # the dispatch's choice for CUDA tensors, where the package imports today
    monkeypatch.setattr(packing, "_cuda_kernel_available", lambda name: True)
    assert packing._runs_kernel(kernels.transformers_bound_kernel(unbound), "fla") is False
    assert packing._runs_kernel(kernels.transformers_bound_kernel(bound), "fla") is True
    assert packing._runs_kernel(None, "fla") is True
    # this machine's modeling module: transformers' wrappers, read (a change of their form would fail here, not
    # silently fall back to the import check); a package that does not import here was not bound
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as modeling

    from tests.loss_oracle import stock_transformers

    with stock_transformers():
        for name, package in (("torch_chunk_gated_delta_rule", "fla"), ("causal_conv1d_fn", "causal_conv1d")):
            got = kernels.transformers_bound_kernel(getattr(modeling, name))
            assert isinstance(got, bool), name
            if not kernels.package_imports(package):
                assert got is False, name
