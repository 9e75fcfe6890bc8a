"""Model construction: a Hugging Face causal LM (tiny random Qwen3.5-MoE or a local checkpoint) with LoRA."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Optional

import torch

from backends.errors import UserError
from backends.model.checkpoint import (
    check_checkpoint,
    check_model_path,
    check_weight_files,
    load_config,
    weights_loaded,
)
from backends.model.configs import TINY_CONFIG
from backends.model.logprobs import install_logprob_head
from backends.runtime.collector import freeze_before_the_model
from backends.specs import ModelSpec
from balance_batch.integrations.transformers import kernels
from balance_batch.integrations.transformers.packing import prepare_model_for_packing

log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    valid = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in valid:
        raise UserError(f"model.dtype: '{name}' is not supported (valid: auto, {', '.join(valid)})")
    return valid[name]


def model_vocab_size(spec: ModelSpec) -> int:
    """Vocabulary size, read from the config only (no weights are loaded).

    What the harness and the server call before any process is started, so a
    checkpoint is checked here first (``checkpoint.check_checkpoint``: its
    config, its weight files, and that they hold the model's weights).
    """
    path = check_checkpoint(spec)
    if path is None:
        return int(spec.vocab_size or TINY_CONFIG["vocab_size"])
    config = load_config(path)
    config = getattr(config, "text_config", None) or config
    return int(config.vocab_size)


def quiet_library_noise(device: torch.device) -> None:
    """Silence messages that mislead on this device (GPU kernel advice on a CPU run, a rename notice)."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    if device.type == "cpu":  # fla / causal-conv1d are GPU kernels: the torch path is the right one on CPU
        logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)


PLACES = ("device", "cpu", "meta")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, found by the class names Hugging Face marks as not to be split.

    By the classes a module's class derives from too: ``fully_shard`` gives each
    layer a subclass of its own (``FSDPQwen3_5MoeDecoderLayer``).
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def build_model(
    spec: ModelSpec, device: torch.device, gradient_checkpointing: bool, place: str = "device"
) -> torch.nn.Module:
    """The causal LM in train mode, with LoRA adapters when ``lora_rank > 0``.

    Every rank calls this with the same spec and gets the same weights: the
    tiny model is initialised from ``init_seed``, a checkpoint is read from disk.
    ``device`` decides the dtype ("auto": bf16 on CUDA); ``place`` where the
    weights go: "device" (a checkpoint is read straight onto it, no host copy
    kept), "cpu" (host memory, a source to broadcast from) or "meta" (shapes
    only, nothing allocated or read: FSDP2 shards this and loads the shards).
    """
    if place not in PLACES:
        raise ValueError(f"place must be one of {PLACES}, got {place!r}")
    quiet_library_noise(device)
    dtype = resolve_dtype(spec.dtype, device)
    if spec.lora_rank < 0:
        raise UserError(f"model.lora_rank: must be >= 0 (0 = full fine-tuning), got {spec.lora_rank}")
    path = check_model_path(spec)
    kwargs = {}
    # Chosen once for both layouts (flash-attn on CUDA in half precision when it imports, else SDPA),
    # so neither layout gets a faster attention than the other.
    attention = kernels.attention_implementation(spec.attn_implementation, device.type, dtype in HALF_DTYPES)
    if attention != "sdpa" or spec.attn_implementation:
        kwargs["attn_implementation"] = attention
    freeze_before_the_model()  # a pass's collection then skips the imported heap (backends/runtime/collector.py)
    model = _base_model(spec, path, device, dtype, place, kwargs)
    model.config.use_cache = False
    # Before LoRA and wrapping: the chunked log-prob head must be the module FSDP2 and peft see.
    install_logprob_head(model)
    if spec.lora_rank > 0:
        model = _add_lora(model, spec, dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    # Packed rows kept apart, padded and packed on the same kernels, every kernel call recorded
    # (backends/model/packing.py); probed where it will run (not rank 0's host copy, whose weights only go to shards).
    prepare_model_for_packing(model, probe=place != "cpu")
    return model


def _base_model(spec: ModelSpec, path: Optional[Path], device: torch.device, dtype: torch.dtype, place: str,
                kwargs: dict) -> torch.nn.Module:
    """The Hugging Face model without adapters: the tiny one built from ``init_seed``, or the checkpoint at ``path``
    read (``place`` "device" or "cpu") or shaped only ("meta"). ``kwargs``: the attention implementation, if any."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    target = torch.device("cpu") if place == "cpu" else device
    if path is None:
        config = dict(TINY_CONFIG)
        if spec.vocab_size:
            config["vocab_size"] = int(spec.vocab_size)
        if place == "meta":
            with torch.device("meta"):
                model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config, **kwargs))
            model = model.to(dtype=dtype)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.init_seed)
                model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config, **kwargs))
            model = model.to(device=target, dtype=dtype)
    elif place == "meta":
        config = load_config(path, **kwargs)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    else:
        load_config(path)  # config.json and the weight files' headers first: a broken file is named, in one line
        check_weight_files(path)
        # On a GPU straight onto it (device_map; accelerate comes with peft): from_pretrained
        # reads tensor by tensor into the device, so no host copy of the model is kept.
        device_map = target if target.type == "cuda" else None
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, device_map=device_map, output_loading_info=True, **kwargs
        )
        # Weights the files lack (left random) or hold beyond the model: refused unless allowed, then recorded.
        setattr(model, _WEIGHTS_RECORD, weights_loaded(spec, info["missing_keys"], info["unexpected_keys"],
                                                         level=logging.DEBUG))
        if device_map is None:
            model = model.to(target)
    return model


def _add_lora(model: torch.nn.Module, spec: ModelSpec, dtype: torch.dtype) -> torch.nn.Module:
    """peft LoRA adapters of rank ``spec.lora_rank`` on every linear layer, initialised from ``init_seed + 1``, computed
    in ``dtype``."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=spec.lora_rank,
        lora_alpha=spec.lora_alpha or spec.lora_rank,
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
    )
    # On meta the adapters are shapes only: their values come with the base weights (see backends/model/loading.py).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed + 1)
        model = get_peft_model(model, lora)
    set_adapter_compute_dtype(model, dtype)
    return model


HALF_DTYPES = (torch.bfloat16, torch.float16)


def _adapter_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A LoRA factor computed in its module's compute dtype; its float32 weight gets a float32 gradient."""
    dtype = self._balance_batch_compute_dtype
    bias = None if self.bias is None else self.bias.to(dtype)
    return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)


def set_adapter_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Compute the LoRA adapters in ``dtype`` (the base model's) while they stay float32: the one precision policy.

    What a LoRA fine-tune on GPUs does, and what FSDP2's mixed-precision policy
    does by itself (it casts every parameter, adapters included, to bf16 for
    compute and reduces gradients in float32): frozen base weights in bf16,
    adapters stored in float32 (peft's default for a half-precision base),
    computed in bf16, their gradients accumulated and reduced in float32.
    Megatron DDP and PyTorch would otherwise compute the adapters in float32
    (peft casts the input up), so FSDP2 and Megatron rows would not be like
    for like. A no-op for a float32 model. Returns the number of LoRA factors set.
    """
    if dtype not in HALF_DTYPES:
        return 0
    import types

    count = 0
    for module in model.modules():
        for name in ("lora_A", "lora_B"):
            factors = getattr(module, name, None)
            if not isinstance(factors, torch.nn.ModuleDict):
                continue
            for linear in factors.values():
                if isinstance(linear, torch.nn.Linear):
                    linear._balance_batch_compute_dtype = dtype
                    linear.forward = types.MethodType(_adapter_forward, linear)
                    count += 1
    return count


def adapter_compute_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype the LoRA adapters compute in (``set_adapter_compute_dtype``), else their own; None without adapters."""
    for module in model.modules():
        factors = getattr(module, "lora_A", None)
        if isinstance(factors, torch.nn.ModuleDict):
            for linear in factors.values():
                return getattr(linear, "_balance_batch_compute_dtype", linear.weight.dtype)
    return None


def _dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def describe_precision(model: torch.nn.Module, reduce: Optional[torch.dtype]) -> dict:
    """The precision policy that runs, for results.json: parameters, adapters, compute, gradient reduction.

    ``params``: the frozen base weights (or every weight under full
    fine-tuning); ``adapters``: the trainable LoRA weights as stored (None
    without LoRA); ``compute``: the dtype the matrix products run in;
    ``reduce``: the dtype gradients are summed across ranks in (None: one
    rank, nothing reduced); ``grads``: the dtype trainable gradients accumulate in.
    """
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad] or params
    trainable = [p for p in params if p.requires_grad]
    base = frozen[0].dtype if frozen else None
    adapters = adapter_compute_dtype(model)
    return {
        "params": _dtype_name(base),
        "adapters": _dtype_name(trainable[0].dtype) if adapters is not None and trainable else None,
        "compute": _dtype_name(base),
        "reduce": _dtype_name(reduce),
        "grads": _dtype_name(trainable[0].dtype) if trainable else None,
    }


def load_method(spec: ModelSpec) -> str:
    """How ``build_model`` gets the weights: "from_pretrained" (a checkpoint) or "from_config" (the tiny model)."""
    return "from_config" if spec.path is None else "from_pretrained"


# Set on a model read from a checkpoint: the weights its files lacked and held beyond it (checkpoint.weights_loaded).
_WEIGHTS_RECORD = "_balance_batch_weights"


def loaded_weights(model: torch.nn.Module) -> dict:
    """``missing_weights`` and ``unexpected_weights`` of the checkpoint read into ``model`` ([] each when it
    matched); None each when nothing was read (the tiny model, a meta build)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return dict(getattr(base, _WEIGHTS_RECORD, None) or {"missing_weights": None, "unexpected_weights": None})


def describe_model(model: torch.nn.Module, spec: ModelSpec) -> dict:
    """What was built, for results.json: architecture, parameter counts, vocabulary, dtype, source, weights left out."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    params = list(model.parameters())
    return {
        "architecture": type(base).__name__,
        "model_type": getattr(config, "model_type", None),
        "n_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "vocab_size": int(config.vocab_size),
        "n_params": sum(p.numel() for p in params),
        "n_trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "dtype": str(params[0].dtype).removeprefix("torch."),
        "source": "random init (tiny, built in code)" if spec.path is None else f"checkpoint {spec.path}",
        **loaded_weights(model),  # only with model.allow_missing_weights=true can a list be non-empty
    }
