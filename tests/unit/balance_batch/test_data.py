"""From ``pack`` to training: ``balance_batch.data.PackedDataset`` in a real DataLoader gives every sequence once per
epoch in seeded rows, a split sequence's pieces reassemble to its tokens, wrapped rows hold exactly the capacity;
``pad_collate`` right-pads with the mask and labels a stock model needs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from balance_batch import pack
from balance_batch.collate import pad_collate
from balance_batch.data import PackedDataset

LENGTHS = [5, 0, 23, 9, 40, 1, 12, 0, 17, 8, 31, 3]  # capacity 16: three over it, two of 0 tokens


def corpus(lengths=LENGTHS) -> list[dict]:
    """Item j's tokens are 1000 j + 0, 1, ...: each token says where it came from."""
    return [{"input_ids": torch.arange(n) + 1000 * j, "labels": torch.arange(n) + 1000 * j + 500}
            for j, n in enumerate(lengths)]


def sequences_of(batch: dict) -> list[list[int]]:
    """A pack_collate row cut back into its sequences."""
    ids, cu = batch["input_ids"][0].tolist(), batch["cu_seq_lens_q"].tolist()
    return [ids[a:b] for a, b in zip(cu, cu[1:])]


def test_every_sequence_once_per_epoch_in_rows_shuffled_by_seed_and_epoch():
    data = corpus()
    packing = pack(LENGTHS, 16)  # oversize="alone": a row of its own each
    dataset = PackedDataset(data, packing, seed=3)
    epochs = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        rows = [sequences_of(batch) for batch in DataLoader(dataset, batch_size=None)]
        assert sorted(s[0] // 1000 for row in rows for s in row) == [j for j, n in enumerate(LENGTHS) if n]
        assert all(s == data[s[0] // 1000]["input_ids"].tolist() for row in rows for s in row)
        epochs.append(rows)
    assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch ...
    dataset.set_epoch(1)
    assert [sequences_of(dataset[i]) for i in range(len(dataset))] == epochs[1]  # ... the same one again for epoch 1
    in_order = PackedDataset(data, packing, shuffle=False, collate_fn=None)
    assert [[int(s["input_ids"][0]) // 1000 for s in in_order[r]] for r in range(len(in_order))] == [
        packing.row(r).tolist() for r in range(packing.rows)]  # pack's order: the oversize rows first


def test_a_split_sequences_pieces_reassemble_to_its_tokens_and_labels():
    data = corpus()
    dataset = PackedDataset(data, pack(LENGTHS, 16, oversize="split"), seed=0)
    tokens: dict[int, list[tuple[int, int]]] = {}  # item: (token, label) pairs as the rows hold them
    for batch in DataLoader(dataset, batch_size=None):
        assert batch["input_ids"].shape[1] <= 16
        labels = batch["labels"][0].tolist()
        for a, b, seq in zip(batch["cu_seq_lens_q"].tolist(), batch["cu_seq_lens_q"].tolist()[1:],
                             sequences_of(batch)):
            assert labels[a] == -100  # each piece starts a sequence: nothing predicted across a row's boundaries
            tokens.setdefault(seq[0] // 1000, []).extend(zip(seq[1:], labels[a + 1 : b]))
            tokens[seq[0] // 1000].append((seq[0], None))
    for j, n in enumerate(LENGTHS):
        if n:
            got = sorted(tokens[j])
            assert [t for t, _ in got] == data[j]["input_ids"].tolist()
            assert all(label is None or label == t + 500 for t, label in got)
    truncated = PackedDataset(data, pack(LENGTHS, 16, oversize="truncate"), collate_fn=None)
    kept = {int(s["input_ids"][0]) // 1000: s["input_ids"].tolist() for r in range(len(truncated))
            for s in truncated[r]}
    assert kept[4] == data[4]["input_ids"][:16].tolist() and len(kept[10]) == 16


def test_wrapped_rows_are_exactly_the_capacity_but_the_last_and_keep_the_corpus_order():
    data = corpus()
    dataset = PackedDataset(data, pack(LENGTHS, 16, strategy="wrapped"), shuffle=False)
    rows = [batch["input_ids"][0].tolist() for batch in DataLoader(dataset, batch_size=None)]
    assert [len(r) for r in rows] == [16] * (len(rows) - 1) + [sum(LENGTHS) % 16 or 16]
    assert sum(rows, []) == torch.cat([d["input_ids"] for d in data]).tolist()


def test_a_dataset_that_does_not_match_the_packing_is_refused_in_one_line():
    packing = pack(LENGTHS, 16)
    with pytest.raises(ValueError, match="PackedDataset: the dataset has 11 items and the packing was made for 12"):
        PackedDataset(corpus()[:-1], packing)
    with pytest.raises(ValueError, match=r"dataset\[2\] has 22 input_ids and the packing says 23"):
        data = corpus()
        data[2] = {"input_ids": data[2]["input_ids"][:-1]}
        [PackedDataset(data, packing, collate_fn=None)[i] for i in range(packing.rows)]
    with pytest.raises(ValueError, match="packing must be a balance_batch.Packing"):
        PackedDataset(corpus(), [[0, 1]])


def test_pad_collate_right_pads_with_the_mask_and_no_loss_on_padding():
    samples = [{"input_ids": [5, 6, 7]}, {"input_ids": torch.tensor([8, 9, 1, 2, 3])},
               {"input_ids": [4], "labels": [-100]}]
    batch = pad_collate(samples, pad_token_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2, 2], [8, 9, 1, 2, 3], [4, 2, 2, 2, 2]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100, -100], [8, 9, 1, 2, 3], [-100] * 5]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert pad_collate(samples, pad_to_multiple_of=4)["input_ids"].shape == (3, 8)
    dummy = pad_collate([], pad_token_id=3)
    assert dummy["input_ids"].tolist() == [[3]] and dummy["labels"].tolist() == [[-100]]
    assert dummy["attention_mask"].tolist() == [[1]]
    with pytest.raises(ValueError, match="pad_collate: a sample's labels have 2 tokens, its input_ids 3"):
        pad_collate([{"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive integer or None, got 0"):
        pad_collate(samples, pad_to_multiple_of=0)
