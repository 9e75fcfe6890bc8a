"""Make a Hugging Face model keep a packed row's sequences apart, or refuse it: ``prepare_model_for_packing`` (one call,
idempotent) and the cheap ``check_packable``.

A packed row (``balance_batch.collate.pack_collate``) holds several sequences
end to end, ``position_ids`` restarting at 0 for each and ``cu_seq_lens_q/k``
marking the boundaries. What keeps them apart in transformers (5.x):

- sdpa, eager and flex attention: the block-diagonal mask transformers builds
  from the restarting ``position_ids`` (``masking_utils``), but only when the
  forward makes no cache; ``pack_collate``'s batch says ``use_cache=False``;
- flash attention: its varlen kernel on ``cu_seq_lens``;
- nothing, in layers that carry state from token to token (state-space,
  recurrent, short convolutions, linear attention): their pure-torch
  fallbacks run across boundaries. The gated delta-net (Qwen3.5) is made
  right here: ``prepare_model_for_packing`` swaps its short causal
  convolution and chunked delta rule for boundary-aware versions that
  delegate to the stock function (or to the causal-conv1d /
  flash-linear-attention kernels when installed, on CUDA) and are exactly
  the stock path when no boundaries are given. Other such layers are refused.

``prepare_model_for_packing`` also makes every attention implementation X
``packed_X``, an attention function registered with
``transformers.AttentionInterface`` that runs SDPA once per sequence given
``cu_seq_lens`` (cost: the sum of per-sequence costs; the (row length)² mask is
then never needed; flash attention is left as it is). The per-sequence
computations are in segments.py; what ran is recorded (kernels.py).

Inside a compiled layer these functions run eagerly (``torch.compiler.disable``):
their work depends on where sequences start and end, and tracing them would
compile a graph per set of boundaries.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Callable, Optional

import torch

from balance_batch.integrations.transformers import kernels
from balance_batch.integrations.transformers.segments import (
    int64_bounds,
    segment_attention,
    segment_causal_conv1d,
    segment_chunk_gated_delta_rule,
)

PACKED_PREFIX = "packed_"  # registered attention name = prefix + the model's own implementation
_PACKED_MARK = kernels.SWAPPED_MARK  # set on our replacement functions (idempotence)

# Attention implementations that keep a packed row's sequences apart on their own (see the module's docstring).
# Elsewhere (paged|eager, a hub kernel, anything registered by name) transformers builds no mask at all for a
# name it has no mask function for, so the row attends across sequences: refused.
KEPT_APART = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")

# Layers that mix tokens other than by attention, by their transformers class names (5.x): state carried from one
# token to the next crosses a boundary unless the layer is made to restart there (only the gated delta-net is).
_STATEFUL_LAYER = re.compile(
    r"Mamba\w*(Mixer|Layer)$|Mixer$|ShortConv|GatedDeltaNet$|DeltaAttention$|LinearAttention$|LightningAttention$"
    r"|RecurrentBlock$|^Rwkv|^xLSTM"
)
# The functions transformers' modeling code builds its masks with; a model without them builds no packed mask.
_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")


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
    """``function`` run eagerly inside a compiled layer (as under the harness's backend.compile=true).

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
                raise ValueError("a packed row runs without a cache (use_cache=False, which pack_collate's batch "
                                 "sets): no initial or final recurrent state")
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
    both are the kernels. Each call is recorded (kernels.py).
    """
    modeling = sys.modules[module_name]
    for name, make in _MODULE_FUNCTIONS.items():
        current = getattr(modeling, name, None)
        if current is None:
            raise RuntimeError(f"{module_name} has no {name}: this transformers version is not supported for packing")
        if not hasattr(current, _PACKED_MARK):
            setattr(modeling, name, make(current))


# ---------------------------------------------------------------------------- what can run packed


def _transformers_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__module__.startswith("transformers.models.")]


def _attention_implementations(model: torch.nn.Module) -> dict[str, str]:
    """Each config's attention implementation, by the config's class name."""
    from transformers import PretrainedConfig

    found = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            found.setdefault(type(config).__name__, config._attn_implementation or "sdpa")
    return found


def _swapped(module: torch.nn.Module) -> bool:
    """Whether a gated delta-net's modeling module runs our boundary-aware conv and delta rule."""
    modeling = sys.modules[type(module).__module__]
    return all(hasattr(getattr(modeling, n, None), _PACKED_MARK) for n in _MODULE_FUNCTIONS)


def _refusal(model: torch.nn.Module, preparing: bool) -> Optional[str]:
    """Why a packed row would run across sequences in ``model`` (None: it would not). ``preparing``: what
    ``prepare_model_for_packing`` makes right (an unprepared gated delta-net) is not a reason."""
    from transformers import PreTrainedModel

    for owner, impl in _attention_implementations(model).items():
        if impl not in KEPT_APART and not impl.startswith(PACKED_PREFIX):
            return (f"attention implementation {impl!r} ({owner}) keeps no packed sequences apart (transformers builds "
                    f"it no mask from position_ids and it reads no cu_seq_lens); valid: {', '.join(KEPT_APART)}")
    modules = _transformers_modules(model)
    for module in modules:
        name = type(module).__name__
        if isinstance(module, PreTrainedModel):
            modeling = sys.modules[type(module).__module__]
            if not any(hasattr(modeling, f) for f in _MASK_BUILDERS):
                return (f"{name} builds its attention mask without transformers' masking_utils, so no mask keeps "
                        f"packed sequences apart; valid: models whose modeling code calls create_causal_mask")
        elif _STATEFUL_LAYER.search(name):
            if name.endswith("GatedDeltaNet") and all(hasattr(sys.modules[type(module).__module__], n)
                                                      for n in _MODULE_FUNCTIONS):
                if preparing or _swapped(module):
                    continue
                return f"{name} runs across packed sequences until prepared: call prepare_model_for_packing(model)"
            return (f"{name} carries state from token to token across packed sequences and cannot be made to restart "
                    f"at each; valid: attention-only models, and gated delta-net models (Qwen3.5) once prepared")
    return None


def check_packable(model: torch.nn.Module) -> None:
    """Raise one-line ValueError unless a packed row (``pack_collate``'s batch) keeps its sequences apart in
    ``model`` as it is now: attention implementations that honour ``position_ids`` or ``cu_seq_lens``, masks built by
    transformers' masking_utils, and no layer carrying state across sequences (a gated delta-net only once
    ``prepare_model_for_packing`` ran). Cheap: reads the model's configs and class names, runs nothing."""
    reason = _refusal(model, preparing=False)
    if reason is not None:
        raise ValueError(f"packed rows cannot run on {type(model).__name__}: {reason}")


def is_prepared_for_packing(model: torch.nn.Module) -> bool:
    """Whether ``prepare_model_for_packing`` ran on ``model``: every attention ``packed_X`` or flash, every gated
    delta-net's functions swapped."""
    for module in model.modules():
        config = getattr(module, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and not (impl.startswith(PACKED_PREFIX) or impl.startswith("flash_attention")):
            return False
        if type(module).__name__.endswith("GatedDeltaNet") and not _swapped(module):
            return False
    return True


def prepare_model_for_packing(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` run packed rows exactly, or raise one-line ValueError where it cannot (``check_packable``'s
    rule); idempotent, and a no-op for calls without ``cu_seq_lens``. Works on the bare model and under peft,
    ``fully_shard`` and megatron-core DDP, with or without gradient checkpointing.

    - every config's attention implementation X becomes ``packed_X`` (flash
      attention already honours ``cu_seq_lens`` and is left as it is);
    - the gated delta-net modeling module gets boundary-aware conv and delta rule;
    - the kernels the model dispatches itself (MoE experts, flash attention) are
      recorded as they run (``kernels.record_dispatched_kernels``), so every
      prepared model's pass says what ran.
    Returns the same model.
    """
    from transformers import PretrainedConfig

    reason = _refusal(model, preparing=True)
    if reason is not None:
        raise ValueError(f"prepare_model_for_packing: {reason}")
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
