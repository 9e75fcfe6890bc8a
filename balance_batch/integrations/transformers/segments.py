"""The computations of a packed row that keep its sequences apart, in torch: attention, the short causal convolution
and the chunked gated delta rule, each as the sequences would run alone; and the row's boundaries as host ints.

packing.py beside this module swaps these in where the model's own functions
would run across boundaries; each records itself with ``kernels.note`` when it
runs.
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from balance_batch.integrations.transformers import kernels

# The host copy of the current micro-batch's boundaries: every layer of one forward gets the same
# cu_seqlens tensor, so its bounds are read from the host list collate made, never from the device.
# Beside it, the int64 forms the kernels take, made once per micro-batch (``int64_bounds``).
_host_bounds: tuple = (lambda: None, [], {})


def remember_bounds(cu_seqlens: torch.Tensor, bounds: list[int]) -> None:
    """Record the host copy of a micro-batch's cumulative lengths (one micro-batch at a time)."""
    global _host_bounds
    _host_bounds = (weakref.ref(cu_seqlens), [int(b) for b in bounds], {})


def host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """Cumulative lengths as Python ints: the collated host copy, else read from the tensor (one host sync on CUDA)."""
    ref, bounds, _ = _host_bounds
    if ref() is cu_seqlens:
        return bounds
    return [int(x) for x in cu_seqlens.tolist()]


def int64_bounds(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's cumulative lengths as int64 on its device and on the host, the same two tensors for every
    layer: fla caches its chunk indices by the tensors it is given (``tensor_cache``), so a new ``.long()`` per
    layer missed that cache and recomputed them from device counts, a device-to-host copy per layer and pass."""
    ref, bounds, made = _host_bounds
    if ref() is not cu_seqlens:  # not collated here: made for this call alone
        return cu_seqlens.long(), torch.tensor(host_bounds(cu_seqlens), dtype=torch.long)
    if not made:
        made["device"] = cu_seqlens.long()
        made["host"] = torch.tensor(bounds, dtype=torch.long)
    return made["device"], made["host"]


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device``, the host not kept waiting for the copy.

    On CUDA through page-locked memory: ``non_blocking=True`` from pageable memory is staged through a pinned
    buffer synchronously, so the host waits anyway; from pinned memory the copy is queued on the current stream,
    and torch's pinned-memory cache keeps the buffer until the copy is done. On a CPU the array's own memory.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def own_attention(implementation: str, module: torch.nn.Module) -> Callable:
    """The attention function the layer ``module`` runs under ``implementation`` when not packed: its modeling
    module's own ``eager_attention_forward`` for eager (each model has its own: sinks, soft-capping, ...), else
    transformers' registered function. Looked up per call, so every model prepared in a process runs its own."""
    if implementation == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]


def _sequence_mask(implementation: str, module, kwargs: dict, length: int, query: torch.Tensor):
    """The mask a sequence alone gets when the model built none for the packed row (the harness's rows skip mask
    creation): None where the function is causal by itself (sdpa without a window), else causal, within the layer's
    sliding window if it has one, as sdpa's boolean mask or eager's additive one."""
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if implementation == "sdpa" and not window:
        return None
    i = torch.arange(length, device=query.device)
    allowed = i[None, :] <= i[:, None]
    if window:
        allowed &= i[:, None] - i[None, :] < int(window)
    if implementation == "sdpa":
        return allowed[None, None]
    blocked = torch.full((length, length), torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
    return blocked.masked_fill(allowed, 0.0)[None, None]


def segment_attention(implementation: str, module, query, key, value, attention_mask, **kwargs):
    """Attention of a packed row: each sequence attends only within itself, through the layer's own attention
    function (``own_attention``), so what that function does (scaling, a sliding window, attention sinks,
    soft-capping, a position bias) holds for each sequence as it does for the sequence alone.

    ``query`` is [1, heads, total, head_dim] (keys/values may have fewer heads); the result is [1, total, heads,
    head_dim] like every transformers attention function. Without ``cu_seq_lens_q`` this is the layer's own function
    as is. With it, the function runs once per sequence (cost: the sum of per-sequence costs) on that sequence's
    block of the row's mask, which is the mask the sequence alone gets (causal, windowed or chunked as the layer's
    is); where the model built no mask for the row, the mask a sequence alone gets (``_sequence_mask``). Any other
    [..., total, total] argument (a position bias) is cut to the same block.
    """
    original = own_attention(implementation, module)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        kernels.note("attention", implementation)
        return original(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1, got query of shape {tuple(query.shape)}")
    kernels.note("attention", implementation + kernels.PER_SEQUENCE)
    total = query.shape[2]
    plain = {k: v for k, v in kwargs.items() if k not in _BOUNDARY_KWARGS}
    square = {k for k, v in plain.items() if isinstance(v, torch.Tensor) and v.dim() >= 2
              and tuple(v.shape[-2:]) == (total, total)}
    if isinstance(attention_mask, torch.Tensor) and tuple(attention_mask.shape[-2:]) != (total, total):
        raise ValueError(f"a packed row's attention mask must be [..., {total}, {total}], got "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"per-sequence attention takes a tensor mask, got {type(attention_mask).__name__}")
    bounds = host_bounds(cu)
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # torch.split, not slices: one backward that concatenates, where each slice's
    # backward would write into a zero tensor the size of the whole row.
    pieces = zip(*(t.split(lengths, dim=2) for t in (query, key, value)))
    outs = []
    for (s, e), (q, k, v) in zip(zip(bounds[:-1], bounds[1:]), pieces):
        if e == s:
            continue
        mask = (attention_mask[..., s:e, s:e] if attention_mask is not None
                else _sequence_mask(implementation, module, plain, e - s, q))
        own = {key_: (v_[..., s:e, s:e] if key_ in square else v_) for key_, v_ in plain.items()}
        outs.append(original(module, q, k, v, mask, **own)[0])
    return torch.cat(outs, dim=1), None


# What marks a row's boundaries for a varlen kernel; per-sequence calls take none of it.
_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def segment_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias, activation, cu_seqlens: torch.Tensor):
    """Depthwise causal convolution of a packed row [1, channels, total] that restarts at each boundary.

    Each sequence is given its own ``width - 1`` zeros in front (what a
    sequence alone gets), all in one gather and one convolution.
    """
    channels, width = weight.shape
    total = x.shape[-1]
    bounds = torch.as_tensor(cu_seqlens, device=x.device).long()
    lengths = bounds[1:] - bounds[:-1]
    gap = width - 1
    # Sequence s's tokens move right by gap * (s + 1); the gaps point at a zero column.
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths, output_size=total)
    dest = torch.arange(total, device=x.device) + gap * (seg + 1)
    source = torch.full((total + gap * lengths.numel(),), total, dtype=torch.long, device=x.device)
    source[dest] = torch.arange(total, device=x.device)
    spread = F.pad(x.to(weight.dtype), (0, 1)).index_select(-1, source)
    out = F.conv1d(spread, weight.unsqueeze(1), bias, groups=channels)  # output i sees inputs i .. i + gap
    out = out.index_select(-1, dest - gap)
    if activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def _l2normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def segment_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
    bounds: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """The chunked gated delta rule over a packed row, state starting from zero at each sequence.

    ``bounds``: the cumulative lengths as host ints, instead of ``cu_seqlens``.

    Shapes as transformers' ``torch_chunk_gated_delta_rule`` with batch 1:
    query/key [1, total, k_heads, k_dim], value [1, total, v_heads, v_dim],
    g/beta [1, total, v_heads]; returns [1, total, v_heads, v_dim].

    Every sequence is cut into its own chunks (zero-padded at its end, as a
    sequence alone is), so the within-chunk work runs on all chunks of the
    row at once. The scan over chunks then advances every sequence together:
    chunks are laid out step-major with the sequences sorted by chunk count,
    so at step j the sequences still running are a prefix of the batch and the
    scan takes (longest sequence's chunks) steps, not (row's chunks).
    """
    kernels.note("delta_rule", kernels.SEGMENT_SCAN)  # recorded by what runs, not by who dispatched it
    out_dtype = query.dtype
    q, k, v, b, decay = _heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    bounds = list(bounds) if bounds is not None else host_bounds(cu_seqlens)
    layout = _ChunkLayout(bounds, key.shape[1], chunk_size, q.device)
    q, k, v, b, decay = (layout.to_chunks(t) for t in (q, k, v, b, decay))
    out = _scan_chunk_steps(layout.per_step, *_within_chunks(q, k, v, b, decay))  # [slots, heads, chunk, v_dim]
    return layout.from_chunks(out).unsqueeze(0).to(out_dtype)


def _heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, ...]:
    """The delta rule's inputs as float32 [v_heads, total, ...]: each q/k head repeated for the value heads it serves,
    q and k normalised where asked, q scaled by 1/sqrt(k_dim)."""
    k_heads, v_heads = key.shape[2], value.shape[2]
    if k_heads != v_heads:  # grouped value heads: each q/k head serves consecutive value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    q, k, v = (t[0].transpose(0, 1).float() for t in (query, key, value))
    b, decay = (t[0].transpose(0, 1).float() for t in (beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = _l2normalize(q), _l2normalize(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, b, decay


class _ChunkLayout:
    """Where each token of a packed row sits among the scan's chunk slots.

    Sequence s has n_s chunks; sorted by n_s (longest first) it has rank r_s. Chunk j of the sequence of rank r sits
    in slot ``offset[j] + r``, so the sequences still running at step j are the first ``per_step[j]`` slots of that
    step. A chunk's positions past its sequence's end read a zero row.
    """

    def __init__(self, bounds: Sequence[int], total: int, chunk_size: int, device: torch.device):
        lengths = np.diff(np.asarray(bounds, dtype=np.int64))
        n_chunks = -(-lengths // chunk_size)
        order = np.argsort(-n_chunks, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        steps = int(n_chunks.max())
        active = (n_chunks[None, :] > np.arange(steps)[:, None]).sum(axis=1)  # sequences still running at step j
        offset = np.concatenate([[0], np.cumsum(active)])
        seg = np.repeat(np.arange(lengths.size), lengths)
        local = np.arange(total) - np.repeat(np.asarray(bounds[:-1]), lengths)
        slot_token = (offset[local // chunk_size] + rank[seg]) * chunk_size + local % chunk_size
        self.chunk_size, self.n_slots = chunk_size, int(offset[-1])
        self.per_step = [int(a) for a in active]
        source = np.full(self.n_slots * chunk_size, total, dtype=np.int64)  # padding reads the zero row at `total`
        source[slot_token] = np.arange(total)
        self.source = host_to_device(source, device)  # queued copies from pinned memory: the host does not wait
        self.slot_token = host_to_device(slot_token, device)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[heads, total, ...] -> [slots, heads, chunk, ...]."""
        x = F.pad(x, (0, 0, 0, 1)) if x.dim() == 3 else F.pad(x, (0, 1))
        x = x.index_select(1, self.source)
        x = x.reshape(x.shape[0], self.n_slots, self.chunk_size, *x.shape[2:])
        return x.transpose(0, 1)

    def from_chunks(self, out: torch.Tensor) -> torch.Tensor:
        """[slots, heads, chunk, dim] -> [total, heads, dim], each token back at its place in the row."""
        heads = out.shape[1]
        out = out.transpose(0, 1).reshape(heads, self.n_slots * self.chunk_size, -1).index_select(1, self.slot_token)
        return out.transpose(0, 1)


def _within_chunks(q, k, v, b, decay) -> tuple[torch.Tensor, ...]:
    """What each chunk contributes on its own, all slots at once ([slots, heads, chunk, ...] each): the corrected
    values and the state's keys, the queries' and keys' decayed reads and writes of the state, the queries' intra-chunk
    attention, and the chunk's total decay."""
    chunk_size = q.shape[2]
    k_beta = k * b.unsqueeze(-1)
    v_beta = v * b.unsqueeze(-1)
    cum = decay.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    corrected_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q_read = q * cum.exp().unsqueeze(-1)
    k_write = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    return corrected_v, state_keys, q_read, intra, chunk_decay, k_write


def _scan_chunk_steps(per_step: list[int], corrected_v, state_keys, q_read, intra, chunk_decay, k_write
                      ) -> torch.Tensor:
    """The scan over chunk steps, all running sequences at once, each sequence's state starting at zero; returns the
    output [slots, heads, chunk, v_dim] in slot order.

    Steps are taken with torch.split (one backward for all steps); a slice per step would cost a zero tensor the size
    of the whole row in backward, each step.
    """
    steps_of = lambda t: t.split(per_step, dim=0)  # noqa: E731
    state = q_read.new_zeros(per_step[0], corrected_v.shape[1], state_keys.shape[-1], corrected_v.shape[-1])
    outs = []
    for n, cv, sk, qr, ia, cd, kw in zip(
        per_step, *map(steps_of, (corrected_v, state_keys, q_read, intra, chunk_decay, k_write))
    ):
        state = state[:n]  # sequences that have ended drop off the end (the state is small)
        delta = cv - sk @ state
        outs.append(qr @ state + ia @ delta)
        state = state * cd + kw.transpose(-1, -2) @ delta
    return torch.cat(outs, dim=0)
