"""Trainer runs that tests/integration/balance_batch/test_trainer.py compares: a tiny stock Llama trained by
``TokenBudgetTrainer`` (or TRL's SFTTrainer through ``TokenBudgetSFTTrainer``) with SGD and a linear learning-rate
schedule, on 24 short items over 3 epochs of a token ramp, recording each trained step (its index, this rank's
items, its loss denominator) and the final weights.

Run as a module it is the test's second process:
    python -m tests.trainer_runs resume CHECKPOINT OUT       both resumes from CHECKPOINT (ignore_data_skip False, True)
    python -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.trainer_runs ranks OUT
each writing torch.save'd results to OUT (per rank: OUT.rank<r>).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from balance_batch import TokenBudgetSampler

LENGTHS = [int(n) for n in np.random.RandomState(0).randint(3, 21, 24)]
RAMP = [(0, 40), (300, 80)]  # tokens per step: 40 until 300 tokens are consumed (in epoch 1), then 80
MTPM = 24
EPOCHS = 3
SAVE_STEPS = 10  # mid-epoch 1: the resumed run starts inside an epoch, before the ramp's threshold's step
LR = 0.5
VOCAB = 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(config).float().train()


def items() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in LENGTHS]


def make_sampler(world_size: int | None = None, rank: int | None = None) -> TokenBudgetSampler:
    """The ranks by default from the process group (torchrun's), as a user's sampler takes them."""
    return TokenBudgetSampler(LENGTHS, max_tokens_per_microbatch=MTPM, tokens_per_step=RAMP, world_size=world_size,
                              rank=rank, seed=0)


def training_args(out: str, **overrides) -> TrainingArguments:
    settings = dict(output_dir=out, num_train_epochs=EPOCHS, optim="sgd", learning_rate=LR, lr_scheduler_type="linear",
                    max_grad_norm=0.0, use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=1,
                    save_strategy="steps", save_steps=SAVE_STEPS, dataloader_num_workers=0, seed=0)
    settings.update(overrides)
    return TrainingArguments(**settings)


class Recorder(TrainerCallback):
    """Each trained step: (global index, this rank's items in order, global_loss_tokens)."""

    def __init__(self, trainer):
        self.trainer, self.steps = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        step = self.trainer.trained_step
        self.steps.append((step.step, [i for mb in step.microbatches for i in mb], step.global_loss_tokens))


def note_pid_collate(folder: str, samples):
    """``pack_collate``, leaving a file named after the process that collated."""
    from balance_batch.collate import pack_collate

    open(os.path.join(folder, str(os.getpid())), "a").close()
    return pack_collate(samples)


def reference(max_steps: int) -> dict:
    """The baseline's steps written as a plain loop: each micro-batch's summed loss over the step's loss tokens,
    SGD at the linear schedule's rate (LR, falling to 0 at ``max_steps``)."""
    from balance_batch.collate import pack_collate

    model, dataset, sampler = tiny_llama(), items(), make_sampler()
    steps, epoch = [], 0
    while len(steps) < max_steps:
        sampler.set_epoch(epoch)  # a no-op where the sampler has moved on to it by itself
        for step in sampler.steps():
            if len(steps) == max_steps:
                break
            for mb in step.microbatches:
                batch = pack_collate([dataset[i] for i in mb])
                model(**batch, num_items_in_batch=step.global_loss_tokens).loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * (1 - len(steps) / max_steps) * p.grad
                    p.grad = None
            steps.append(step.step)
        epoch += 1
    return {"steps": steps, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def run(out: str, *, dataset=None, sampler=None, resume=None, trainer_cls=None, collate_fn=None, **overrides) -> dict:
    """One training run; its steps, final weights (float32), learning rates and Trainer state."""
    from balance_batch.integrations.transformers import TokenBudgetTrainer

    trainer_cls = trainer_cls or TokenBudgetTrainer
    args = training_args(out, **overrides)
    model = tiny_llama()
    extra = {} if collate_fn is None else {"collate_fn": collate_fn}
    sampler = make_sampler() if sampler is None else sampler  # after the args: they start the process group
    trainer = trainer_cls(model=model, args=args, train_dataset=items() if dataset is None else dataset,
                          sampler=sampler, **extra)
    recorder = Recorder(trainer)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    return {"steps": recorder.steps,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
            "max_steps": trainer.state.max_steps, "global_step": trainer.state.global_step,
            "epoch": trainer.state.epoch, "num_train_epochs": trainer.state.num_train_epochs,
            "scheduler_steps": trainer.lr_scheduler.last_epoch, "last_lr": trainer.lr_scheduler.get_last_lr()[0]}


def main(argv: list[str]) -> None:
    if argv[0] == "resume":  # the uninterrupted run's checkpoint, resumed in this second process, each way
        checkpoint, out = argv[1], argv[2]
        results = {skip: run(f"{out}.dir{skip}", resume=checkpoint, ignore_data_skip=skip) for skip in (False, True)}
        torch.save(results, out)
    elif argv[0] == "ranks":  # one rank of a torchrun
        result = run(f"{argv[1]}.dir", save_strategy="no")
        torch.save(result, f"{argv[1]}.rank{os.environ['RANK']}")
    else:
        raise SystemExit(f"tests.trainer_runs: unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
