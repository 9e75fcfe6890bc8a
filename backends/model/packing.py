"""Packed micro-batches of the harness: sequences laid end to end in one row, with nothing crossing a boundary.

A packed micro-batch is one row of its sequences end to end, no padding.
Position ids restart at 0 for each sequence and ``cu_seq_lens_q/k`` (the
cumulative lengths, Hugging Face's name for flash-attention's ``cu_seqlens``)
mark the boundaries. The model is the stock Hugging Face model, made to keep
the sequences apart by the library's ``prepare_model_for_packing``
(balance_batch/integrations/transformers/packing.py), called once after
building it; a ``PackedBatch``'s ``model_kwargs()`` then run through its
forward. This module lays the row out and holds the harness's own rule of
which models it packs (``check_packable``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from backends.messages import Example
from backends.model.configs import PACKED_MODEL_TYPES
from balance_batch.integrations.transformers.segments import host_to_device, remember_bounds

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
    """Raise ValueError unless packing keeps sequences apart in this model's architecture (``PACKED_MODEL_TYPES``)
    and the library's probe finds packed rows exact on it (``balance_batch...packing.check_packable``).

    Elsewhere a packed row would fail deep in the model's mask code, or, worse,
    run with attention across sequences. The harness refuses such a run from
    config.json before loading (``configs.check_model_spec``); this is the
    same rule for a backend driven directly. The probe runs the Hugging Face
    model inside any wrapper, where this process holds its whole parameters
    (not sharded by FSDP2, which the probe of ``prepare_model_for_packing`` at
    build time covers). Decided once per model.
    """
    if _PACKABLE.get(model):
        return
    from transformers import PreTrainedModel

    from balance_batch.integrations.transformers.packing import check_packable as probe_packable

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    if model_type not in PACKED_MODEL_TYPES:
        name = type(hf).__name__ if hf is not None else type(model).__name__
        raise ValueError(f"layout=packed cannot run {name} (model_type {model_type!r}): packed rows are kept apart "
                         f"only in Qwen3.5-MoE models (model_type {' / '.join(PACKED_MODEL_TYPES)}); use layout=padded")
    probe_packable(hf)
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
