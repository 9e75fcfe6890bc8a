"""Chunked target log-probs: same values and gradients as full logits, and no [tokens × vocab] tensor ever."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from backends.model.build import build_model
from backends.model.logprobs import TokenLogprobHead, chunked_target_logprobs, find_logprob_head
from backends.model.step import token_logprobs
from backends.specs import ModelSpec

CPU = torch.device("cpu")
VOCAB = 2048


class LargestTensor(TorchDispatchMode):
    """Records the most elements any op produced while active (forward and, on CPU, backward: same thread)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _inputs(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    targets = torch.randint(0, VOCAB, (batch, length), generator=g)
    weights = torch.rand((batch, length), generator=g)
    return ids, targets, weights


def _loss_and_grads(model, ids, targets, weights, chunk_tokens, **kwargs):
    model.zero_grad(set_to_none=True)
    logprobs = token_logprobs(model, ids, targets, chunk_tokens, **kwargs)
    (-(logprobs * weights).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


def _grad_norm(grads) -> float:
    return float(sum(g.double().pow(2).sum() for g in grads.values()).sqrt())


@pytest.mark.parametrize(
    "lora_rank, gc",
    [(32, False), (32, True), (0, False), (0, True)],
    ids=["lora", "lora-gc", "full", "full-gc"],
)
def test_chunked_matches_full_logits(lora_rank, gc):
    # lora: frozen head (gradient taken in forward); full: trainable head (recomputed in backward).
    model = build_model(ModelSpec(lora_rank=lora_rank), CPU, gc)
    ids, targets, weights = _inputs(3, 50)
    ref_lp, ref_grads = _loss_and_grads(model, ids, targets, weights, None)
    assert ref_lp.dtype == torch.float32 and ref_lp.shape == (3, 50)
    head_trains = model.get_output_embeddings().weight.requires_grad
    assert head_trains == (lora_rank == 0)
    for chunk in (7, 50, 64, 1000):  # divides nothing / one row / crosses rows / all at once
        lp, grads = _loss_and_grads(model, ids, targets, weights, chunk)
        assert lp.dtype == torch.float32 and lp.shape == (3, 50)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)
        assert set(grads) == set(ref_grads)
        assert _grad_norm(grads) == pytest.approx(_grad_norm(ref_grads), rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_no_tokens_by_vocab_tensor_in_forward_or_backward():
    vocab = 16384  # large enough that the head's tensors outgrow every other one in the model
    model = build_model(ModelSpec(vocab_size=vocab), CPU, False)
    ids, targets, weights = _inputs(2, 300)
    tokens, chunk = ids.numel(), 64

    def largest(chunk_tokens):
        with LargestTensor() as probe:
            _loss_and_grads(model, ids, targets, weights, chunk_tokens)
        return probe.largest

    assert largest(None) >= tokens * vocab  # the probe sees the full logits of the old path
    assert largest(chunk) <= chunk * vocab


def test_model_kwargs_reach_the_model():
    model = build_model(ModelSpec(), CPU, False)
    ids, targets, weights = _inputs(1, 40)
    # Two sequences end to end, positions restarting: what the packed layout passes.
    position_ids = torch.cat([torch.arange(25), torch.arange(15)]).unsqueeze(0)
    plain, _ = _loss_and_grads(model, ids, targets, weights, 16)
    chunked, grads = _loss_and_grads(model, ids, targets, weights, 16, position_ids=position_ids)
    full, ref_grads = _loss_and_grads(model, ids, targets, weights, None, position_ids=position_ids)
    assert not torch.allclose(chunked, plain)  # the positions changed the answer ...
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)  # ... the same way on both paths
    assert _grad_norm(grads) == pytest.approx(_grad_norm(ref_grads), rel=1e-5)


def test_linear_head_with_bias_and_its_gradients():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    linear = torch.nn.Linear(16, 40)
    targets = torch.randint(0, 40, (2, 9), generator=g)
    scale = torch.rand(2, 9, generator=g)
    head = TokenLogprobHead(linear)
    assert head.weight is linear.weight and head.bias is linear.bias  # same parameters, same names
    torch.testing.assert_close(head(hidden), linear(hidden))  # plain logits unless asked

    ref = torch.log_softmax(linear(hidden).float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_grads = torch.autograd.grad((ref * scale).sum(), (hidden, linear.weight, linear.bias))
    with head.target_logprobs(targets, 5):
        got = head(hidden)
    got_grads = torch.autograd.grad((got * scale).sum(), (hidden, linear.weight, linear.bias))
    torch.testing.assert_close(got, ref)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b)
    assert head._request is None  # cleared on the way out
    with pytest.raises(ValueError, match="do not match"):
        chunked_target_logprobs(hidden, linear.weight, None, targets[:, :3], 4)


def test_the_head_is_found_through_lora_and_plain_logits_still_work():
    model = build_model(ModelSpec(), CPU, False)
    head = find_logprob_head(model)
    assert isinstance(head, TokenLogprobHead)
    assert "base_model.model.lm_head.weight" in dict(model.named_parameters())  # names unchanged
    ids, _, _ = _inputs(1, 8)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 8, VOCAB)
    with pytest.raises(ValueError, match="positive integer"):
        token_logprobs(model, ids, ids, 0)
    with pytest.raises(ValueError, match="install_logprob_head"):
        token_logprobs(torch.nn.Sequential(torch.nn.Linear(2, 2)), ids, ids, 4)


def test_forward_only_matches_and_stores_nothing_for_backward():
    model = build_model(ModelSpec(), CPU, False)
    ids, targets, _ = _inputs(2, 30)
    with torch.no_grad():
        chunked = token_logprobs(model, ids, targets, 8)
        full = token_logprobs(model, ids, targets, None)
    assert not chunked.requires_grad
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    ref = F.log_softmax(model(input_ids=ids).logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(chunked, ref.detach(), rtol=1e-5, atol=1e-6)
