"""The torch-facing part of the library: a micro-batch laid end to end in one row, the padding-free layout Hugging Face
models take (``position_ids`` restarting at 0 for each sequence, plus flash-attention's cumulative lengths), or one
right-padded row per sequence with its attention mask (``layout="padded"``)."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from balance_batch.errors import positive_int
from balance_batch.tokens import IGNORE_INDEX


def _token_rows(samples: Sequence[Mapping], who: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sample's ``input_ids`` and ``labels`` (default a copy of its ``input_ids``) as 1-D int64 tensors, the
    labels copies the caller may change; one ValueError when a sample's two lengths differ."""
    ids, labels = [], []
    for sample in samples:
        seq = torch.as_tensor(sample["input_ids"], dtype=torch.long).reshape(-1)
        lab = torch.as_tensor(sample.get("labels", seq), dtype=torch.long).reshape(-1).clone()
        if lab.shape != seq.shape:
            raise ValueError(f"{who}: a sample's labels have {lab.numel()} tokens, its input_ids {seq.numel()}")
        ids.append(seq)
        labels.append(lab)
    return ids, labels


def pack_collate(samples: Sequence[Mapping], *, pad_token_id: int = 0, flash_attn_kwargs: bool = True) -> dict:
    """Lay samples end to end in one packed row, the padding-free layout Hugging Face causal LMs take.

    Each sequence's ``position_ids`` restart at 0 and its first label is -100, so the shifted loss never predicts
    across a boundary: a sequence of L tokens counts L - 1 loss tokens (``TokenBudgetSampler``'s default
    ``loss_tokens``), fewer where its own labels are -100. ``model(**batch)`` keeps the sequences apart on a model
    ``integrations.transformers.check_packable`` accepts (linear-attention models need ``prepare_model_for_packing``
    first). A sample of 0 tokens adds nothing to the row. No samples (the sampler's dummy micro-batch), or only
    samples of 0 tokens, give one ``pad_token_id`` token with no loss: it runs the model and adds nothing to the loss
    or the gradient.

    Args:
        samples: mappings with ``input_ids`` and optional ``labels`` (default: a copy of ``input_ids``), each a list,
            array or tensor of one sequence's ids; a sample's labels have as many tokens as its ids.
        pad_token_id: the token of the dummy row.
        flash_attn_kwargs: also return the boundaries varlen attention kernels read, ``cu_seq_lens_q/k`` and
            ``max_length_q/k``.

    Returns:
        The forward's keyword arguments: ``input_ids``, ``labels`` and ``position_ids``, int64 ``[1, total tokens]``;
        ``use_cache=False`` (transformers keeps packed sequences apart only without a cache); and with
        ``flash_attn_kwargs`` ``cu_seq_lens_q`` and ``cu_seq_lens_k`` (int32 cumulative lengths, ``[sequences +
        1]``) and ``max_length_q`` and ``max_length_k`` (the longest sequence's tokens, an int).

    Raises:
        KeyError: a sample has no ``input_ids``.
        ValueError: a sample's ``labels`` and ``input_ids`` differ in length.

    Example:
        >>> import torch
        >>> from balance_batch.collate import pack_collate
        >>> batch = pack_collate([{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": [8, 9]}])
        >>> batch["input_ids"]
        tensor([[5, 6, 7, 8, 9]])
        >>> batch["position_ids"]
        tensor([[0, 1, 2, 0, 1]])
        >>> batch["labels"]
        tensor([[-100,    6,    7, -100,    9]])
        >>> batch["cu_seq_lens_q"], batch["max_length_q"]
        (tensor([0, 3, 5], dtype=torch.int32), 3)
    """
    ids, labels = _token_rows(samples, "pack_collate")
    ids, labels = [s for s in ids if len(s)], [lab for lab in labels if len(lab)]  # a sample's two lengths are equal
    for lab in labels:
        lab[0] = IGNORE_INDEX
    if not ids:
        ids, labels = [torch.tensor([pad_token_id])], [torch.tensor([IGNORE_INDEX])]
    lengths = torch.tensor([len(s) for s in ids])
    cu = torch.zeros(len(ids) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    positions = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1].long(), lengths)
    batch = {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None], "position_ids": positions[None],
             # transformers builds the mask that keeps sequences apart from position_ids only when the forward makes
             # no cache, and a causal LM makes one by default (config.use_cache): attention would cross sequences
             "use_cache": False}
    if flash_attn_kwargs:
        longest = int(lengths.max())
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=longest, max_length_k=longest)
    return batch


def pad_collate(samples: Sequence[Mapping], *, pad_token_id: int = 0, pad_to_multiple_of: Optional[int] = None
                ) -> dict:
    """One right-padded row per sample, with the attention mask a stock Hugging Face model takes (``layout="padded"``).

    The labels are each sample's ``labels`` (default its ``input_ids``) with -100 on the padding; the model shifts
    them, so a sequence of L tokens counts L - 1 loss tokens, as with ``pack_collate``. No samples (the sampler's
    dummy micro-batch) give one ``pad_token_id`` token with no loss.

    Args:
        samples: mappings with ``input_ids`` and optional ``labels`` (default: a copy of ``input_ids``), each a list,
            array or tensor of one sequence's ids; a sample's labels have as many tokens as its ids.
        pad_token_id: the token on the padding (and of the dummy row).
        pad_to_multiple_of: round the width up to a multiple of this; None pads to the longest sample only.

    Returns:
        ``input_ids``, ``labels`` and ``attention_mask`` (1 on tokens, 0 on padding), each int64 ``[samples,
        width]``.

    Raises:
        KeyError: a sample has no ``input_ids``.
        ValueError: ``pad_to_multiple_of`` is not a positive integer or None, or a sample's ``labels`` and
            ``input_ids`` differ in length.

    Example:
        >>> from balance_batch.collate import pad_collate
        >>> batch = pad_collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}])
        >>> batch["input_ids"]
        tensor([[5, 6, 7],
                [8, 9, 0]])
        >>> batch["labels"]
        tensor([[   5,    6,    7],
                [-100,    9, -100]])
        >>> batch["attention_mask"]
        tensor([[1, 1, 1],
                [1, 1, 0]])
        >>> pad_collate([{"input_ids": [5, 6, 7]}], pad_to_multiple_of=4)["input_ids"]
        tensor([[5, 6, 7, 0]])
    """
    positive_int("pad_to_multiple_of", pad_to_multiple_of, none_ok=True, who="pad_collate")
    ids, labels = _token_rows(samples, "pad_collate")
    if not ids:  # the dummy: one token the model attends to (a row of only padding has nothing to attend to)
        return {"input_ids": torch.tensor([[pad_token_id]]), "labels": torch.tensor([[IGNORE_INDEX]]),
                "attention_mask": torch.ones(1, 1, dtype=torch.long)}
    width = max(len(s) for s in ids)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    batch = {"input_ids": torch.full((len(ids), width), pad_token_id, dtype=torch.long),
             "labels": torch.full((len(ids), width), IGNORE_INDEX, dtype=torch.long),
             "attention_mask": torch.zeros(len(ids), width, dtype=torch.long)}
    for row, (seq, lab) in enumerate(zip(ids, labels)):
        batch["input_ids"][row, : len(seq)] = seq
        batch["labels"][row, : len(seq)] = lab
        batch["attention_mask"][row, : len(seq)] = 1
    return batch
