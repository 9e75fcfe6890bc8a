"""From ``pack`` to training: a torch ``Dataset`` whose items are a ``Packing``'s rows, in a seeded order, each
collated (by default ``pack_collate``: the row's sequences, or pieces of them, end to end); and a
``TokenBudgetStream``'s steps as a torch ``IterableDataset`` (``StreamSteps``), resumable by torchdata's
``StatefulDataLoader``."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np
import torch.utils.data

from balance_batch.collate import pack_collate
from balance_batch.corpus import Packing


class PackedDataset(torch.utils.data.Dataset):
    """A torch ``Dataset`` of a ``Packing``'s rows: item ``i`` is one packed row of ``dataset``'s samples, collated.

    Where the packing holds a piece of a sequence (``oversize="truncate"`` or ``"split"``, ``strategy="wrapped"``),
    the sample is that slice of its ``input_ids`` and ``labels``, a sequence of its own in the row. Sequences of 0
    tokens are in no row. With ``shuffle`` the rows come in a permutation seeded by ``seed`` and the epoch: call
    ``set_epoch(e)`` before each epoch's loader iterator is made, as with PyTorch's ``DistributedSampler`` (loader
    workers take the epoch when they start, so ``persistent_workers=True`` keeps their first epoch's order).
    ``DataLoader(PackedDataset(...), batch_size=None)`` yields one collated row at a time.

    Args:
        dataset: a map-style dataset; ``dataset[j]`` is a mapping with ``input_ids`` (and optional ``labels``) of
            ``packing.lengths[j]`` tokens.
        packing: what ``balance_batch.pack`` returned for the dataset's lengths.
        seed: seeds the rows' order (with ``shuffle``).
        shuffle: a new seeded order of the rows each epoch; False keeps ``pack``'s order (longest rows first).
        collate_fn: makes a row's samples into the item (default ``pack_collate``); None makes the item the list of
            samples.

    Raises:
        ValueError: ``packing`` is not a ``Packing``, it was made for another number of items than ``dataset`` has,
            or ``seed`` is not an integer; when an item is read, a sample whose ``input_ids`` are not as long as the
            packing says.
        IndexError: an item past the rows (a negative index counts from the end).

    Example:
        >>> from balance_batch import pack
        >>> from balance_batch.data import PackedDataset
        >>> corpus = [{"input_ids": [token] * n} for token, n in ((1, 6), (2, 3), (3, 4), (4, 2))]
        >>> dataset = PackedDataset(corpus, pack([6, 3, 4, 2], 8), shuffle=False)
        >>> len(dataset)
        2
        >>> dataset[0]["input_ids"], dataset[0]["position_ids"]
        (tensor([[1, 1, 1, 1, 1, 1, 4, 4]]), tensor([[0, 1, 2, 3, 4, 5, 0, 1]]))
        >>> dataset.samples(1)
        [{'input_ids': [3, 3, 3, 3]}, {'input_ids': [2, 2, 2]}]
    """

    def __init__(self, dataset: Sequence, packing: Packing, *, seed: int = 0, shuffle: bool = True,
                 collate_fn: Optional[Callable[[list], object]] = pack_collate):
        if not isinstance(packing, Packing):
            raise ValueError(f"PackedDataset: packing must be a balance_batch.Packing (what pack returns), got "
                             f"{type(packing).__name__}")
        if len(dataset) != len(packing.lengths):
            raise ValueError(f"PackedDataset: the dataset has {len(dataset)} items and the packing was made for "
                             f"{len(packing.lengths)} lengths (pack the dataset's own lengths)")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"PackedDataset: seed must be an integer, got {seed!r}")
        self.dataset, self.packing, self.seed, self.shuffle, self.collate_fn = (dataset, packing, seed, bool(shuffle),
                                                                                collate_fn)
        self.epoch = 0
        self._order: Optional[np.ndarray] = None

    def set_epoch(self, epoch: int) -> None:
        """The rows' order of ``epoch`` (with ``shuffle``)."""
        if epoch != self.epoch:
            self.epoch, self._order = int(epoch), None

    def order(self) -> np.ndarray:
        """Row of each item, this epoch."""
        if self._order is None:
            rows = self.packing.rows
            self._order = (np.random.default_rng([self.seed, self.epoch]).permutation(rows) if self.shuffle
                           else np.arange(rows))
        return self._order

    def __len__(self) -> int:
        return self.packing.rows

    def samples(self, i: int) -> list:
        """Item ``i``'s samples (whole, or sliced to the row's pieces), before the collate."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"PackedDataset: item {i} of {len(self)} rows")
        ids, starts, sizes = self.packing.pieces(int(self.order()[i]))
        out = []
        for j, start, size in zip(ids.tolist(), starts.tolist(), sizes.tolist()):
            sample = self.dataset[j]
            full = int(self.packing.lengths[j])
            if len(sample["input_ids"]) != full:
                raise ValueError(f"PackedDataset: dataset[{j}] has {len(sample['input_ids'])} input_ids and the "
                                 f"packing says {full} (pack the dataset's own lengths)")
            if size != full:
                piece = {"input_ids": sample["input_ids"][start : start + size]}
                if "labels" in sample:
                    piece["labels"] = sample["labels"][start : start + size]
                sample = piece
            out.append(sample)
        return out

    def __getitem__(self, i: int):
        """Item ``i``: ``collate_fn`` of its samples (the samples themselves where ``collate_fn`` is None)."""
        samples = self.samples(i)
        return samples if self.collate_fn is None else self.collate_fn(samples)


class StreamSteps(torch.utils.data.IterableDataset):
    """A ``TokenBudgetStream``'s steps, each step's micro-batches collated (by ``collate_fn``; None keeps the lists
    of items), with the stream's ``state_dict`` / ``load_state_dict``: what torchdata's ``StatefulDataLoader`` saves
    and restores, so a loader's state resumes the stream exactly. (A stream is itself a torch ``IterableDataset``
    once torch is imported, its steps uncollated.)

    ``DataLoader(StreamSteps(stream, pack_collate), batch_size=None)`` yields one ``Step`` at a time. The steps are
    planned with collectives over the ranks, so they are read in the main process: ``num_workers=0``.

    Raises:
        ValueError: ``stream`` is not a ``TokenBudgetStream``; iterated in a loader worker.
    """

    def __init__(self, stream, collate_fn: Optional[Callable[[list], object]] = None):
        from balance_batch.stream import TokenBudgetStream

        if not isinstance(stream, TokenBudgetStream):
            raise ValueError(f"StreamSteps: stream must be a balance_batch.stream.TokenBudgetStream, got "
                             f"{type(stream).__name__}")
        self.stream, self.collate_fn = stream, collate_fn

    def __iter__(self):
        for step in self.stream:
            if self.collate_fn is not None:
                step = dataclasses.replace(step, microbatches=[self.collate_fn(mb) for mb in step.microbatches])
            yield step

    def state_dict(self) -> dict:
        """The stream's position after the last step yielded."""
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)
