"""Packed micro-batches: sequences laid end to end in one row, with nothing crossing a boundary.

A packed micro-batch is one row of its sequences end to end, no padding.
Position ids restart at 0 for each sequence and ``cu_seq_lens_q/k`` (the
cumulative lengths, Hugging Face's name for flash-attention's ``cu_seqlens``)
mark the boundaries. The model is the stock Hugging Face model; the pieces
that must honour the boundaries are

- full attention: an attention function registered with
  ``transformers.AttentionInterface`` that runs flash-attention's varlen
  kernel on CUDA when installed, and otherwise SDPA once per sequence (cost
  is the sum of per-sequence costs; no (Σ lengths)² mask is ever built);
- the gated delta-net layers' short causal convolution and chunked delta
  rule, whose pure-torch fallbacks in transformers 5.24 ignore the
  boundaries (the convolution leaks silently; the delta rule refuses
  ``cu_seqlens``). ``prepare_model_for_packing`` swaps both for
  boundary-aware versions that delegate to the stock function (or to the
  causal-conv1d / flash-linear-attention kernels when installed, on CUDA)
  and are exactly the stock path when no boundaries are given.

Under ``backend.compile=true`` these three run eagerly inside each compiled
layer (``torch.compiler.disable``): their work depends on where sequences
start and end, and tracing them would compile a graph per set of boundaries.

Call ``prepare_model_for_packing(model)`` once after building the model (it
works on the bare model, under peft, ``fully_shard`` and megatron-core DDP,
with or without gradient checkpointing), then run a ``PackedBatch``'s
``model_kwargs()`` through the model's forward.
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from backends.messages import Example
from backends.model import kernels
from backends.model.configs import PACKED_MODEL_TYPES

PACKED_PREFIX = "packed_"  # registered attention name = prefix + the model's own implementation
_PACKED_MARK = "_balance_batch_packed"  # set on our replacement functions (idempotence)


# ---------------------------------------------------------------------------- collate


def no_masks(layer_types: Sequence[str]) -> dict:
    """A precomputed mask per layer type, all None: no mask is built, ``cu_seq_lens`` keeps sequences apart.

    Qwen3.5 models take a dict of layer-type masks as ``attention_mask`` and
    then skip mask creation. Without it, position ids that restart would make
    transformers build a dense block-diagonal mask of (row length)² entries.
    A plain dict with every layer type the model has, not a dict subclass:
    FSDP2's mixed-precision input cast rebuilds every dict it walks as a plain
    ``dict``, which would drop a subclass's ``__missing__``.
    """
    return {layer_type: None for layer_type in layer_types}


# Layer types a model's layers index their masks by, when its config names none.
DEFAULT_LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention", "chunked_attention")


def model_layer_types(model: torch.nn.Module) -> tuple[str, ...]:
    """Every layer type in the model's configs (``config.layer_types``), found once per model."""
    cached = _LAYER_TYPES.get(model)
    if cached is not None:
        return cached
    from transformers import PretrainedConfig

    found: list[str] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            for layer_type in getattr(config, "layer_types", None) or ():
                if layer_type not in found:
                    found.append(layer_type)
    types = tuple(found) or DEFAULT_LAYER_TYPES
    _LAYER_TYPES[model] = types
    return types


_LAYER_TYPES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]]" = weakref.WeakKeyDictionary()


def check_packable(model: torch.nn.Module) -> None:
    """Raise ValueError unless packing keeps sequences apart in this model's architecture (``PACKED_MODEL_TYPES``).

    Elsewhere a packed row would fail deep in the model's mask code, or, worse,
    run with attention across sequences. The harness refuses such a run from
    config.json before loading (``configs.check_model_spec``); this is the
    same rule for a backend driven directly. Decided once per model.
    """
    if _PACKABLE.get(model):
        return
    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    if model_type not in PACKED_MODEL_TYPES:
        name = type(hf).__name__ if hf is not None else type(model).__name__
        raise ValueError(f"layout=packed cannot run {name} (model_type {model_type!r}): packed rows are kept apart "
                         f"only in Qwen3.5-MoE models (model_type {' / '.join(PACKED_MODEL_TYPES)}); use layout=padded")
    _PACKABLE[model] = True


_PACKABLE: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


@dataclass
class PackedBatch:
    """One packed micro-batch on its device: tensors are [1, total tokens]."""

    ids: torch.Tensor  # int64 token ids
    targets: torch.Tensor  # int64 next-token targets
    weights: torch.Tensor  # float32 loss weights (0 on the dummy token)
    position_ids: torch.Tensor  # int64, restart at 0 for each sequence
    cu_seqlens: torch.Tensor  # int32 [n_sequences + 1], cumulative lengths from 0
    lengths: list[int]  # per sequence, in the order they were packed
    max_length: int

    def model_kwargs(self, layer_types: Sequence[str] = DEFAULT_LAYER_TYPES) -> dict:
        """Keyword arguments that make a prepared Hugging Face model run this row packed.

        ``layer_types``: the model's (``model_layer_types``), the keys of its per-layer masks.
        """
        return dict(
            position_ids=self.position_ids,
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_length,
            max_length_k=self.max_length,
            attention_mask=no_masks(layer_types),
        )

    def split(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Per-token values of the row ([1, total] or [total]) back into one tensor per sequence."""
        return list(torch.split(per_token.reshape(-1), self.lengths))


def collate_packed(examples: Sequence[Example], batch: Optional[Sequence[int]], device: torch.device) -> PackedBatch:
    """Lay the micro-batch's sequences end to end in one row; ``batch=None`` gives the dummy (one zero-weight token)."""
    if batch is None:
        chosen = [Example(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.float32))]
    else:
        chosen = [examples[i] for i in batch]
    lengths = [len(ex) for ex in chosen]
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    starts = np.repeat(cu[:-1], lengths)
    positions = np.arange(int(cu[-1]), dtype=np.int64) - starts
    as_row = lambda a: torch.from_numpy(np.ascontiguousarray(a)).unsqueeze(0).to(device, non_blocking=True)  # noqa: E731
    cu_seqlens = torch.from_numpy(cu).to(device, non_blocking=True)
    remember_bounds(cu_seqlens, cu.tolist())
    return PackedBatch(
        ids=as_row(np.concatenate([ex.input_ids for ex in chosen])),
        targets=as_row(np.concatenate([ex.target_tokens for ex in chosen])),
        weights=as_row(np.concatenate([ex.weights for ex in chosen]).astype(np.float32, copy=False)),
        position_ids=as_row(positions),
        cu_seqlens=cu_seqlens,
        lengths=lengths,
        max_length=max(lengths),
    )


# ---------------------------------------------------------------------------- segments


# The host copy of the current micro-batch's boundaries: every layer of one forward gets the same
# cu_seqlens tensor, so its bounds are read from the host list collate made, never from the device.
_host_bounds: tuple = (lambda: None, [])


def remember_bounds(cu_seqlens: torch.Tensor, bounds: list[int]) -> None:
    """Record the host copy of a micro-batch's cumulative lengths (one micro-batch at a time)."""
    global _host_bounds
    _host_bounds = (weakref.ref(cu_seqlens), [int(b) for b in bounds])


def _bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """Cumulative lengths as Python ints: the collated host copy, else read from the tensor (one host sync on CUDA)."""
    ref, bounds = _host_bounds
    if ref() is cu_seqlens:
        return bounds
    return [int(x) for x in cu_seqlens.tolist()]


def _cuda_kernel_available(name: str) -> bool:
    """Whether a CUDA kernel package (flash_attn, fla, causal_conv1d) imports; decided once per process."""
    return kernels.package_imports(name)


def _torch_function(function: Callable) -> Callable:
    """The pure-torch function under transformers' kernel dispatch wrapper (which binds fla or causal-conv1d when
    they import, with no device check): what CPU tensors must run."""
    return getattr(function, "__wrapped__", function)


def _eager(function: Callable) -> Callable:
    """``function`` run eagerly inside a compiled layer (backend.compile=true: backends/model/compiling.py).

    Its work depends on the row's boundaries (host ints, a loop per sequence or
    per chunk step): traced, every new set of boundaries would be a new graph.
    Kept eager, it is one graph break, and padded and packed rows alike run it
    eagerly. Without compilation the wrapper only calls ``function``.
    """
    return torch.compiler.disable(function, reason="depends on the row's sequence boundaries")


# ---------------------------------------------------------------------------- attention


def _segment_attention(original: Callable, implementation: str, module, query, key, value, attention_mask, **kwargs):
    """Attention of a packed row: each sequence attends only within itself.

    ``query`` is [1, heads, total, head_dim] (keys/values may have fewer
    heads); the result is [1, total, heads, head_dim] like every transformers
    attention function. Without ``cu_seq_lens_q`` this is ``original`` as is.
    A packed row runs SDPA once per sequence: the same SDPA a padded batch
    runs (flash-attn serves both layouts through the model's own
    ``flash_attention_2`` implementation instead, see ``kernels.attention_implementation``).
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        kernels.note("attention", implementation)
        return original(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1, got query of shape {tuple(query.shape)}")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernels.note("attention", kernels.SDPA_PER_SEQUENCE)
    # SDPA once per sequence: the cost is the sum of per-sequence costs, and a
    # sequence alone is exactly what the padded and mbs=1 paths compute.
    plain = {
        k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    }
    bounds = _bounds(cu)
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # torch.split, not slices: one backward that concatenates, where each slice's
    # backward would write into a zero tensor the size of the whole row.
    pieces = zip(*(t.split(lengths, dim=2) for t in (query, key, value)))
    outs = [sdpa_attention_forward(module, q, k, v, None, **plain)[0] for q, k, v in pieces]
    return torch.cat(outs, dim=1), None


def _register_packed_attention(implementation: str, modeling_module: str) -> str:
    """Register ``packed_<implementation>`` (attention and mask functions); return its name.

    ``modeling_module`` supplies the model's own eager attention (transformers
    keeps eager per model, not in the registry).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = PACKED_PREFIX + implementation
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    if implementation == "eager":
        original = sys.modules[modeling_module].eager_attention_forward
    else:
        original = ALL_ATTENTION_FUNCTIONS[implementation]
    attention = _eager(functools.partial(_segment_attention, original, implementation))
    attention.__name__ = attention.__qualname__ = f"{name}_attention"  # what a graph break's reason names
    AttentionInterface.register(name, attention)
    # The padded path builds the same masks as before (nothing changes without cu_seq_lens).
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name


# ---------------------------------------------------------------------------- short convolution


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


def _packed_conv1d(original: Callable) -> Callable:
    torch_conv1d = _torch_function(original)

    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        fused = hidden_states.is_cuda and _cuda_kernel_available("causal_conv1d")
        kernels.note("short_conv", kernels.CAUSAL_CONV1D if fused else kernels.TORCH_CONV1D)
        if cu is None:
            # CPU tensors take the torch function even where causal-conv1d imports (a CPU rank on a GPU host)
            return (original if fused else torch_conv1d)(hidden_states, weight, bias, activation=activation, **kwargs)
        if fused:
            # causal-conv1d keeps sequences apart by seq_idx (the layer hands it a channel-last view)
            bounds = cu.long()
            seg = torch.repeat_interleave(
                torch.arange(bounds.numel() - 1, device=cu.device),
                bounds[1:] - bounds[:-1],
                output_size=hidden_states.shape[-1],
            )
            return original(hidden_states, weight, bias, activation=activation, seq_idx=seg.to(torch.int32)[None])
        return segment_causal_conv1d(hidden_states, weight, bias, activation, cu)

    causal_conv1d_fn = _eager(causal_conv1d_fn)
    setattr(causal_conv1d_fn, _PACKED_MARK, original)
    return causal_conv1d_fn


# ---------------------------------------------------------------------------- gated delta rule


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
    total, k_heads = key.shape[1], key.shape[2]
    v_heads = value.shape[2]
    if k_heads != v_heads:  # grouped value heads: each q/k head serves consecutive value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    # [heads, total, dim] in float32
    q, k, v = (t[0].transpose(0, 1).float() for t in (query, key, value))
    b, decay = (t[0].transpose(0, 1).float() for t in (beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = _l2normalize(q), _l2normalize(k)
    q = q * q.shape[-1] ** -0.5

    # Layout. Sequence s has n_s chunks; sorted by n_s (longest first) it has rank r_s.
    # Chunk j of the sequence of rank r sits in slot offset[j] + r.
    device = q.device
    bounds = list(bounds) if bounds is not None else _bounds(cu_seqlens)
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
    n_slots = int(offset[-1])
    source = np.full(n_slots * chunk_size, total, dtype=np.int64)  # padding reads the zero row at `total`
    source[slot_token] = np.arange(total)
    source_t = torch.from_numpy(source).to(device)
    slot_token_t = torch.from_numpy(slot_token).to(device)

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [heads, total, ...] -> [slots, heads, chunk, ...]
        x = F.pad(x, (0, 0, 0, 1)) if x.dim() == 3 else F.pad(x, (0, 1))
        x = x.index_select(1, source_t)
        x = x.reshape(x.shape[0], n_slots, chunk_size, *x.shape[2:])
        return x.transpose(0, 1)

    q, k, v = to_chunks(q), to_chunks(k), to_chunks(v)
    b, decay = to_chunks(b), to_chunks(decay)

    # Within each chunk (all slots at once)
    k_beta = k * b.unsqueeze(-1)
    v_beta = v * b.unsqueeze(-1)
    cum = decay.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu(1)
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

    # Scan over chunk steps, all running sequences at once; a sequence's state starts at zero.
    # Steps are taken with torch.split (one backward for all steps); a slice per step
    # would cost a zero tensor the size of the whole row in backward, each step.
    per_step = [int(a) for a in active]
    steps_of = lambda t: t.split(per_step, dim=0)  # noqa: E731
    state = q.new_zeros(per_step[0], v_heads, k.shape[-1], v.shape[-1])
    outs = []
    for n, cv, sk, qr, ia, cd, kw in zip(
        per_step, *map(steps_of, (corrected_v, state_keys, q_read, intra, chunk_decay, k_write))
    ):
        state = state[:n]  # sequences that have ended drop off the end (the state is small)
        delta = cv - sk @ state
        outs.append(qr @ state + ia @ delta)
        state = state * cd + kw.transpose(-1, -2) @ delta
    out = torch.cat(outs, dim=0)  # [slots, heads, chunk, v_dim], slot order
    out = out.transpose(0, 1).reshape(v_heads, n_slots * chunk_size, -1).index_select(1, slot_token_t)
    return out.transpose(0, 1).unsqueeze(0).to(out_dtype)


def _packed_delta_rule(original: Callable) -> Callable:
    torch_delta_rule = _torch_function(original)

    def dispatch(
        query,
        key,
        value,
        g,
        beta,
        chunk_size: int = 64,
        initial_state=None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens=None,
        **kwargs,
    ):
        common = dict(
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        if query.is_cuda and _cuda_kernel_available("fla"):
            # the stock wrapper dispatches to flash-linear-attention, whose kernel takes cu_seqlens
            # (and, given the host copy, computes its chunk indices without a device-to-host sync)
            kernels.note("delta_rule", kernels.FLA_CHUNK)
            if cu_seqlens is None:
                return original(query, key, value, chunk_size=chunk_size, **common, **kwargs)
            host = torch.tensor(_bounds(cu_seqlens), dtype=torch.long)
            return original(query, key, value, **common, cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=host)
        if initial_state is not None or output_final_state:
            if cu_seqlens is not None:
                raise ValueError("a packed row runs without a cache: no initial or final recurrent state")
            # a recurrent state (generation): transformers' torch function, never a Triton kernel for CPU tensors
            kernels.note("delta_rule", kernels.TRANSFORMERS_TORCH_CHUNK)
            return torch_delta_rule(query, key, value, chunk_size=chunk_size, **common, **kwargs)
        # the scan records itself: a path that does not reach it records nothing
        if cu_seqlens is None:
            # A padded batch runs the same scan as a packed row, each row one segment: the
            # layouts then differ by what they compute (padding), not by the fallback they get.
            batch, length = query.shape[:2]
            row = lambda t: t.reshape(1, batch * length, *t.shape[2:])  # noqa: E731
            bounds = list(range(0, batch * length + 1, length))
            out = segment_chunk_gated_delta_rule(
                row(query), row(key), row(value), row(g), row(beta), None, chunk_size=chunk_size,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, bounds=bounds,
            )
            return out.reshape(batch, length, *out.shape[2:]), None
        out = segment_chunk_gated_delta_rule(
            query,
            key,
            value,
            g,
            beta,
            cu_seqlens,
            chunk_size=chunk_size,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        return out, None

    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(*args, **kwargs):
        with kernels.span("delta_rule"):  # a profiled pass's delta-rule time, whichever kernel runs it
            return dispatch(*args, **kwargs)

    torch_chunk_gated_delta_rule = _eager(torch_chunk_gated_delta_rule)
    setattr(torch_chunk_gated_delta_rule, _PACKED_MARK, original)
    return torch_chunk_gated_delta_rule


# ---------------------------------------------------------------------------- the model


_MODULE_FUNCTIONS = {"causal_conv1d_fn": _packed_conv1d, "torch_chunk_gated_delta_rule": _packed_delta_rule}


def _patch_linear_attention_module(module_name: str) -> None:
    """Swap the delta-net modeling module's conv and delta-rule functions for boundary-aware ones, once.

    The layer's forward looks both up as module globals at call time, so
    replacing them there reaches every instance however it is wrapped (peft,
    FSDP2, megatron-core DDP, checkpointing), and leaves transformers' own
    forward in charge of everything else. Without ``cu_seq_lens`` the
    convolution is the stock one, and the delta rule runs the same scan as a
    packed row (each padded row one segment); on CUDA with the kernel packages
    both are the kernels. Each call is recorded (backends/model/kernels.py).
    """
    modeling = sys.modules[module_name]
    for name, make in _MODULE_FUNCTIONS.items():
        current = getattr(modeling, name, None)
        if current is None:
            raise RuntimeError(f"{module_name} has no {name}: this transformers version is not supported for packing")
        if not hasattr(current, _PACKED_MARK):
            setattr(modeling, name, make(current))


def is_prepared_for_packing(model: torch.nn.Module) -> bool:
    for module in model.modules():
        config = getattr(module, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and not (impl.startswith(PACKED_PREFIX) or impl.startswith("flash_attention")):
            return False
        if type(module).__name__.endswith("GatedDeltaNet"):
            modeling = sys.modules[type(module).__module__]
            if not all(hasattr(getattr(modeling, n, None), _PACKED_MARK) for n in _MODULE_FUNCTIONS):
                return False
    return True


def prepare_model_for_packing(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` run packed rows exactly; idempotent, and a no-op for calls without ``cu_seq_lens``.

    - every config's attention implementation X becomes ``packed_X`` (flash
      attention already honours ``cu_seq_lens`` and is left as it is);
    - the gated delta-net modeling module gets boundary-aware conv and delta rule.
    Returns the same model.
    """
    from transformers import PretrainedConfig

    modules = list(model.modules())
    configs = {id(m.config): m.config for m in modules if isinstance(getattr(m, "config", None), PretrainedConfig)}
    # where the model's own eager attention lives (only needed when the model runs eager)
    modeling = next(
        (type(m).__module__ for m in modules if hasattr(sys.modules[type(m).__module__], "eager_attention_forward")), ""
    )
    for config in configs.values():
        impl = config._attn_implementation or "sdpa"
        if not (impl.startswith(PACKED_PREFIX) or impl.startswith("flash_attention")):
            config._attn_implementation = _register_packed_attention(impl, modeling)
    for module_name in {type(m).__module__ for m in modules if type(m).__name__.endswith("GatedDeltaNet")}:
        _patch_linear_attention_module(module_name)
    _record_other_kernels(modules)
    return model


# ---------------------------------------------------------------------------- recording what runs

_HOOKED = "_balance_batch_kernel_hook"


def _record_flash_attention(module, args, kwargs) -> None:
    varlen = kwargs.get("cu_seq_lens_q") is not None
    kernels.note("attention", kernels.FLASH_ATTN + ("-varlen" if varlen else ""))


def _record_experts(module, args) -> None:
    implementation = getattr(module.config, "_experts_implementation", None) or "eager"
    if implementation != "grouped_mm":  # grouped_mm is recorded per call by _grouped_mm (it may fall back)
        kernels.note("moe_experts", implementation + ("-loop" if implementation == "eager" else ""))


def _patch_grouped_mm() -> None:
    """Record each grouped GEMM of the MoE experts as torch's grouped_mm or transformers' per-expert fallback."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return
    current = getattr(moe, "_grouped_mm", None)
    check = getattr(moe, "_can_use_grouped_mm", None)
    if current is None or check is None or hasattr(current, _PACKED_MARK):
        return

    @functools.wraps(current)
    def _grouped_mm(input, weight, offs, *args, **kwargs):
        kernels.note("moe_experts", kernels.GROUPED_MM if check(input, weight, offs) else kernels.GROUPED_MM_LOOP)
        return current(input, weight, offs, *args, **kwargs)

    setattr(_grouped_mm, _PACKED_MARK, current)
    moe._grouped_mm = _grouped_mm


def _record_other_kernels(modules: Sequence[torch.nn.Module]) -> None:
    """Hooks that record the MoE experts' implementation and flash attention (which the model dispatches itself)."""
    _patch_grouped_mm()
    for module in modules:
        if getattr(module, _HOOKED, False):
            continue
        config = getattr(module, "config", None)
        name = type(module).__name__
        if name.endswith("Experts") and hasattr(config, "_experts_implementation"):
            module.register_forward_pre_hook(_record_experts)
        elif (name.endswith("Attention") and hasattr(module, "q_proj")
              and str(getattr(config, "_attn_implementation", "")).startswith("flash_attention")):
            module.register_forward_pre_hook(_record_flash_attention, with_kwargs=True)
        else:
            continue
        setattr(module, _HOOKED, True)
