"""Packed rows: the stock fallbacks leak across sequences; ours give what each sequence gives alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from backends.model.build import build_model
from backends.model.packing import collate_packed
from backends.model.step import grad_norm_local_sq, run_schedule, total_loss_weight
from backends.specs import ModelSpec
from balance_batch.integrations.transformers.packing import (
    _PACKED_MARK,
    is_prepared_for_packing,
    prepare_model_for_packing,
)
from balance_batch.integrations.transformers.segments import segment_causal_conv1d, segment_chunk_gated_delta_rule
from harness.data.workload import make_examples

CPU = torch.device("cpu")
MODELING = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
# Shorter than the conv kernel (4), on and around the delta rule's chunk (64), several chunks.
LENGTHS = [70, 1, 3, 130, 2, 64, 17, 65]
REL = 1e-5  # per-example losses, log-probs and the gradient norm agree to this (packed = padded)
# Per parameter: the delta-net decay parameters (A_log, dt_bias) of the full model have
# gradients of ~1e-5 made of cancelling terms; the stock padded path itself differs
# from mbs=1 there by 2e-5 relative (packed: 1.6e-5), so per-parameter grads get 1e-4.
REL_PER_PARAMETER = 1e-4


def stock(name: str):
    """transformers' own function, whether or not this process has already swapped it."""
    import importlib

    fn = getattr(importlib.import_module(MODELING), name)
    return getattr(fn, _PACKED_MARK, fn)


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- the leak, in transformers 5.24 as shipped


def test_stock_convolution_leaks_across_a_packed_boundary():
    torch.manual_seed(0)
    lengths = [6, 5]
    x = torch.randn(1, 8, sum(lengths))
    w = torch.randn(8, 4)
    packed = stock("causal_conv1d_fn")(x, w, None, activation="silu", cu_seq_lens_q=cu_seqlens(lengths))
    second_alone = stock("causal_conv1d_fn")(x[..., 6:], w, None, activation="silu")
    assert rel_err(packed[..., 6:], second_alone) > 1e-2  # the boundary is ignored: the tail of 1 reaches 2
    ours = segment_causal_conv1d(x, w, None, "silu", cu_seqlens(lengths))
    assert rel_err(ours[..., 6:], second_alone) < REL


def test_stock_delta_rule_refuses_boundaries_and_leaks_without_them():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 8) for _ in range(3))
    g, beta = -torch.rand(1, 20, 2), torch.rand(1, 20, 2)
    with pytest.raises(ValueError, match="packed sequences"):
        stock("torch_chunk_gated_delta_rule")(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens([12, 8]))
    row, _ = stock("torch_chunk_gated_delta_rule")(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    alone, _ = stock("torch_chunk_gated_delta_rule")(
        q[:, 12:], k[:, 12:], v[:, 12:], g=g[:, 12:], beta=beta[:, 12:], use_qk_l2norm_in_kernel=True
    )
    assert rel_err(row[:, 12:], alone) > 1e-2  # the recurrent state carries over


def test_stock_model_given_a_packed_row_leaks():
    model = build_model(ModelSpec(lora_rank=0, init_seed=3), CPU, False)  # not prepared
    ex = make_examples([40, 9], 2048, seed=0)
    batch = collate_packed(ex, [0, 1], CPU)
    with torch.no_grad():
        # what works for plain transformers models: restarting position ids (attention is masked per sequence)
        row = model(input_ids=batch.ids, position_ids=batch.position_ids).logits[0, 40:]
        alone = model(input_ids=batch.ids[:, 40:]).logits[0]
    assert rel_err(row, alone) > 1e-3


# ---------------------------------------------------------------- the segment-aware pieces alone


@pytest.mark.parametrize("lengths", [LENGTHS, LENGTHS[::-1], [1], [3, 1, 2]])
def test_segment_convolution_equals_each_sequence_alone(lengths):
    torch.manual_seed(1)
    x = torch.randn(1, 12, sum(lengths), requires_grad=True)
    w = torch.randn(12, 4, requires_grad=True)
    ours = segment_causal_conv1d(x, w, None, "silu", cu_seqlens(lengths))
    bounds = cu_seqlens(lengths).tolist()
    alone = torch.cat(
        [stock("causal_conv1d_fn")(x[..., s:e], w, None, activation="silu") for s, e in zip(bounds, bounds[1:])], -1
    )
    assert rel_err(ours, alone) < REL
    up = torch.randn_like(ours)
    g_ours = torch.autograd.grad((ours * up).sum(), (x, w))
    g_alone = torch.autograd.grad((alone * up).sum(), (x, w))
    for a, b in zip(g_ours, g_alone):
        assert rel_err(a, b) < REL


@pytest.mark.parametrize("lengths", [LENGTHS, LENGTHS[::-1], [1], [200, 3]])
def test_segment_delta_rule_equals_each_sequence_alone(lengths):
    torch.manual_seed(2)
    total = sum(lengths)
    leaves = [torch.randn(1, total, 2, 8), torch.randn(1, total, 2, 8), torch.randn(1, total, 4, 8),
              -F.softplus(torch.randn(1, total, 4)), torch.rand(1, total, 4)]
    for t in leaves:
        t.requires_grad_(True)
    q, k, v, g, beta = leaves
    ours = segment_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens(lengths), use_qk_l2norm_in_kernel=True)
    bounds = cu_seqlens(lengths).tolist()
    alone = torch.cat([
        stock("torch_chunk_gated_delta_rule")(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                              use_qk_l2norm_in_kernel=True)[0]
        for s, e in zip(bounds, bounds[1:])
    ], 1)
    assert rel_err(ours, alone) < REL
    up = torch.randn_like(ours)
    g_ours = torch.autograd.grad((ours * up).sum(), leaves)
    g_alone = torch.autograd.grad((alone * up).sum(), leaves)
    for a, b in zip(g_ours, g_alone):
        assert rel_err(a, b) < REL


def test_collate_lays_sequences_end_to_end():
    ex = make_examples([3, 1, 2], 2048, seed=0)
    b = collate_packed(ex, [2, 0, 1], CPU)
    assert b.ids.shape == (1, 6) and b.lengths == [2, 3, 1] and b.max_length == 3
    assert b.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
    assert b.cu_seqlens.tolist() == [0, 2, 5, 6] and b.cu_seqlens.dtype == torch.int32
    assert b.ids[0, 2:5].tolist() == ex[0].input_ids.tolist()
    assert [t.tolist() for t in b.split(b.weights)] == [
        ex[2].weights.tolist(),
        ex[0].weights.tolist(),
        ex[1].weights.tolist(),
    ]
    dummy = collate_packed(ex, None, CPU)
    assert dummy.lengths == [1] and float(dummy.weights.sum()) == 0.0


# ---------------------------------------------------------------- the model: packed == alone == padded


def _run(model, examples, schedule, layout, pass_type="forward_backward"):
    model.zero_grad(set_to_none=True)
    outputs = run_schedule(model, examples, schedule, pass_type, total_loss_weight(examples), CPU, layout=layout)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return outputs, grads, math.sqrt(grad_norm_local_sq(model))


def _assert_same(result, reference, n_examples):
    outputs, grads, norm = result
    ref_outputs, ref_grads, ref_norm = reference
    assert sorted(outputs) == list(range(n_examples))
    for i in range(n_examples):
        assert math.isclose(outputs[i].loss, ref_outputs[i].loss, rel_tol=REL, abs_tol=1e-6)
        assert rel_err(torch.from_numpy(outputs[i].logprobs), torch.from_numpy(ref_outputs[i].logprobs)) < REL
    if ref_grads:
        assert math.isclose(norm, ref_norm, rel_tol=REL) and ref_norm > 0
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            assert rel_err(grads[name], ref_grads[name]) < REL_PER_PARAMETER, name


@pytest.fixture
def one_thread():
    """One intra-op thread: the summation order of every reduction is then the same for every layout.

    The decay parameters' gradients are sums of cancelling terms; on a 2-core AMD EPYC a reduction split over
    2 threads moved the padded batch's dt_bias gradient by 0.4% relative against mbs=1 (the gradient norm
    still agreed to 1e-5), which is the thread split, not the layout. One thread compares the layouts alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("lora_rank, checkpointing", [(0, False), (8, False), (8, True)])
def test_packed_rows_equal_each_sequence_alone_and_padded(lora_rank, checkpointing, one_thread):
    model = build_model(ModelSpec(lora_rank=lora_rank), CPU, checkpointing)
    examples = make_examples(LENGTHS, 2048, seed=5)
    n = len(examples)
    alone = _run(model, examples, [[i] for i in range(n)], "padded")  # mbs = 1, the reference
    _assert_same(_run(model, examples, [list(range(n))], "padded"), alone, n)
    _assert_same(_run(model, examples, [list(range(n))], "packed"), alone, n)
    # a boundary leak would change the losses of a reversed pack; and dummies change nothing
    _assert_same(_run(model, examples, [list(range(n))[::-1]], "packed"), alone, n)
    _assert_same(_run(model, examples, [[7, 1, 2], None, [4, 0, 6, 5, 3]], "packed"), alone, n)


def test_packed_forward_and_a_rank_with_only_dummies():
    model = build_model(ModelSpec(lora_rank=8), CPU, False)
    examples = make_examples(LENGTHS, 2048, seed=6)
    n = len(examples)
    _assert_same(_run(model, examples, [list(range(n))], "packed", "forward"),
                 _run(model, examples, [[i] for i in range(n)], "padded", "forward"), n)
    outputs, grads, norm = _run(model, examples, [None, None], "packed")
    assert outputs == {} and norm == 0.0 and grads  # the dummy ran the model: every rank joins each step


def test_a_built_model_is_prepared_and_preparing_again_changes_nothing():
    """build_model prepares every model (both layouts then run the same kernels, recorded); preparing is idempotent.
    That the padded path still gives transformers' own answer is the oracle comparison of test_kernels.py, beside
    this file."""
    examples = make_examples([40, 9, 3], 2048, seed=7)
    model = build_model(ModelSpec(lora_rank=8), CPU, False)
    assert is_prepared_for_packing(model)
    a = _run(model, examples, [[0, 1, 2]], "padded")
    assert prepare_model_for_packing(model) is model and is_prepared_for_packing(model)
    b = _run(model, examples, [[0, 1, 2]], "padded")
    for i in range(3):
        assert np.array_equal(a[0][i].logprobs, b[0][i].logprobs)
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_unknown_layout_is_refused():
    model = build_model(ModelSpec(lora_rank=0), CPU, False)
    with pytest.raises(ValueError, match="layout"):
        run_schedule(model, make_examples([4], 2048, 0), [[0]], "forward", 1.0, CPU, layout="ragged")


def test_packing_survives_fully_shard(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from backends.model.build import decoder_layers

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_model(ModelSpec(lora_rank=8), CPU, True)
        examples = make_examples(LENGTHS, 2048, seed=8)
        n = len(examples)
        reference = _run(model, examples, [[i] for i in range(n)], "padded")
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        prepare_model_for_packing(model)
        assert is_prepared_for_packing(model)
        result = _run(model, examples, [list(range(n))[::-1], None], "packed")
        local = lambda g: g.to_local() if hasattr(g, "to_local") else g  # noqa: E731
        _assert_same((result[0], {k: local(v) for k, v in result[1].items()}, result[2]), reference, n)
    finally:
        dist.destroy_process_group()


def test_a_packed_row_builds_no_attention_mask(monkeypatch):
    # A mask over the row would cost (Σ lengths)²; the packed attention needs none.
    import importlib

    modeling = importlib.import_module(MODELING)

    def no_mask_please(*args, **kwargs):
        raise AssertionError("a packed row must not build a dense attention mask")

    model = prepare_model_for_packing(build_model(ModelSpec(lora_rank=0), CPU, False))
    batch = collate_packed(make_examples([30, 20], 2048, seed=0), [0, 1], CPU)
    monkeypatch.setattr(modeling, "create_causal_mask", no_mask_please)
    with torch.no_grad():
        model(input_ids=batch.ids, **batch.model_kwargs())
        kwargs = batch.model_kwargs()
        del kwargs["attention_mask"]  # what position ids alone would do
        with pytest.raises(AssertionError, match="dense attention mask"):
            model(input_ids=batch.ids, **kwargs)


def test_eager_attention_models_pack_too():
    model = build_model(ModelSpec(lora_rank=0, attn_implementation="eager"), CPU, False)
    examples = make_examples(LENGTHS, 2048, seed=9)
    n = len(examples)
    alone = _run(model, examples, [[i] for i in range(n)], "padded", "forward")
    packed = _run(model, examples, [list(range(n))[::-1]], "packed", "forward")
    assert model.config._attn_implementation == "packed_eager"
    _assert_same(packed, alone, n)
