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

This module lays the row out and dispatches; the per-sequence computations
themselves (SDPA per sequence, the segment convolution and delta-rule scan)
are in backends/model/segments.py.

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

from backends.messages import Example
from backends.model import kernels
from backends.model.configs import PACKED_MODEL_TYPES
from backends.model.segments import (
    int64_bounds,
    remember_bounds,
    segment_attention,
    segment_causal_conv1d,
    segment_chunk_gated_delta_rule,
)
from backends.runtime.devices import host_to_device

PACKED_PREFIX = "packed_"  # registered attention name = prefix + the model's own implementation
_PACKED_MARK = kernels.SWAPPED_MARK  # set on our replacement functions (idempotence)


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
    as_row = lambda a: host_to_device(a, device).unsqueeze(0)  # noqa: E731
    cu_seqlens = host_to_device(cu, device)
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


# ---------------------------------------------------------------------------- dispatch


def _cuda_kernel_available(name: str) -> bool:
    """Whether a CUDA kernel package (flash_attn, fla, causal_conv1d) imports; decided once per process."""
    return kernels.package_imports(name)


def _runs_kernel(bound: Optional[bool], package: str) -> bool:
    """Whether the stock function runs ``package``'s kernel for CUDA tensors: what transformers bound at its import
    (``kernels.transformers_bound_kernel``) where it says, else whether the package imports."""
    return _cuda_kernel_available(package) if bound is None else bound


def _fla_runs(query: torch.Tensor, bound: Optional[bool]) -> bool:
    """Whether the delta rule runs fla's kernel: CUDA tensors, and fla bound or importable."""
    return query.is_cuda and _runs_kernel(bound, "fla")


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
    attention = _eager(functools.partial(segment_attention, original, implementation))
    attention.__name__ = attention.__qualname__ = f"{name}_attention"  # what a graph break's reason names
    AttentionInterface.register(name, attention)
    # The padded path builds the same masks as before (nothing changes without cu_seq_lens).
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name


# ---------------------------------------------------------------------------- short convolution


def _packed_conv1d(original: Callable) -> Callable:
    torch_conv1d = _torch_function(original)
    bound = kernels.transformers_bound_kernel(original)

    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        fused = hidden_states.is_cuda and _runs_kernel(bound, "causal_conv1d")
        kernels.note("short_conv", kernels.CAUSAL_CONV1D if fused else kernels.TORCH_CONV1D)
        if cu is None:
            # CPU tensors take the torch function even where causal-conv1d imports (a CPU rank on a GPU host)
            return (original if fused else torch_conv1d)(hidden_states, weight, bias, activation=activation, **kwargs)
        if fused:
            # causal-conv1d keeps sequences apart by seq_idx (the layer hands it a channel-last view)
            bounds, _ = int64_bounds(cu)
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


def _packed_delta_rule(original: Callable) -> Callable:
    torch_delta_rule = _torch_function(original)
    bound = kernels.transformers_bound_kernel(original)

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
        if _fla_runs(query, bound):
            # the stock wrapper dispatches to flash-linear-attention, whose kernel takes cu_seqlens (int64, and,
            # given the host copy, computes its chunk indices without a device-to-host sync, once per micro-batch:
            # every layer gets the same two tensors)
            kernels.note("delta_rule", kernels.FLA_CHUNK)
            if cu_seqlens is None:
                return original(query, key, value, chunk_size=chunk_size, **common, **kwargs)
            device_bounds, host = int64_bounds(cu_seqlens)
            return original(query, key, value, **common, cu_seqlens=device_bounds, cu_seqlens_cpu=host)
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
    - the gated delta-net modeling module gets boundary-aware conv and delta rule;
    - the kernels the model dispatches itself (MoE experts, flash attention) are
      recorded as they run (``kernels.record_dispatched_kernels``), so every
      prepared model's pass says what ran.
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
    kernels.record_dispatched_kernels(modules)
    return model
