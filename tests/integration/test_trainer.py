"""The Trainer integration (balance_batch.integrations.transformers, balance_batch.integrations.trl) trains the
sampler's steps: all of them and no more across epochs of a token ramp, at the schedule's rates; resumes a
checkpoint in another process at the next step, whatever ``ignore_data_skip``; collates in loader workers; trains
the same weights on 2 torchrun processes as on 1; and TRL's SFTTrainer trains the plain Trainer's weights.

One uninterrupted run (tests/trainer_runs.py: a tiny Llama, 24 items, 3 epochs of a token ramp, float32) is the
baseline every other run is compared with, step by step (items, loss denominator) and weight by weight (1e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from tests.conftest import REPO
from tests.trainer_runs import EPOCHS, SAVE_STEPS, make_sampler, note_pid_collate, reference, run

TOLERANCE = 1e-5


def weight_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    return {"out": out, **run(str(out))}


@pytest.fixture(scope="module")
def expected():
    """The baseline's steps as a plain loop, at the linear schedule's rates: what the weights must be."""
    return reference(make_sampler().steps_before(EPOCHS))


def test_the_trainer_runs_every_step_of_three_ramped_epochs_at_the_schedules_rates(baseline, expected, tmp_path):
    steps = make_sampler().steps_before(EPOCHS)
    assert baseline["max_steps"] == baseline["global_step"] == baseline["scheduler_steps"] == steps
    assert [s[0] for s in baseline["steps"]] == list(range(steps))  # every step, once, in order
    assert (baseline["epoch"], baseline["num_train_epochs"], baseline["last_lr"]) == (EPOCHS, EPOCHS, 0.0)
    assert weight_gap(baseline["weights"], expected["weights"]) <= TOLERANCE

    # max_steps given: honoured, into the second epoch; save_strategy="epoch" saves at the sampler's epoch's end
    first_epoch = make_sampler().steps_before(1)
    short = run(str(tmp_path), max_steps=first_epoch + 2, save_strategy="epoch")
    assert (short["max_steps"], short["scheduler_steps"], short["last_lr"]) == (first_epoch + 2, first_epoch + 2, 0.0)
    assert short["steps"] == baseline["steps"][:first_epoch + 2]
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{first_epoch + 2}", f"checkpoint-{first_epoch}"]


def test_a_checkpoint_resumes_in_another_process_at_the_next_step_whatever_ignore_data_skip(baseline, tmp_path):
    checkpoint = baseline["out"] / f"checkpoint-{SAVE_STEPS}"
    assert (checkpoint / "sampler_state.json").is_file()
    out = tmp_path / "resumed.pt"
    proc = subprocess.run([sys.executable, "-m", "tests.trainer_runs", "resume", str(checkpoint), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ignore_data_skip, resumed in torch.load(out, weights_only=False).items():
        assert resumed["steps"] == baseline["steps"][SAVE_STEPS:], ignore_data_skip
        assert resumed["global_step"] == baseline["global_step"]
        assert weight_gap(resumed["weights"], baseline["weights"]) <= TOLERANCE, ignore_data_skip


def test_loader_workers_collate_the_same_steps(baseline, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    workers = run(str(tmp_path / "out"), dataloader_num_workers=2, save_strategy="no",
                  collate_fn=partial(note_pid_collate, str(pids)))
    collated_by = {int(p.name) for p in pids.iterdir()}
    assert len(collated_by) == 2 and os.getpid() not in collated_by  # in the two workers, not here
    assert workers["steps"] == baseline["steps"]
    assert weight_gap(workers["weights"], baseline["weights"]) <= TOLERANCE


def test_two_torchrun_processes_train_the_one_process_weights(baseline, expected, tmp_path):
    out = tmp_path / "ranks"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "tests.trainer_runs", "ranks", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]
    for i, (index, items, loss_tokens) in enumerate(baseline["steps"]):
        mine = [r["steps"][i] for r in ranks]
        assert {m[0] for m in mine} == {index} and {m[2] for m in mine} == {loss_tokens}
        assert sorted(mine[0][1] + mine[1][1]) == sorted(items)  # the step's items, split over the ranks
    assert all(len(r["steps"]) == len(baseline["steps"]) for r in ranks)
    for r in ranks:
        assert weight_gap(r["weights"], baseline["weights"]) <= TOLERANCE
        assert weight_gap(r["weights"], expected["weights"]) <= TOLERANCE


def test_trls_sft_trainer_trains_the_trainers_weights_and_refuses_a_sampler_of_another_dataset(baseline, tmp_path):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig

    from balance_batch.integrations.transformers import token_counts
    from balance_batch.integrations.trl import TokenBudgetSFTTrainer
    from tests.trainer_runs import VOCAB, items

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        unk_token="t0", pad_token="t1", eos_token="t2")

    def sft(max_length):
        class SFT(TokenBudgetSFTTrainer):  # the run's TrainingArguments as an SFTConfig, in float32
            def __init__(self, args, **kwargs):
                config = SFTConfig(**{**args.to_dict(), "bf16": False, "gradient_checkpointing": False,
                                      "max_length": max_length})
                super().__init__(args=config, processing_class=tokenizer, **kwargs)
        return SFT

    dataset = Dataset.from_list(items())  # tokenized already: SFTTrainer only adds labels
    sampler = make_sampler()
    assert token_counts(dataset) == (sampler.lengths.tolist(), sampler.loss_tokens.tolist())
    trl = run(str(tmp_path / "sft"), dataset=dataset, trainer_cls=sft(None), save_strategy="no")
    assert trl["steps"] == baseline["steps"]
    assert weight_gap(trl["weights"], baseline["weights"]) <= TOLERANCE

    longest = max(len(x["input_ids"]) for x in items())
    with pytest.raises(ValueError, match=r"item \d+ of the prepared train dataset has 10 tokens, 9 of them loss"):
        run(str(tmp_path / "short"), dataset=dataset, trainer_cls=sft(10))  # max_length truncates the longer items
    assert longest > 10


@pytest.mark.parametrize("setting, message", [
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2 would be ignored"),
    ({"per_device_train_batch_size": 4}, "per_device_train_batch_size=4 would be ignored"),
    ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length' would be ignored"),
    ({"average_tokens_across_devices": False}, "average_tokens_across_devices=False contradicts the sampler"),
    ({"sampler": make_sampler(world_size=2, rank=1)}, "the sampler plans for rank 1 of 2, this process is rank 0 of 1"),
])
def test_settings_the_sampler_would_override_are_refused_in_one_line(setting, message, tmp_path):
    with pytest.raises(ValueError, match=message) as refused:
        run(str(tmp_path), **setting)
    assert "\n" not in str(refused.value)
