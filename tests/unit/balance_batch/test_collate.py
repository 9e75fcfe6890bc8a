"""balance_batch.collate.pack_collate: one padding-free row per micro-batch, nothing predicted across a boundary, and
the sampler's dummy as one token with no loss."""

import torch

from balance_batch.collate import pack_collate


def test_a_microbatch_is_one_row_with_restarting_positions_and_boundaries():
    samples = [{"input_ids": [5, 6, 7]}, {"input_ids": torch.tensor([8, 9])},
               {"input_ids": [1, 2, 3, 4], "labels": torch.tensor([5, 7, 3, 4])}]
    batch = pack_collate(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # each sequence's first label ignored: the shifted loss never predicts a sequence's start from the one before
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 7, 3, 4]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_k"] == 4
    assert samples[2]["labels"].tolist() == [5, 7, 3, 4]  # the caller's labels are left as they were
    assert batch["use_cache"] is False  # without it transformers builds no mask keeping the sequences apart
    assert set(pack_collate(samples, flash_attn_kwargs=False)) == {"input_ids", "labels", "position_ids", "use_cache"}


def test_the_dummy_microbatch_is_one_token_without_loss():
    batch = pack_collate([], pad_token_id=3)
    assert batch["input_ids"].tolist() == [[3]] and batch["labels"].tolist() == [[-100]]
    assert batch["cu_seq_lens_k"].tolist() == [0, 1]


def same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_a_sample_of_0_tokens_adds_nothing_to_the_row():
    empty = [{"input_ids": []}, {"input_ids": torch.tensor([], dtype=torch.long), "labels": torch.tensor([])}]
    samples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 4]}, {"input_ids": [1]}]
    without = pack_collate(samples)
    for at in range(len(samples) + 1):  # before, between and after the others
        for zero in empty:
            mixed = samples[:at] + [zero] + samples[at:]
            same(pack_collate(mixed), without)
            same(pack_collate(mixed, flash_attn_kwargs=False), pack_collate(samples, flash_attn_kwargs=False))
    assert without["cu_seq_lens_q"].tolist() == [0, 3, 5, 6]  # one boundary per sequence of at least one token
    assert without["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert (without["labels"] != -100).sum() == 3  # 2 + 1 + 0 loss tokens: the 0-token sample counts none
    same(pack_collate(empty + empty, pad_token_id=3), pack_collate([], pad_token_id=3))  # only 0 tokens: the dummy
