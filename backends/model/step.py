"""The per-micro-batch step shared by every backend: pad, forward, weighted loss, backward."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from backends.messages import PASS_TYPES, Example, ExampleOutput
from backends.model.logprobs import find_logprob_head
from backends.model.packing import check_packable, collate_packed, model_layer_types
from balance_batch import LAYOUTS
from balance_batch.integrations.transformers import kernels
from balance_batch.integrations.transformers.packing import prepare_model_for_packing
from balance_batch.integrations.transformers.segments import host_to_device
from balance_batch.plan import Schedule


class PassTimeout(RuntimeError):
    """A pass ran past bench.pass_timeout_s."""


# Called after each step with (steps done, steps in schedule, real tokens done).
ProgressFn = Callable[[int, int, int], None]


def collate(examples: Sequence[Example], batch: Sequence[int], device: torch.device):
    """Right-pad one micro-batch to its longest sequence.

    Padding goes at the end and the model is causal (attention, the delta-net
    recurrence and its short convolution all look only backwards), so real
    tokens never see pad tokens; pad positions get weight 0 and are dropped.
    """
    longest = max(len(examples[i]) for i in batch)
    ids = np.zeros((len(batch), longest), dtype=np.int64)
    targets = np.zeros((len(batch), longest), dtype=np.int64)
    weights = np.zeros((len(batch), longest), dtype=np.float32)
    for row, i in enumerate(batch):
        ex = examples[i]
        n = len(ex)
        ids[row, :n] = ex.input_ids
        targets[row, :n] = ex.target_tokens
        weights[row, :n] = ex.weights
    return host_to_device(ids, device), host_to_device(targets, device), host_to_device(weights, device)


def dummy_inputs(device: torch.device):
    """One pad token with zero weight: lets a rank join a collective step without changing any gradient."""
    zeros = torch.zeros((1, 1), dtype=torch.int64, device=device)
    return zeros, zeros.clone(), torch.zeros((1, 1), dtype=torch.float32, device=device)


def token_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: Optional[int] = None,
    **model_kwargs,
) -> torch.Tensor:
    """Log-probability of each target token, in float32, shape [batch, length].

    With ``chunk_tokens`` the model's own output layer (a ``TokenLogprobHead``,
    see backends/model/logprobs.py) computes them that many tokens at a time, so no
    [tokens × vocab] tensor exists in forward or backward; ``None`` keeps the
    unchunked path (full logits, then log-softmax), the reference the tests
    compare against. ``model_kwargs`` (position_ids, cu_seq_lens_q, ...) go to
    the model's forward.
    """
    if chunk_tokens is None:
        logits = model(input_ids=ids, use_cache=False, **model_kwargs).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive integer or None, got {chunk_tokens!r}")
    head = find_logprob_head(model)
    if head is None:
        raise ValueError(
            "chunked log-probs need the model's output layer replaced by backends.model.logprobs.install_logprob_head "
            "before wrapping (build_model does it); pass chunk_tokens=None for the unchunked path"
        )
    with head.target_logprobs(targets, chunk_tokens):
        return model(input_ids=ids, use_cache=False, **model_kwargs).logits


def total_loss_weight(examples: Sequence[Example], indices: Optional[Sequence[int]] = None) -> float:
    chosen = range(len(examples)) if indices is None else indices
    return float(sum(float(examples[i].weights.sum()) for i in chosen))


def run_schedule(
    model: torch.nn.Module,
    examples: Sequence[Example],
    schedule: Schedule,
    pass_type: str,
    total_weight: float,
    device: torch.device,
    progress: Optional[ProgressFn] = None,
    before_step: Optional[Callable[[int, bool], None]] = None,
    deadline: Optional[float] = None,
    layout: str = "padded",
    logprob_chunk_tokens: Optional[int] = None,
    clock=None,
) -> dict[int, ExampleOutput]:
    """Run one rank's schedule; return outputs keyed by example index (``run_steps``, then ``outputs_to_host``)."""
    pending = run_steps(model, examples, schedule, pass_type, total_weight, device, progress, before_step, deadline,
                        layout, logprob_chunk_tokens, clock)
    return outputs_to_host(pending, examples)


# One finished micro-batch, its results still on the device: (example indices, log-probs, losses,
# packed lengths). Padded: log-probs [rows, longest], losses [rows]; packed: both [tokens] of one row.
PendingStep = tuple[Sequence[int], torch.Tensor, torch.Tensor, Optional[Sequence[int]]]


def run_steps(
    model: torch.nn.Module,
    examples: Sequence[Example],
    schedule: Schedule,
    pass_type: str,
    total_weight: float,
    device: torch.device,
    progress: Optional[ProgressFn] = None,
    before_step: Optional[Callable[[int, bool], None]] = None,
    deadline: Optional[float] = None,
    layout: str = "padded",
    logprob_chunk_tokens: Optional[int] = None,
    clock=None,
) -> list[PendingStep]:
    """Run one rank's schedule: what a training step does, nothing more; results stay on the device.

    ``examples`` is indexed by example index (a list, or a dict holding this
    rank's share). The loss of every micro-batch is divided by ``total_weight``,
    the loss weight of the whole batch on all ranks, so the accumulated gradient
    is the same however the batch is split. ``None`` entries run a zero-weight
    dummy. ``before_step(i, is_last)`` lets a backend set per-step sync behaviour.
    Past ``deadline`` (a ``time.monotonic()`` value) the next step raises PassTimeout.
    ``layout="packed"`` runs each micro-batch as one row of its sequences end
    to end (see backends.model.packing); outputs are the same as padded.
    ``logprob_chunk_tokens`` goes to ``token_logprobs`` (None = unchunked).
    Log-probs are not copied to the host per step (that would wait for the
    device every step); ``outputs_to_host`` copies them once the pass is over.
    ``balance_batch.integrations.transformers.kernels.snapshot()`` after it says which implementations ran.
    ``clock`` (a ``backends.runtime.timeline.StepClock``) is marked where each step starts and where the last ends.
    """
    if pass_type not in PASS_TYPES:
        raise ValueError(f"pass type must be one of {PASS_TYPES}, got {pass_type!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    # idempotent (build_model does it): a packed row must never leak across sequences, and every kernel call is recorded
    prepare_model_for_packing(model)
    if layout == "packed":
        check_packable(model)  # an architecture packing does not keep apart: one clear error, before any step
    kernels.reset()  # kernels.snapshot() after the pass says what ran in it
    backward = pass_type == "forward_backward"
    scale = 1.0 / total_weight if total_weight > 0 else 0.0
    pending: list[PendingStep] = []
    tokens_done = 0
    n_steps = len(schedule)
    for step, batch in enumerate(schedule):
        if deadline is not None and time.monotonic() > deadline:
            raise PassTimeout(f"{pass_type} still running after its time-out, at micro-batch {step + 1}/{n_steps}")
        if clock is not None:
            clock.mark()
        if before_step is not None:
            before_step(step, step == n_steps - 1)
        if layout == "packed":
            tokens_done += _packed_step(model, examples, batch, backward, scale, device, pending, logprob_chunk_tokens)
            if progress is not None:
                progress(step + 1, n_steps, tokens_done)
            continue
        if batch is None:
            ids, targets, weights = dummy_inputs(device)
        else:
            ids, targets, weights = collate(examples, batch, device)
        with torch.set_grad_enabled(backward):
            logprobs = token_logprobs(model, ids, targets, logprob_chunk_tokens)
            loss_per_row = -(logprobs * weights).sum(dim=-1)
            if backward:
                (loss_per_row.sum() * scale).backward()
        if batch is not None:
            pending.append((batch, logprobs.detach(), loss_per_row.detach(), None))
            tokens_done += sum(len(examples[i]) for i in batch)
        if progress is not None:
            progress(step + 1, n_steps, tokens_done)
    if clock is not None and n_steps:
        clock.mark()  # where the last step ends
    return pending


def outputs_to_host(pending: Sequence[PendingStep], examples: Sequence[Example]) -> dict[int, ExampleOutput]:
    """Per-example outputs on the host, keyed by example index, from ``run_steps``'s device-side results."""
    outputs: dict[int, ExampleOutput] = {}
    for batch, logprobs, losses, packed_lengths in pending:
        lp = logprobs.float().cpu().numpy()
        if packed_lengths is None:
            per_row = losses.double().cpu().numpy()
            for row, i in enumerate(batch):
                outputs[i] = ExampleOutput(logprobs=lp[row, : len(examples[i])].copy(), loss=float(per_row[row]))
            continue
        per_token = losses.double().cpu().numpy()
        start = 0
        for i, n in zip(batch, packed_lengths):
            outputs[i] = ExampleOutput(
                logprobs=lp[start : start + n].copy(), loss=float(per_token[start : start + n].sum())
            )
            start += n
    return outputs


def _packed_step(
    model, examples, batch, backward: bool, scale: float, device, pending: list, chunk_tokens: Optional[int] = None
) -> int:
    """One packed micro-batch (``None`` = the one-token dummy); appends to ``pending``, returns its real tokens."""
    packed = collate_packed(examples, batch, device)
    with torch.set_grad_enabled(backward):
        logprobs = token_logprobs(model, packed.ids, packed.targets, chunk_tokens,
                                  **packed.model_kwargs(model_layer_types(model)))
        token_loss = -(logprobs * packed.weights)
        if backward:
            (token_loss.sum() * scale).backward()
    if batch is None:
        return 0
    pending.append((batch, logprobs.detach()[0], token_loss.detach()[0], list(packed.lengths)))
    return sum(packed.lengths)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it includes that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ProgressLogger:
    """Logs a pass's progress at most every ``every_s`` seconds (and at its end)."""

    def __init__(self, log: Callable[[str], None], label: str, total_tokens: int, every_s: float = 10.0):
        self.log, self.label, self.total_tokens, self.every_s = log, label, total_tokens, every_s
        self.start = self.last = time.perf_counter()

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s and done < total:
            return
        self.last = now
        if done == total and now - self.start < self.every_s:
            return  # a short pass needs no progress line; the pass summary follows
        self.log(
            f"{self.label}: micro-batch {done}/{total}, {tokens:,}/{self.total_tokens:,} tokens, "
            f"{now - self.start:.0f} s"
        )


def grad_norm_local_sq(model: torch.nn.Module) -> float:
    """Sum of squares of the trainable parameters' local gradients (0 for a missing gradient), read on the host."""
    return float(grad_sq_sum(local_grads(model), _model_device(model)).item())


def local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """The trainable parameters' gradients as this rank holds them (a DTensor shard's local part under FSDP2)."""
    grads = []
    for p in model.parameters():
        if not p.requires_grad or p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "to_local"):  # a DTensor shard under FSDP2
            g = g.to_local()
        grads.append(g.detach())
    return grads


def grad_sq_sum(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of ``grads`` as a float64 tensor of shape [1] on ``device``, nothing read on the host.

    One fused norm over every tensor (``torch._foreach_norm``, accumulated in float64: one kernel per dtype on a
    GPU, not one per parameter), squared and summed on the device, so the caller reads the gradient norm with one
    host sync per pass (after its all-reduce, where it has one) instead of one per trainable tensor (about 700 on
    the 35B model with LoRA).
    """
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros(1, dtype=torch.float64, device=device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return torch.stack(list(norms)).pow(2).sum().reshape(1).to(device)


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device if p.device.type != "meta" else torch.device("cpu")
    return torch.device("cpu")
