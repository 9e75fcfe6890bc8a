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


# ---------------------------------------------------------------------------- what the constructor checks


def word_tokenizer():
    """A word-level tokenizer over the tiny Llama's vocabulary, built here: words "t3" to "t63" are tokens 3 to 63;
    0, 1 and 2 are "<unk>", "<pad>" and "<eos>" (special tokens split a word that contains them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.trainer_runs import VOCAB

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def build(out, *, dataset=None, sampler=None, model=None, **kwargs):
    """A TokenBudgetTrainer on the runs' items, sampler and tiny Llama (each replaceable), constructed, not trained."""
    from balance_batch.integrations.transformers import TokenBudgetTrainer
    from tests.trainer_runs import items, tiny_llama, training_args

    args = training_args(str(out), save_strategy="no")
    return TokenBudgetTrainer(model=model or tiny_llama(), args=args, sampler=sampler or make_sampler(),
                              train_dataset=items() if dataset is None else dataset, **kwargs)


def masked_items() -> list[dict]:
    """The runs' items, each with a 3-token prompt whose labels are -100."""
    from tests.trainer_runs import items

    return [{**item, "labels": [-100] * 3 + item["input_ids"][3:]} for item in items()]


def one_line(refused) -> str:
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_a_sampler_whose_tokens_or_loss_tokens_are_not_the_datasets_is_refused_in_one_line(tmp_path):
    from balance_batch import TokenBudgetSampler
    from balance_batch.collate import pack_collate, pad_collate
    from balance_batch.integrations.transformers import token_counts
    from tests.trainer_runs import LENGTHS, MTPM, RAMP

    masked = masked_items()
    lengths, loss_tokens = token_counts(masked)
    assert lengths == LENGTHS and loss_tokens == [n - 3 for n in LENGTHS]  # labels 1 and 2 are -100 too
    # built from the lengths alone (loss tokens default to length - 1): each step would be divided by too many
    for collate in (pack_collate, pad_collate, partial(pad_collate, pad_token_id=1)):
        with pytest.raises(ValueError) as refused:
            build(tmp_path, dataset=masked, collate_fn=collate)
        name = collate.func.__name__ if isinstance(collate, partial) else collate.__name__
        assert (f"TokenBudgetTrainer: item 0 of train_dataset has {LENGTHS[0]} tokens, {LENGTHS[0] - 3} of them loss "
                f"tokens as {name} lays it out; the sampler has {LENGTHS[0]} and {LENGTHS[0] - 1} (24 of 24 items "
                "differ): build the sampler from lengths, loss_tokens = token_counts(dataset)") in one_line(refused)
    # every length off by one
    longer = TokenBudgetSampler([n + 1 for n in LENGTHS], max_tokens_per_microbatch=MTPM, tokens_per_step=RAMP)
    with pytest.raises(ValueError, match=r"item 0 of train_dataset has \d+ tokens, .* \(24 of 24 items differ\)"):
        build(tmp_path, sampler=longer)
    # a collate of the caller's own: its labels are its own, so only the tokens are compared
    own = partial(note_pid_collate, str(tmp_path))
    assert build(tmp_path, dataset=masked, collate_fn=own).sampler.loss_tokens.tolist() == [n - 1 for n in LENGTHS]
    with pytest.raises(ValueError, match=r"item 0 of train_dataset has \d+ tokens \(input_ids\); the sampler has "):
        build(tmp_path, sampler=longer, collate_fn=own)
    texts = [{"text": "t3 " * n} for n in LENGTHS]  # nothing to count: the stock collates refuse, one's own is trusted
    with pytest.raises(ValueError, match="train_dataset: item 0 has no input_ids, which pack_collate lays out"):
        build(tmp_path, dataset=texts)
    assert build(tmp_path, dataset=texts, collate_fn=own).train_dataset is texts

    # built from token_counts, given or as a function of the dataset: accepted, and each step is divided by its own
    # loss tokens
    def from_counts(dataset):
        lengths, loss_tokens = token_counts(dataset)
        return TokenBudgetSampler(lengths, loss_tokens_per_sequence=loss_tokens, max_tokens_per_microbatch=MTPM,
                                  tokens_per_step=RAMP, seed=0)

    trained = run(str(tmp_path / "masked"), dataset=masked, sampler=from_counts, max_steps=2, save_strategy="no")
    assert [s[0] for s in trained["steps"]] == [0, 1]
    assert all(denominator == sum(loss_tokens[i] for i in ids) for _, ids, denominator in trained["steps"])
    with pytest.raises(ValueError, match=r"sampler\(train_dataset\) returned list; it must return a balance_batch"):
        build(tmp_path, sampler=lambda dataset: lengths)


def test_token_counts_reads_a_datasets_columns_in_its_order_as_its_items_read():
    from datasets import Dataset

    from balance_batch.integrations.transformers import token_counts

    masked = masked_items()
    as_items = token_counts(masked)
    dataset = Dataset.from_list(masked)
    assert token_counts(dataset) == as_items
    shuffled = dataset.shuffle(seed=1).select(range(5, 20))  # an indices mapping over the Arrow table
    assert token_counts(shuffled) == token_counts([shuffled[i] for i in range(len(shuffled))])
    # labels not among the columns the items show: the collate takes input_ids as labels
    hidden = dataset.with_format("torch", columns=["input_ids"])
    assert token_counts(hidden) == (as_items[0], [n - 1 for n in as_items[0]])
    unmasked = dataset.with_transform(lambda batch: {"input_ids": batch["input_ids"]})  # read item by item
    assert token_counts(unmasked) == (as_items[0], [n - 1 for n in as_items[0]])


def test_a_model_that_packed_rows_would_run_across_is_refused_with_check_packables_line(tmp_path):
    import transformers as tf

    from balance_batch.collate import pad_collate
    from balance_batch.integrations.transformers import check_packable
    from tests.trainer_runs import VOCAB, tiny_llama

    lfm2 = tf.Lfm2ForCausalLM(tf.Lfm2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             layer_types=["conv", "full_attention"]))
    with pytest.raises(ValueError) as own:
        check_packable(lfm2)
    with pytest.raises(ValueError) as refused:
        build(tmp_path, model=lfm2)
    assert one_line(refused) == f"TokenBudgetTrainer: {own.value}"
    assert build(tmp_path, model=lfm2, collate_fn=pad_collate).model is lfm2  # padded rows: nothing runs across
    llama = tiny_llama()
    assert build(tmp_path, model=llama).model is llama


def test_a_streamed_dataset_is_refused_in_one_line_naming_a_map_style_one(tmp_path):
    from datasets import Dataset

    from tests.trainer_runs import items

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(items())

    for stream in (Stream(), Dataset.from_list(items()).to_iterable_dataset()):
        with pytest.raises(ValueError) as refused:
            build(tmp_path, dataset=stream)
        assert (f"TokenBudgetTrainer: train_dataset is a stream ({type(stream).__name__}), but the sampler plans "
                "each step from every item's length, known up front: give a map-style dataset (datasets.Dataset"
                ) in one_line(refused)


def test_trl_builds_the_sampler_from_the_dataset_it_prepared_from_text_or_prompt_and_completion(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    from balance_batch import TokenBudgetSampler
    from balance_batch.integrations.transformers import token_counts
    from balance_batch.integrations.trl import TokenBudgetSFTTrainer
    from tests.trainer_runs import Recorder, tiny_llama

    def from_counts(dataset):
        lengths, loss_tokens = token_counts(dataset)
        return TokenBudgetSampler(lengths, loss_tokens_per_sequence=loss_tokens, max_tokens_per_microbatch=16,
                                  tokens_per_step=24, seed=0)

    def train(dataset, sampler):
        args = SFTConfig(output_dir=str(tmp_path), max_steps=1, use_cpu=True, bf16=False, report_to="none",
                         gradient_checkpointing=False, save_strategy="no", disable_tqdm=True, max_length=None)
        trainer = TokenBudgetSFTTrainer(model=tiny_llama(), args=args, train_dataset=dataset, sampler=sampler,
                                        processing_class=word_tokenizer())
        recorder = Recorder(trainer)
        trainer.add_callback(recorder)
        trainer.train()
        assert trainer.state.global_step == 1 and len(recorder.steps) == 1
        (_, step_items, denominator), = recorder.steps
        assert denominator == sum(int(trainer.sampler.loss_tokens[i]) for i in step_items) > 0
        return trainer.sampler

    texts = ["t5 t9 t12 t3 t7", "t4 t4", "t8 t30 t11 t17 t60 t33 t21", "t6 t9 t10"]
    sampler = train(Dataset.from_dict({"text": texts}), from_counts)
    words = [len(t.split()) + 1 for t in texts]  # and the EOS SFTTrainer adds
    assert sampler.lengths.tolist() == words and sampler.loss_tokens.tolist() == [n - 1 for n in words]

    prompts, completions = ["t5 t9", "t4", "t8 t30 t11"], [" t3 t7 t12", " t4", " t17"]
    pairs = Dataset.from_dict({"prompt": prompts, "completion": completions})
    sampler = train(pairs, from_counts)
    assert sampler.lengths.tolist() == [len((p + c).split()) + 1 for p, c in zip(prompts, completions)]
    assert sampler.loss_tokens.tolist() == [len(c.split()) + 1 for c in completions]  # completion_only_loss

    # a sampler of the text's own tokens (no EOS, every token a loss token): refused, pointing at the function form
    unprepared = TokenBudgetSampler([len((p + c).split()) for p, c in zip(prompts, completions)],
                                    max_tokens_per_microbatch=16, tokens_per_step=24)
    with pytest.raises(ValueError) as refused:
        train(pairs, unprepared)
    assert ("TokenBudgetSFTTrainer: item 0 of the prepared train dataset has 6 tokens, 4 of them loss tokens as "
            "pack_collate lays it out; the sampler has 5 and 4 (3 of 3 items differ): pass sampler=lambda dataset: "
            "TokenBudgetSampler(") in one_line(refused)
