"""Target-token log-probs computed chunk by chunk inside the model's own forward: no [tokens × vocab] tensor.

The output layer is replaced, at model construction and before any wrapping,
by a ``TokenLogprobHead``: the same parameters under the same names, and plain
logits unless a caller asks it for the log-probs of given targets. Asked, it
projects ``chunk_tokens`` hidden states at a time to the vocabulary, takes the
float32 log-softmax and keeps only the targets' entries; backward recomputes
what it needs chunk by chunk. Running inside the model's forward is what keeps
wrappers working: FSDP2's root unshards the output layer in its own pre-forward
hook, and Megatron DDP's gradient hooks see the usual parameter gradients.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from balance_batch.integrations.transformers import kernels


def _chunk_softmax_parts(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor
):
    """One chunk's target log-probs [n] and its softmax [n, vocab] (float32, one buffer, computed in place).

    The steps are log_softmax's own (shift by the row maximum, sum the
    exponentials, subtract the log of the sum), so the values match the
    unchunked ``log_softmax(logits.float())`` to rounding.
    """
    logits = F.linear(hidden, weight, bias).float()
    logits = logits.sub_(logits.amax(dim=-1, keepdim=True))
    target_shifted = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probs = logits.exp_()
    total = probs.sum(dim=-1)
    logprobs = target_shifted - total.log()
    return logprobs, probs.div_(total.unsqueeze(-1))


def _minus_softmax_plus_onehot_(probs: torch.Tensor, targets: torch.Tensor, scale: Optional[torch.Tensor] = None):
    """In place: ``scale · (onehot(targets) − probs)``, the gradient of ``scale · logprob[target]`` w.r.t. the
    logits."""
    if scale is None:
        probs.neg_()
        return probs.scatter_add_(-1, targets.unsqueeze(-1), torch.ones_like(probs[:, :1]))
    column = scale.to(probs.dtype).unsqueeze(-1)
    probs.mul_(column).neg_()
    return probs.scatter_add_(-1, targets.unsqueeze(-1), column)


class _ChunkedTargetLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weightᵀ + bias)[target] per token, ``chunk_tokens`` rows at a time.

    With a frozen output layer (LoRA) the forward also stores d logprob / d hidden
    per token ([tokens × hidden], the size of the hidden states): the product the
    unchunked backward would compute, so backward is a scaling and costs no
    recomputation. With a trainable layer, backward recomputes each chunk's
    softmax and accumulates the weight's gradient in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, out_shape: torch.Size, chunk_tokens: int, want_grads: bool):
        n = hidden.shape[0]
        # Returned in the caller's shape, not as a view: FSDP2 warns about (and in-place ops would break) views.
        result = torch.empty(out_shape, dtype=torch.float32, device=hidden.device)
        out = result.view(-1)
        need_hidden = want_grads and ctx.needs_input_grad[0]
        need_params = want_grads and (ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2]))
        dlogprob_dhidden = torch.empty_like(hidden) if need_hidden and not need_params else None
        for start in range(0, n, chunk_tokens):
            rows = slice(start, min(n, start + chunk_tokens))
            logprobs, probs = _chunk_softmax_parts(hidden[rows], weight, bias, targets[rows])
            out[rows] = logprobs
            if dlogprob_dhidden is not None:
                grad_logits = _minus_softmax_plus_onehot_(probs, targets[rows])
                dlogprob_dhidden[rows] = grad_logits.to(weight.dtype) @ weight
                del grad_logits
            del probs  # before the next chunk allocates its own: one [chunk × vocab] buffer at a time
        ctx.chunk_tokens = chunk_tokens
        ctx.has_bias = bias is not None
        if dlogprob_dhidden is not None:
            ctx.save_for_backward(dlogprob_dhidden)
            ctx.recompute = False
        elif need_hidden or need_params:
            ctx.save_for_backward(hidden, weight, bias, targets)
            ctx.recompute = True
        return result

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.reshape(-1)
        if not ctx.recompute:
            (dlogprob_dhidden,) = ctx.saved_tensors
            grad_hidden = (dlogprob_dhidden.float() * grad_out.unsqueeze(-1)).to(dlogprob_dhidden.dtype)
            return grad_hidden, None, None, None, None, None, None
        hidden, weight, bias, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = ctx.has_bias and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulated over chunks in float32: a bf16 sum of many chunks would lose what one matmul keeps.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk_tokens):
            rows = slice(start, min(n, start + ctx.chunk_tokens))
            _, probs = _chunk_softmax_parts(hidden[rows], weight, bias, targets[rows])
            grad_logits = _minus_softmax_plus_onehot_(probs, targets[rows], grad_out[rows])
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
            grad_logits = grad_logits.to(weight.dtype)
            del probs
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ hidden[rows]).float()
            del grad_logits  # before the next chunk allocates its own
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def chunked_target_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """float32 log-probs of ``targets`` (shape [...]) under the linear head on ``hidden`` ([..., hidden])."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)}")
    return _ChunkedTargetLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1),
        targets.shape,
        int(chunk_tokens),
        torch.is_grad_enabled(),
    )


class TokenLogprobHead(nn.Linear):
    """The model's output layer (same parameter objects, same names); target log-probs when asked for them."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self._request: Optional[tuple[torch.Tensor, int]] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._request is None:
            kernels.note("logprob_head", "full-logits")
            with kernels.span("logprob_head"):
                return super().forward(hidden)
        targets, chunk_tokens = self._request
        kernels.note("logprob_head", f"chunked-{chunk_tokens}")
        with kernels.span("logprob_head"):
            return chunked_target_logprobs(hidden, self.weight, self.bias, targets, chunk_tokens)

    @contextlib.contextmanager
    def target_logprobs(self, targets: torch.Tensor, chunk_tokens: int) -> Iterator[None]:
        """Within the block, the model's ``logits`` output is the float32 log-prob of each target instead."""
        self._request = (targets, chunk_tokens)
        try:
            yield
        finally:
            self._request = None


def install_logprob_head(model: nn.Module) -> bool:
    """Swap a Hugging Face model's linear output layer for a ``TokenLogprobHead``; False when it has none.

    Call before LoRA and before any wrapping (FSDP2 records the modules it manages).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, TokenLogprobHead):
        return True
    if type(head) is not nn.Linear:
        return False
    model.set_output_embeddings(TokenLogprobHead(head))
    return True


_HEADS: "weakref.WeakKeyDictionary[nn.Module, TokenLogprobHead]" = weakref.WeakKeyDictionary()


def find_logprob_head(model: nn.Module) -> Optional[TokenLogprobHead]:
    """The ``TokenLogprobHead`` inside ``model`` however it is wrapped (peft, FSDP2, Megatron DDP), or None."""
    head = _HEADS.get(model)
    if head is None:
        head = next((m for m in model.modules() if isinstance(m, TokenLogprobHead)), None)
        if head is not None:
            _HEADS[model] = head
    return head
