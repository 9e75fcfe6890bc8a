"""An item's loss tokens as the collates lay it out, without torch: what the Trainer's checks count for a map-style
dataset and what a stream counts as it reads. ``pack_collate`` and ``pad_collate`` write the same labels with torch
(``balance_batch.collate``)."""

from __future__ import annotations

import sys

import numpy as np

IGNORE_INDEX = -100  # what Hugging Face losses skip


def flat(values):
    """A sequence of token ids (or labels) as a flat list, or as a 1-D tensor or array."""
    if isinstance(values, list) and (not values or not isinstance(values[0], (list, tuple))):
        return values  # counted with len and list.count, at C speed
    torch = sys.modules.get("torch")  # a tensor exists only where torch is imported
    if torch is not None and isinstance(values, torch.Tensor):
        return values.reshape(-1)
    return np.asarray(values).reshape(-1)


def loss_tokens(labels) -> int:
    """The tokens a sequence's loss counts, given its labels (or, without labels, its ids): the labels after the
    first that are not -100 (the first predicts nothing: the collates set it to -100)."""
    lab = flat(labels)
    if isinstance(lab, list):
        return max(len(lab) - 1 - lab[1:].count(IGNORE_INDEX), 0)
    return int((lab[1:] != IGNORE_INDEX).sum())
