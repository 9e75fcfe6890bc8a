"""Make a Hugging Face model run packed rows exactly, or refuse it in one line: ``prepare_model_for_packing`` (one
call, idempotent) and ``check_packable``, which decides by running the model.

A packed row (``balance_batch.collate.pack_collate``) holds several sequences
end to end, ``position_ids`` restarting at 0 for each and ``cu_seq_lens_q/k``
marking the boundaries. Whether a model keeps them apart is decided by what it
does, not by what its code looks like: models build their positions and masks
in many ways (from ``position_ids``, from an attention mask's running sum, from
the row's index; ALiBi biases; sinks), and a rule read from configs and class
names accepted models whose packed sequences attended to each other. So
``check_packable`` probes the model itself: two short sequences in one row,
each against itself alone, and the first changed, which must leave the second's
logits exactly as they were (``_probe``; four forwards of at most 22 tokens).

``prepare_model_for_packing`` makes an sdpa or eager model's attention
``packed_sdpa`` / ``packed_eager``, registered with transformers'
``AttentionInterface``: the layer's own attention function, run once per
sequence on that sequence's block of the mask (segments.py), so sliding
windows, sinks, soft-capping and scaling hold as for the sequence alone, and
the cost is the sum of per-sequence costs. Layers that carry state from token
to token (state-space, recurrent, short convolutions, linear attention) run
across boundaries in their pure-torch fallbacks; the gated delta-net (Qwen3.5)
is made right here: its short causal convolution and chunked delta rule are
swapped for boundary-aware versions that delegate to the stock function (or
to the causal-conv1d / flash-linear-attention kernels when installed, on CUDA)
and are exactly the stock path when no boundaries are given. Other such layers
are refused. The prepared model is probed; where per-sequence attention is not
exact but the model's own attention is, the model keeps its own, and where
neither is, it is left as it was and refused. What ran is recorded
(kernels.py). Which model types end where is a sweep anyone can rerun
(scripts/packing_sweep.py; its table is in docs/library.md).

Inside a compiled layer these functions run eagerly (``torch.compiler.disable``):
their work depends on where sequences start and end, and tracing them would
compile a graph per set of boundaries.
"""

from __future__ import annotations

import functools
import re
import sys
import weakref
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

# Attention implementations prepare_model_for_packing runs once per sequence (the layer's own function on each
# sequence's block of the mask); flex and flash attention keep sequences apart as they are.
PER_SEQUENCE = ("sdpa", "eager")
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


def _register_packed_attention(implementation: str) -> str:
    """Register ``packed_<implementation>`` (attention and mask functions) once per process; return its name.

    The function looks the layer's own attention up at each call (``segments.own_attention``): eager is each model's
    own ``eager_attention_forward``, so models prepared one after another in a process each run theirs.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = PACKED_PREFIX + implementation
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    attention = _eager(functools.partial(segment_attention, implementation))
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

    def dispatch(query, key, value, g, beta, chunk_size: int = 64, initial_state=None, output_final_state: bool = False,
                 use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None, **kwargs):
        common = dict(
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        if _fla_runs(query, bound):
            return _fla_delta_rule(original, query, key, value, chunk_size, cu_seqlens, common, kwargs)
        if initial_state is not None or output_final_state:
            if cu_seqlens is not None:
                raise ValueError("a packed row runs without a cache (use_cache=False, which pack_collate's batch "
                                 "sets): no initial or final recurrent state")
            # a recurrent state (generation): transformers' torch function, never a Triton kernel for CPU tensors
            kernels.note("delta_rule", kernels.TRANSFORMERS_TORCH_CHUNK)
            return torch_delta_rule(query, key, value, chunk_size=chunk_size, **common, **kwargs)
        # the scan records itself: a path that does not reach it records nothing
        return _scanned_delta_rule(query, key, value, g, beta, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel), None

    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(*args, **kwargs):
        with kernels.span("delta_rule"):  # a profiled pass's delta-rule time, whichever kernel runs it
            return dispatch(*args, **kwargs)

    torch_chunk_gated_delta_rule = _eager(torch_chunk_gated_delta_rule)
    setattr(torch_chunk_gated_delta_rule, _PACKED_MARK, original)
    return torch_chunk_gated_delta_rule


def _fla_delta_rule(original: Callable, query, key, value, chunk_size: int, cu_seqlens, common: dict, kwargs: dict):
    """The stock wrapper's dispatch to flash-linear-attention, whose kernel takes ``cu_seqlens`` (int64, and, given
    the host copy, computes its chunk indices without a device-to-host sync, once per micro-batch: every layer gets
    the same two tensors)."""
    kernels.note("delta_rule", kernels.FLA_CHUNK)
    if cu_seqlens is None:
        return original(query, key, value, chunk_size=chunk_size, **common, **kwargs)
    device_bounds, host = int64_bounds(cu_seqlens)
    return original(query, key, value, **common, cu_seqlens=device_bounds, cu_seqlens_cpu=host)


def _scanned_delta_rule(query, key, value, g, beta, cu_seqlens, chunk_size: int, use_qk_l2norm_in_kernel: bool
                        ) -> torch.Tensor:
    """The delta rule by the segment scan (segments.py): over a packed row's sequences, or, without ``cu_seqlens``,
    over a padded batch whose rows are each one segment, so the two layouts differ by what they compute (padding),
    not by the fallback they get."""
    if cu_seqlens is not None:
        return segment_chunk_gated_delta_rule(
            query,
            key,
            value,
            g,
            beta,
            cu_seqlens,
            chunk_size=chunk_size,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
    batch, length = query.shape[:2]
    row = lambda t: t.reshape(1, batch * length, *t.shape[2:])  # noqa: E731
    bounds = list(range(0, batch * length + 1, length))
    out = segment_chunk_gated_delta_rule(
        row(query), row(key), row(value), row(g), row(beta), None, chunk_size=chunk_size,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, bounds=bounds,
    )
    return out.reshape(batch, length, *out.shape[2:])


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


def _configs(model: torch.nn.Module) -> dict:
    """Every distinct transformers config the model's modules hold, by id."""
    from transformers import PretrainedConfig

    return {id(m.config): m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)}


def _attention_implementations(model: torch.nn.Module) -> dict[str, str]:
    """Each config's attention implementation, by the config's class name."""
    found = {}
    for config in _configs(model).values():
        found.setdefault(type(config).__name__, config._attn_implementation or "sdpa")
    return found


def _swapped(module: torch.nn.Module) -> bool:
    """Whether a gated delta-net's modeling module runs our boundary-aware conv and delta rule."""
    modeling = sys.modules[type(module).__module__]
    return all(hasattr(getattr(modeling, n, None), _PACKED_MARK) for n in _MODULE_FUNCTIONS)


def _static_refusal(model: torch.nn.Module, preparing: bool) -> Optional[str]:
    """What the model's configs and layer classes already say keeps no packed sequences apart (None: nothing does;
    the probe then decides). ``preparing``: what ``prepare_model_for_packing`` makes right (an unprepared gated
    delta-net) is not a reason."""
    for owner, impl in _attention_implementations(model).items():
        if impl not in KEPT_APART and not impl.startswith(PACKED_PREFIX):
            return (f"attention implementation {impl!r} ({owner}) keeps no packed sequences apart (transformers builds "
                    f"it no mask from position_ids and it reads no cu_seq_lens); valid: {', '.join(KEPT_APART)}")
    for module in _transformers_modules(model):
        name = type(module).__name__
        if not _STATEFUL_LAYER.search(name):
            continue
        if name.endswith("GatedDeltaNet") and all(hasattr(sys.modules[type(module).__module__], n)
                                                  for n in _MODULE_FUNCTIONS):
            if preparing or _swapped(module):
                continue
            return f"{name} runs across packed sequences until prepared: call prepare_model_for_packing(model)"
        return (f"its {name} layers carry a recurrent state from token to token, which would run on from one packed "
                f"sequence into the next and cannot be made to restart at each; use pad_collate (one row per "
                f"sequence); packed rows run attention-only models, and gated delta-net models (Qwen3.5) once prepared")
    return None


# ---------------------------------------------------------------------------- the probe

# Two sequences in one row: the first is changed, the second must not notice; each must equal itself alone.
PROBE_LENGTHS = (13, 9)
# Largest difference of logits between a sequence in a packed row and alone that counts as rounding, in units of the
# logits' largest magnitude (at least 1), and at most FLOAT32_CAP in float32: there rounding is about 1e-7 of the scale
# on the models swept (scripts/packing_sweep.py; mixture-of-experts layers group a changed neighbour's tokens
# differently, 1e-7 too) and the smallest defect seen 4e-3. Half precision rounds to about 1e-2 of the scale; there the
# changed-neighbour test, which compares the same computation, keeps the float32 bound and catches small leaks.
PROBE_TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-9}
FLOAT32_CAP = 5e-5
HALF_PROBE_TOLERANCE = 0.05
_probed: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model in ``model`` (itself, or the one a peft or DDP wrapper holds); ``model`` if none."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)


def _probe_model_state(model: torch.nn.Module) -> tuple:
    """What decides the probe's answer besides the weights: each config's attention implementation and whether the
    gated delta-nets run our functions. A model changed since its probe is probed again."""
    impls = tuple(sorted(_attention_implementations(model).items()))
    nets = tuple(_swapped(m) for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    return impls, nets


def probeable(model: torch.nn.Module) -> bool:
    """Whether one process can run the model's forward by itself: its parameters are ordinary tensors on a device,
    not shaped only (meta) nor sharded across ranks (FSDP2's DTensors), where a forward needs every rank."""
    for p in model.parameters():
        if p.is_meta or type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor":
            return False
    return True


def _probe_tokens(config, n: int, generator: torch.Generator) -> torch.Tensor:
    vocab = int(getattr(config, "vocab_size", None) or 256)
    special = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # an id, a list of ids (several eos), or None
        value = getattr(config, name, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])
    choices = [t for t in range(min(vocab, 1000)) if t not in special and t >= min(3, vocab - 1)]
    return torch.tensor(choices)[torch.randint(len(choices), (n,), generator=generator)]


def _logits(model: torch.nn.Module, **batch) -> torch.Tensor:
    out = model(**batch)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[0].float()


def _probe(model: torch.nn.Module) -> Optional[str]:
    """Why packed rows are not exact on ``model`` (None: they are), found by running it: two sequences in one
    ``pack_collate`` row, each compared with itself alone (``model(input_ids=...)``), and the row again with the
    first sequence's tokens changed, where the second's logits must not change at all. Four forwards of at most 22
    tokens, without gradients, in eval mode, the global random state untouched; any error is an answer."""

    from balance_batch.collate import pack_collate

    config = getattr(_hf_model(model), "config", None)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    g = torch.Generator().manual_seed(0)
    first, second = (_probe_tokens(config, n, g) for n in PROBE_LENGTHS)
    changed = _probe_tokens(config, PROBE_LENGTHS[0], g)
    split = PROBE_LENGTHS[0]

    def row(*seqs):
        batch = pack_collate([{"input_ids": s} for s in seqs])
        batch.pop("labels")
        return _logits(model, **{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})

    was_training = model.training
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            try:
                alone = [_logits(model, input_ids=s[None].to(device), use_cache=False) for s in (first, second)]
            except Exception as exc:  # noqa: BLE001 - any failure of the model's own forward is the answer, in one line
                return f"its forward on input_ids alone fails ({type(exc).__name__}: {_one_line(exc)})"
            try:
                packed, again = row(first, second), row(changed, second)
            except Exception as exc:  # noqa: BLE001 - a packed forward that fails is the answer, in one line
                return f"its forward on a packed row fails ({type(exc).__name__}: {_one_line(exc)})"
    finally:
        model.train(was_training)
    try:
        return _compare(dtype, split, alone, packed, again)
    except Exception as exc:  # noqa: BLE001 - logits of other shapes than a causal LM's are an answer too
        return f"its packed logits do not compare with the sequences alone ({type(exc).__name__}: {_one_line(exc)})"


def _compare(dtype: torch.dtype, split: int, alone: list, packed: torch.Tensor, again: torch.Tensor) -> Optional[str]:
    """The probe's verdict from its four forwards' logits (``_probe``)."""
    scale = max(1.0, float(torch.cat(alone).abs().max()))
    tight = min(PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE[torch.float32]), FLOAT32_CAP / scale)
    leak = float((packed[split:] - again[split:]).abs().max()) / scale
    # the changed neighbour leaves the second sequence's computation as it was: in any dtype, only float32-sized noise
    if not leak <= tight:
        return (f"a packed sequence sees the one before it (its logits change by {leak:.2g} of their scale when the "
                f"other sequence's tokens change)")
    tolerance = tight if dtype in PROBE_TOLERANCE else HALF_PROBE_TOLERANCE
    for name, part, own in (("first", packed[:split], alone[0]), ("second", packed[split:], alone[1])):
        off = float((part - own).abs().max()) / scale
        if not off <= tolerance:
            return (f"the {name} sequence of a packed row differs from the sequence alone by {off:.2g} of the logits' "
                    f"scale (the model does not take each sequence's positions from position_ids, or mixes them)")
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _probe_cached(model: torch.nn.Module) -> Optional[str]:
    """``_probe``'s answer, kept per Hugging Face model: a wrapper around it (peft, a DDP module) shares its answer."""
    key = _hf_model(model)
    state = _probe_model_state(model)
    cached = _probed.get(key)
    if cached is not None and cached[0] == state:
        return cached[1]
    reason = _probe(model)
    _probed[key] = (state, reason)
    return reason


def check_packable(model: torch.nn.Module) -> None:
    """Raise a one-line ValueError unless a packed row (``pack_collate``'s batch) gives each of its sequences
    exactly what the sequence alone gives, on ``model`` as it is now.

    Decided by running the model (``_probe``): two short sequences in one row, each compared with itself alone, and
    the first changed, which must not change the second's logits. A rule read from configs and class names missed
    models that build their positions or masks their own way (OPT, MPT, BLOOM, GPT-OSS, ...); the probe cannot, for
    what it runs. Before it, what the configs already say refuses at no cost (an attention implementation that keeps
    nothing apart, a layer carrying a recurrent state). The answer is cached per model until its attention
    implementation or preparation changes. A model that cannot run a forward in this process alone (on the meta
    device, or sharded by FSDP2) is decided by the rule alone: probe it before sharding.

    Args:
        model: a Hugging Face causal LM (or a wrapper around one: peft, a compiled module), any dtype and device.
    Raises:
        ValueError: what is not exact, in one line, with what to do instead.
    """
    reason = _static_refusal(model, preparing=False)
    if reason is None and probeable(model):
        reason = _probe_cached(model)
    if reason is not None:
        raise ValueError(f"packed rows are not exact on {_model_name(model)}: {reason}")


def _model_name(model: torch.nn.Module) -> str:
    return type(_hf_model(model)).__name__


# Models prepare_model_for_packing finished (with per-sequence attention, or their own where that alone is exact),
# with the attention implementations and delta-net functions it left them with (``_probe_model_state``).
_prepared: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def is_prepared_for_packing(model: torch.nn.Module) -> bool:
    """Whether ``prepare_model_for_packing`` ran on ``model`` (or on a module it wraps), and its gated delta-nets
    still run the boundary-aware functions."""
    prepared = next((m for m in model.modules() if m in _prepared), None)
    return prepared is not None and _prepared[prepared] == _probe_model_state(prepared)


def prepare_model_for_packing(model: torch.nn.Module, *, probe: bool = True) -> torch.nn.Module:
    """Make ``model`` run packed rows exactly, or raise a one-line ValueError where it cannot; idempotent, and a
    no-op for calls without ``cu_seq_lens``. Works on the bare model and under peft, ``fully_shard`` and megatron-core
    DDP, with or without gradient checkpointing.

    - every config's sdpa or eager attention becomes ``packed_sdpa`` / ``packed_eager``: the layer's own attention
      function run once per sequence on that sequence's block of the mask, so windows, sinks, soft-capping, scaling
      and position biases hold as for the sequence alone (flex and flash attention are left as they are: transformers'
      block mask and flash's varlen kernel keep sequences apart);
    - the gated delta-net modeling module gets boundary-aware conv and delta rule;
    - the result is probed (``check_packable``'s probe); where per-sequence attention is not exact but the model's own
      attention is, the model keeps its own; where neither is, the model is left as it was and ValueError says why;
    - the kernels the model dispatches itself (MoE experts, flash attention) are recorded as they run
      (``kernels.record_dispatched_kernels``), so every prepared model's pass says what ran.

    A model on the meta device or sharded across ranks (FSDP2) cannot be probed by one process: it is prepared by the
    rule alone (prepare before sharding to have it probed). ``probe=False`` skips the probe too, for a copy that will
    never run (a host copy whose weights are only sent to the ranks' shards). Returns the same model.
    """
    if is_prepared_for_packing(model):
        return model
    reason = _static_refusal(model, preparing=True)
    if reason is not None:
        raise ValueError(f"prepare_model_for_packing: {reason}")
    configs = list(_configs(model).values())
    stock = [config._attn_implementation for config in configs]
    for config in configs:
        impl = config._attn_implementation or "sdpa"
        if impl in PER_SEQUENCE:
            config._attn_implementation = _register_packed_attention(impl)
    modules = list(model.modules())
    for module_name in {type(m).__module__ for m in modules if type(m).__name__.endswith("GatedDeltaNet")}:
        _patch_linear_attention_module(module_name)
    if probe and probeable(model):
        reason = _probe_cached(model)
        if reason is not None and stock != [c._attn_implementation for c in configs]:
            for config, impl in zip(configs, stock):  # the model's own attention, where that alone is exact
                config._attn_implementation = impl
            reason = _probe_cached(model)
        if reason is not None:
            for config, impl in zip(configs, stock):
                config._attn_implementation = impl
            raise ValueError(f"prepare_model_for_packing: packed rows are not exact on {_model_name(model)} and "
                             f"cannot be made so here: {reason}; use pad_collate (one row per sequence)")
    kernels.record_dispatched_kernels(modules)
    _prepared[model] = _probe_model_state(model)
    return model
