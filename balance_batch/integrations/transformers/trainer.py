"""The Hugging Face Trainer on a ``TokenBudgetSampler``'s optimizer steps: one Trainer batch is one whole step, its
micro-batches run forward and backward one at a time over the step's ``global_loss_tokens``, and the sampler's
position is saved in every checkpoint, so ``train(resume_from_checkpoint=...)`` resumes at the next step.

The Trainer counts a fixed number of batches per epoch and per optimizer step; the sampler's steps hold as many
micro-batches as their tokens need, and with a token ramp each epoch has its own number of steps. So the Trainer's
loop runs one "epoch" that spans the whole run (``max_steps`` of the sampler's steps, across its epochs), and a
callback keeps ``state.epoch`` and the epoch-based save/eval/log strategies on the sampler's epochs.

A ``TokenBudgetStream`` given as the train dataset (and no sampler) is trained the same way, ``max_steps`` of its
steps, as the Trainer asks of any iterable dataset; each rank saves its own stream state in every checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from functools import partial
from typing import Callable, Mapping, Optional, Union

import numpy as np
import torch
from transformers import DefaultFlowCallback, Trainer, TrainerCallback
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    IntervalStrategy,
    SaveStrategy,
    get_last_checkpoint,
    seed_worker,
)

from balance_batch.collate import pack_collate, pad_collate
from balance_batch.integrations.transformers.packing import check_packable
from balance_batch.sampler import Step, TokenBudgetSampler
from balance_batch.stream import TokenBudgetStream
from balance_batch.tokens import IGNORE_INDEX, flat, loss_tokens

STATE_FILE = "sampler_state.json"  # in each checkpoint folder: the sampler's position after the checkpoint's step
STREAM_STATE_FILE = "stream_state_{rank}.pt"  # with a stream: each rank's position (torch.save: it holds items)


class _NoInputIds(ValueError):
    """An item without ``input_ids``: nothing to count its tokens from."""


def _item_counts(item, index: int) -> tuple[int, int]:
    """An item's tokens and loss tokens (its labels after the first that are not -100)."""
    if not isinstance(item, Mapping) or "input_ids" not in item:
        raise _NoInputIds(f"item {index} has no input_ids")
    seq = flat(item["input_ids"])
    return len(seq), loss_tokens(item["labels"] if "labels" in item else seq)


def _arrow_column_counts(column) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Per row of an Arrow column of flat integer lists: its length, and its values after the first that are not
    -100; None for any other column type."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)):
        return None
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if column.null_count:
        return None
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    kept = np.concatenate([[0], np.cumsum(column.flatten().to_numpy(zero_copy_only=False) != IGNORE_INDEX)])
    ends = np.cumsum(lengths)
    return lengths, kept[ends] - kept[np.minimum(ends - lengths + 1, ends)]


def _dataset_counts(dataset) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """``token_counts`` of a ``datasets.Dataset`` from its Arrow columns, in the dataset's order; None where its items
    are not its columns as stored (a custom transform) or the columns are not flat integer lists."""
    fmt = getattr(dataset, "format", None)
    if not isinstance(fmt, dict) or fmt.get("type") == "custom" or not hasattr(dataset, "with_format"):
        return None
    visible = dataset.column_names if fmt.get("columns") is None or fmt.get("output_all_columns") else fmt["columns"]
    if "input_ids" not in visible:
        raise _NoInputIds("the dataset has no input_ids column")
    columns = ["input_ids"] + (["labels"] if "labels" in visible else [])
    table = dataset.select_columns(columns).with_format("arrow")[:]
    ids = _arrow_column_counts(table.column("input_ids"))
    labels = ids if len(columns) == 1 else _arrow_column_counts(table.column("labels"))
    if ids is None or labels is None:
        return None
    return ids[0], labels[1]


def _token_arrays(dataset) -> tuple[np.ndarray, np.ndarray]:
    """``token_counts`` as int64 arrays."""
    counted = _dataset_counts(dataset) if hasattr(dataset, "column_names") else None
    if counted is None:
        pairs = [_item_counts(dataset[i], i) for i in range(len(dataset))]
        counted = tuple(np.array([p[k] for p in pairs], dtype=np.int64).reshape(-1) for k in (0, 1))
    return counted


def token_counts(dataset) -> tuple[list[int], list[int]]:
    """Per item of a tokenized dataset (``input_ids``, optional ``labels``): its tokens, and the tokens its loss
    counts as ``pack_collate`` and ``pad_collate`` lay it out (labels after the first that are not -100): a sampler's
    ``lengths`` and ``loss_tokens_per_sequence``. A ``datasets.Dataset`` is read from its Arrow columns; any other
    map-style dataset item by item (``dataset[i]``)."""
    try:
        lengths, loss_tokens = _token_arrays(dataset)
    except _NoInputIds as missing:
        raise ValueError(f"token_counts: {missing}; valid: items with input_ids and optional labels") from None
    return lengths.tolist(), loss_tokens.tolist()


class _StepItems(torch.utils.data.Dataset):
    """A map-style dataset keyed by a whole ``Step``: its micro-batches, collated (in a loader worker, when there are
    workers), and the step itself, so the training loop knows which step it trains."""

    def __init__(self, dataset, collate_fn: Callable):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __getitem__(self, step: Step) -> dict:
        return {"microbatches": [self.collate_fn([self.dataset[i] for i in mb]) for mb in step.microbatches],
                "step": step}


def _as_is(batch):
    return batch  # a step is a batch already (batch_size=None); torch's default_convert would rebuild the Step


class _StepKeys(torch.utils.data.Sampler):
    """The sampler's steps in the main process, across its epochs, up to the Trainer's ``max_steps`` (a global step
    index): the keys the loader's workers collate."""

    def __init__(self, trainer: "TokenBudgetMixin"):
        self.trainer = trainer

    def __iter__(self):
        sampler, state = self.trainer.sampler, self.trainer.state  # read now: the Trainer replaces its state in train()
        expected, last_epoch, empty_rounds = state.global_step, sampler.epoch, 0
        while empty_rounds < 2:  # an epoch with no steps left twice in a row: the sampler has none
            empty_rounds += 1
            for step in sampler.steps():
                if step.step != expected:
                    raise ValueError(
                        f"{type(self.trainer).__name__}: the sampler's next step is {step.step} but the Trainer is at "
                        f"step {expected}; resume with train(resume_from_checkpoint=...), which loads the checkpoint's "
                        f"{STATE_FILE}")
                if step.step >= state.max_steps:
                    return
                yield step
                expected, last_epoch, empty_rounds = expected + 1, step.epoch, 0
            # the epoch is consumed: the next one (a no-op where the sampler has moved on by itself)
            sampler.set_epoch(last_epoch + 1)
            last_epoch = sampler.epoch


class _StreamSteps(torch.utils.data.IterableDataset):
    """A stream's steps in the main process (their planning takes collectives), collated, up to ``max_steps``."""

    def __init__(self, trainer: "TokenBudgetMixin"):
        self.trainer = trainer

    def __iter__(self):
        trainer = self.trainer
        stream, state = trainer.stream, trainer.state
        if stream.step != state.global_step:
            raise ValueError(f"{type(trainer).__name__}: the stream's next step is {stream.step} but the Trainer is "
                             f"at step {state.global_step}; resume with train(resume_from_checkpoint=...), which "
                             "loads the checkpoint's stream state")
        for step in stream:
            yield {"microbatches": [trainer.collate_fn(mb) for mb in step.microbatches], "step": step}
            if step.step + 1 >= state.max_steps:
                return


class _SamplerEpochs(TrainerCallback):
    """Keeps ``state.epoch``, ``state.num_train_epochs`` and the epoch strategies on the sampler's epochs, which the
    Trainer's one loop epoch spans."""

    def __init__(self, trainer: "TokenBudgetMixin"):
        self.trainer = trainer
        self.epoch_end_at: Optional[int] = None  # the global step at which a sampler epoch last ended

    def on_train_begin(self, args, state, control, **kwargs):
        state.num_train_epochs = self.trainer.epochs_spanned(state.max_steps)

    def on_step_end(self, args, state, control, **kwargs):
        step, sampler = self.trainer.trained_step, self.trainer.sampler
        if step is None:
            return
        start, end = sampler.steps_before(step.epoch), sampler.steps_before(step.epoch + 1)
        state.epoch = step.epoch + (step.step + 1 - start) / (end - start)
        if step.step + 1 == end:
            self.epoch_end_at = state.global_step
            DefaultFlowCallback().on_epoch_end(args, state, control)  # what the Trainer does at its own epochs' ends

    def on_epoch_end(self, args, state, control, **kwargs):
        # the Trainer's loop epoch ends with the run; where a sampler epoch ended at the same step, its save, eval and
        # log were done already
        if self.epoch_end_at == state.global_step:
            control.should_log &= args.logging_strategy != IntervalStrategy.EPOCH
            control.should_evaluate &= args.eval_strategy != IntervalStrategy.EPOCH
            control.should_save &= args.save_strategy != SaveStrategy.EPOCH


_SamplerOrFunction = Union[TokenBudgetSampler, Callable[..., TokenBudgetSampler]]


def _stock_collate(collate_fn: Callable) -> Optional[Callable]:
    """``pack_collate`` or ``pad_collate`` where ``collate_fn`` is one of them (or a ``functools.partial`` of one:
    their options change no label), else None: a collate of the caller's own."""
    while isinstance(collate_fn, partial):
        collate_fn = collate_fn.func
    return collate_fn if collate_fn in (pack_collate, pad_collate) else None


def _is_stream(dataset) -> bool:
    """Whether ``dataset`` cannot be indexed or measured up front: a torch or ``datasets`` ``IterableDataset``, or
    anything without ``__len__`` and ``__getitem__``."""
    datasets = sys.modules.get("datasets")  # imported already wherever a datasets.IterableDataset exists
    if isinstance(dataset, torch.utils.data.IterableDataset) or (
            datasets is not None and isinstance(dataset, getattr(datasets, "IterableDataset", ()))):
        return True
    return not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


def _refuse_stream(dataset, who: str) -> None:
    """Refuse, in one line, a train dataset the sampler cannot plan: a stream (``_is_stream``) not wrapped in a
    ``TokenBudgetStream``."""
    if dataset is not None and not isinstance(dataset, TokenBudgetStream) and _is_stream(dataset):
        raise ValueError(
            f"{who}: train_dataset is a stream ({type(dataset).__name__}), but the sampler plans "
            "each step from every item's length, known up front: give a map-style dataset (datasets.Dataset, a "
            "list, a torch Dataset with __len__ and __getitem__), e.g. the stream materialized with "
            "datasets.Dataset.from_generator or list(); or give train_dataset=TokenBudgetStream(stream, ...) "
            "(balance_batch.stream) and no sampler")


def _check_stream_arguments(dataset, sampler, args, who: str) -> None:
    """Refuse, in one line, a stream with a sampler or without ``max_steps``, and a sampler missing without one."""
    if not isinstance(dataset, TokenBudgetStream):
        if sampler is None:
            raise ValueError(f"{who}: give sampler= (a TokenBudgetSampler, or a function of the train dataset that "
                             "returns one), or train_dataset=TokenBudgetStream(...) for a stream")
        return
    if sampler is not None:
        raise ValueError(f"{who}: train_dataset is a TokenBudgetStream, which plans its own steps: leave sampler out")
    if args is not None and args.max_steps <= 0:
        raise ValueError(f"{who}: train_dataset is a TokenBudgetStream, whose length is not known up front: give "
                         f"max_steps (its steps to train), as the Trainer asks of any iterable dataset; got "
                         f"max_steps={args.max_steps}")


# TrainingArguments the sampler decides instead, each refused unless left at its default ("not asked for"), and why
_SAMPLER_DECIDES = {
    "gradient_accumulation_steps": "one Trainer batch is one whole sampler step, its micro-batches "
                                   "accumulated inside it: set it to 1",
    "per_device_train_batch_size": "the sampler sizes the steps (sequences_per_step or tokens_per_step)",
    "train_sampling_strategy": "the sampler orders the items",
    "dataloader_drop_last": "the sampler's drop_last decides",
    "auto_find_batch_size": "the sampler's max_tokens_per_microbatch sizes the micro-batches",
}


def _check_training_args(args, who: str) -> None:
    """Refuse, in one line, Trainer arguments this integration would otherwise ignore or contradict."""
    fields = {f.name: f.default for f in dataclasses.fields(args)}
    for key, why in _SAMPLER_DECIDES.items():
        if getattr(args, key) != fields[key]:
            raise ValueError(f"{who}: {key}={getattr(args, key)!r} would be ignored ({why})")
    if not args.average_tokens_across_devices:
        raise ValueError(f"{who}: average_tokens_across_devices=False contradicts the sampler, whose loss "
                         "denominator (global_loss_tokens) counts every rank's tokens: leave it True")
    if args.n_gpu > 1:
        raise ValueError(f"{who}: {args.n_gpu} GPUs in one process (nn.DataParallel) would split a packed row; run "
                         "one process per GPU (torchrun)")


def _check_sampler_argument(sampler, who: str) -> None:
    """Refuse a ``sampler=`` that is neither a sampler nor a function (of the train dataset, returning one)."""
    if not (isinstance(sampler, TokenBudgetSampler) or callable(sampler)):
        raise ValueError(f"{who}: sampler must be a balance_batch.TokenBudgetSampler, or a function that takes "
                         f"the train dataset and returns one; got {type(sampler).__name__}")


def _built_sampler(sampler: _SamplerOrFunction, dataset, who: str) -> TokenBudgetSampler:
    """``sampler`` itself, or what the function ``sampler`` returns for the train dataset (refused unless a sampler)."""
    if isinstance(sampler, TokenBudgetSampler):
        return sampler
    built = sampler(dataset)
    if not isinstance(built, TokenBudgetSampler):
        raise ValueError(f"{who}: sampler(train_dataset) returned {type(built).__name__}; it must return a "
                         "balance_batch.TokenBudgetSampler")
    return built


def _check_sampler_rank(sampler, args, who: str) -> None:
    """Refuse a sampler (or stream) planned for another rank or world size than this process's."""
    if (sampler.world_size, sampler.rank) != (args.world_size, args.process_index):
        name = "stream" if isinstance(sampler, TokenBudgetStream) else "sampler"
        raise ValueError(f"{who}: the {name} plans for rank {sampler.rank} of {sampler.world_size}, "
                         f"this process is rank {args.process_index} of {args.world_size}")


def _check_sampler_counts(sampler: TokenBudgetSampler, dataset, collate_fn: Callable, who: str, dataset_name: str,
                          advice: str) -> None:
    """Refuse, in one line naming the first item that differs, a sampler whose items' count, tokens or (with
    ``pack_collate`` or ``pad_collate``) loss tokens are not the dataset's as the collate lays it out. With a collate
    of the caller's own, whose labels only it knows, only the tokens are compared, where the items have
    ``input_ids``. ``dataset_name`` names the dataset in the message; ``advice`` says how to build a sampler that
    fits."""
    if len(dataset) != len(sampler.lengths):
        raise ValueError(f"{who}: the sampler has {len(sampler.lengths)} items' lengths, {dataset_name} "
                         f"{len(dataset)} items: {advice}")
    stock = _stock_collate(collate_fn)
    try:
        lengths, loss_tokens = _token_arrays(dataset)
    except _NoInputIds as missing:
        if stock is None:
            return  # the caller's collate makes the tokens: nothing here to count them from
        raise ValueError(f"{who}: {dataset_name}: {missing}, which {stock.__name__} lays out; valid: "
                         "items with input_ids and optional labels (-100 where a token has no loss)") from None
    differs = lengths != sampler.lengths
    if stock is not None:
        differs |= loss_tokens != sampler.loss_tokens
    if not differs.any():
        return
    i = int(np.argmax(differs))
    count = f"{int(differs.sum())} of {len(differs)} items differ"
    if stock is None:
        raise ValueError(f"{who}: item {i} of {dataset_name} has {lengths[i]} tokens (input_ids); the "
                         f"sampler has {sampler.lengths[i]} ({count}): build the sampler's lengths from the "
                         "items' input_ids, token_counts(dataset)")
    raise ValueError(f"{who}: item {i} of {dataset_name} has {lengths[i]} tokens, {loss_tokens[i]} of them "
                     f"loss tokens as {stock.__name__} lays it out; the sampler has {sampler.lengths[i]} and "
                     f"{sampler.loss_tokens[i]} ({count}): {advice}")


class TokenBudgetMixin:
    """What makes a Trainer (or a Trainer subclass, such as TRL's ``SFTTrainer``) train on a sampler's steps; see
    ``TokenBudgetTrainer``."""

    def __init__(self, *args, sampler: Optional[_SamplerOrFunction] = None, collate_fn: Callable = pack_collate,
                 **kwargs):
        who = type(self).__name__
        if sampler is not None:
            _check_sampler_argument(sampler, who)
        # before the Trainer's own refusal of a dataset without __len__ (which asks for max_steps)
        _refuse_stream(kwargs.get("train_dataset"), who)
        if "train_dataset" in kwargs:
            _check_stream_arguments(kwargs["train_dataset"], sampler, kwargs.get("args"), who)
        super().__init__(*args, **kwargs)
        self.collate_fn = collate_fn
        self.trained_step: Optional[Step] = None  # the last step trained: what a checkpoint saves the position after
        self.loss_is_scaled_for_ga = True  # the loss is over the whole step already: the Trainer must not divide it
        self._check_settings()
        _refuse_stream(self.train_dataset, who)  # a subclass may have prepared the dataset into a stream
        if self.train_dataset is None:
            raise ValueError(f"{who}: no train_dataset; give the dataset whose items the sampler's lengths describe")
        _check_stream_arguments(self.train_dataset, sampler, self.args, who)
        self.stream: Optional[TokenBudgetStream] = None
        if isinstance(self.train_dataset, TokenBudgetStream):
            self.stream, self.sampler = self.train_dataset, None
            self._start_state = self.stream.state_dict()
            _check_sampler_rank(self.stream, self.args, who)
        else:
            self.sampler = _built_sampler(sampler, self.train_dataset, who)
            self._start_state = self.sampler.state_dict()  # where a fresh train() starts, however often it is called
            self._check_sampler()
            self.add_callback(_SamplerEpochs(self))
        self._check_model()

    # ------------------------------------------------------------------ settings

    def _check_settings(self) -> None:
        """Refuse, in one line, Trainer settings this integration would otherwise ignore or contradict (a subclass
        adds its own)."""
        _check_training_args(self.args, type(self).__name__)

    # what the refusal of a sampler that does not describe the dataset calls the dataset, and how to build one that does
    _dataset_name = "train_dataset"
    _sampler_advice = ("build the sampler from lengths, loss_tokens = token_counts(dataset): "
                      "TokenBudgetSampler(lengths, loss_tokens_per_sequence=loss_tokens, ...), or pass "
                      "sampler=lambda dataset: TokenBudgetSampler(...) built so")

    def _check_sampler(self) -> None:
        """Refuse, in one line, a sampler planned for another rank or another dataset (``_check_sampler_rank``,
        ``_check_sampler_counts``)."""
        who = type(self).__name__
        _check_sampler_rank(self.sampler, self.args, who)
        _check_sampler_counts(self.sampler, self.train_dataset, self.collate_fn, who, self._dataset_name,
                              self._sampler_advice)

    def _check_model(self) -> None:
        """With ``pack_collate``, refuse a model whose layers would run across a packed row's sequences
        (``check_packable``'s one line)."""
        if _stock_collate(self.collate_fn) is not pack_collate:
            return
        try:
            check_packable(self.model)
        except ValueError as refused:
            raise ValueError(f"{type(self).__name__}: {refused}") from refused

    # ------------------------------------------------------------------ the steps

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """A loader of whole steps: the keys come from ``sampler.steps()`` here, the collation runs in the workers.
        Not passed through ``accelerator.prepare``: the sampler plans each rank's share already, and accelerate would
        shard it again."""
        args = self.args
        if self.stream is not None:  # read and collated here: the stream's steps are planned with collectives
            return torch.utils.data.DataLoader(_StreamSteps(self), batch_size=None, collate_fn=_as_is, num_workers=0,
                                               pin_memory=args.dataloader_pin_memory)
        extra = {}
        if args.dataloader_num_workers > 0:
            extra = {"prefetch_factor": args.dataloader_prefetch_factor,
                     "persistent_workers": args.dataloader_persistent_workers,
                     "multiprocessing_context": args.dataloader_multiprocessing_context,
                     "in_order": args.dataloader_in_order}
        return torch.utils.data.DataLoader(
            _StepItems(self.train_dataset, self.collate_fn), batch_size=None, sampler=_StepKeys(self),
            collate_fn=_as_is, num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
            **extra)

    def steps_for_epochs(self, epochs: float) -> int:
        """The sampler's steps in ``epochs`` epochs from the start (a fraction of the last rounded up, as the Trainer
        does)."""
        whole = int(epochs)
        steps = self.sampler.steps_before(whole)
        if epochs > whole:
            steps += math.ceil((epochs - whole) * (self.sampler.steps_before(whole + 1) - steps))
        return steps

    def epochs_spanned(self, max_steps: int) -> int:
        """The sampler epochs ``max_steps`` steps reach into."""
        epoch = 0
        while self.sampler.steps_before(epoch) < max_steps:
            if self.sampler.steps_before(epoch + 1) == self.sampler.steps_before(epoch):
                raise ValueError(f"{type(self).__name__}: the sampler's epoch {epoch} has no step (drop_last, with "
                                 f"steps larger than the dataset), so max_steps={max_steps} is never reached")
            epoch += 1
        return epoch

    def set_initial_training_values(self, args, dataloader):
        """The Trainer's step counts from the sampler: ``max_steps`` (given, or the steps of ``num_train_epochs``
        epochs, each with its own count under a ramp), all in one loop epoch; with a stream, ``max_steps``."""
        if self.stream is not None:
            steps = args.max_steps
            return 1, steps, steps, steps, 1, steps, steps
        max_steps = args.max_steps if args.max_steps > 0 else self.steps_for_epochs(args.num_train_epochs)
        if max_steps < 1:
            raise ValueError(f"{type(self).__name__}: num_train_epochs={args.num_train_epochs} of the sampler is no "
                             "step; give more epochs or max_steps")
        self.epochs_spanned(max_steps)  # refuses a max_steps the sampler's epochs never reach
        items, per_epoch = len(self.train_dataset), max(self.sampler.steps_before(1), 1)
        # (loop epochs, updates per loop epoch, examples, samples trained, batch size, batches per loop epoch, steps)
        return 1, max_steps, items, round(items * max_steps / per_epoch), round(items / per_epoch), max_steps, max_steps

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """``Trainer.train``, the sampler placed first: at its start, or after the checkpoint's step."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if self.stream is not None:
            self._load_stream_state(resume_from_checkpoint)
        elif resume_from_checkpoint in (None, False):
            self.sampler.load_state_dict(self._start_state)
        else:
            path = os.path.join(resume_from_checkpoint, STATE_FILE)
            if not os.path.isfile(path):
                raise ValueError(f"{type(self).__name__}: {path} is missing; the checkpoint was not saved by a "
                                 "token-budget trainer, and resuming without it would retrain or skip steps")
            with open(path, encoding="utf-8") as f:
                self.sampler.load_state_dict(json.load(f))
        self.trained_step = None
        # The sampler now starts after the trained steps; the Trainer's own skip (skip_first_batches) would skip as many
        # again, and cannot rebuild this loader anyway
        ignore_data_skip, self.args.ignore_data_skip = self.args.ignore_data_skip, True
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            self.args.ignore_data_skip = ignore_data_skip

    def _load_stream_state(self, checkpoint) -> None:
        """The stream placed after the checkpoint's step (this rank's state), or at its start."""
        if checkpoint in (None, False):
            if self.stream.step != 0:  # a second train(): from the start again (the source read anew)
                self.stream.load_state_dict(self._start_state)
            return
        path = os.path.join(checkpoint, STREAM_STATE_FILE.format(rank=self.args.process_index))
        if not os.path.isfile(path):
            raise ValueError(f"{type(self).__name__}: {path} is missing; the checkpoint was not saved by a "
                             "token-budget trainer on this stream, and resuming without it would retrain or skip "
                             "items")
        self.stream.load_state_dict(torch.load(path, weights_only=False))

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The step's micro-batches forward and backward one at a time, each loss summed over its tokens and divided
        by the step's ``global_loss_tokens`` (so the step's gradient is the mean over all its loss tokens on all
        ranks, whatever the micro-batches); gradients are synchronised once, after the last."""
        if "microbatches" not in inputs:  # not a step of ours (a subclass's own call)
            return super().training_step(model, inputs, num_items_in_batch)
        step, microbatches = inputs["step"], inputs["microbatches"]
        denominator = max(step.global_loss_tokens, 1)  # a step without loss tokens: a zero loss, not 0 / 0
        # what the Trainer and TRL divide a per-micro-batch mean (an MoE aux loss) by
        self.current_gradient_accumulation_steps = len(microbatches)
        losses = []
        for i, mb in enumerate(microbatches):
            # every rank runs the same number of micro-batches, so the ranks all-reduce in lock-step on the last
            last = i == len(microbatches) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                losses.append(super().training_step(model, mb, num_items_in_batch=denominator))
        self.trained_step = step
        return torch.stack(losses).sum()

    def floating_point_ops(self, inputs) -> int:
        if "microbatches" not in inputs:
            return super().floating_point_ops(inputs)
        return sum(super(TokenBudgetMixin, self).floating_point_ops(mb) for mb in inputs["microbatches"])

    def _track_num_input_tokens(self, inputs):
        # the sampler knows the step's tokens over all ranks: no gather, and a dummy micro-batch's token is not counted
        if "microbatches" not in inputs:
            return super()._track_num_input_tokens(inputs)
        if self.args.include_num_input_tokens_seen != "no":
            self.state.num_input_tokens_seen += inputs["step"].global_tokens

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, model, trial):
        # Written before the Trainer's files, so a checkpoint with a trainer_state.json has its sampler state too.
        # A stream's state is each rank's own (its buffer and source); a sampler's is every rank's, written by rank 0.
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # the folder the Trainer saves into
        folder = os.path.join(self._get_output_dir(trial=trial), name)
        if self.trained_step is not None and self.stream is not None:  # every rank its own, as the RNG states
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, STREAM_STATE_FILE.format(rank=self.args.process_index))
            torch.save(self.stream.state_dict(after=self.trained_step), path + ".tmp")
            os.replace(path + ".tmp", path)
        elif self.trained_step is not None and self.args.should_save:
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, STATE_FILE + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.sampler.state_dict(after=self.trained_step), f)
            os.replace(tmp, os.path.join(folder, STATE_FILE))
        super()._save_checkpoint(model, trial)


class TokenBudgetTrainer(TokenBudgetMixin, Trainer):
    """A ``transformers.Trainer`` whose optimizer steps are a ``TokenBudgetSampler``'s.

    One Trainer batch is one whole sampler step: its micro-batches run forward and backward one at a time, each loss
    divided by the step's ``global_loss_tokens``. ``max_steps`` (or ``num_train_epochs`` of the sampler's epochs)
    counts the sampler's steps, and every checkpoint holds the sampler's position (``sampler_state.json``), so
    ``train(resume_from_checkpoint=...)`` trains the next step. On torchrun, build the ``TrainingArguments`` before
    the sampler: they start the process group the sampler takes its rank from. See docs/library.md.

    Args:
        *args: the ``transformers.Trainer``'s (``model``, ``args``, ``train_dataset``, ...), as keywords or in its
            order; **kwargs takes the rest of them.
        sampler: the ``TokenBudgetSampler`` that plans the steps, built from ``token_counts(train_dataset)``; or a
            function of the train dataset that returns one, called once in the constructor. Left out where
            ``train_dataset`` is a ``balance_batch.stream.TokenBudgetStream``: its steps are trained, ``max_steps``
            of them, and each rank saves its stream state (``stream_state_{rank}.pt``) in every checkpoint.
        collate_fn: makes a micro-batch's items into the model's keyword arguments: ``pack_collate`` (the default)
            or ``pad_collate`` (for a sampler with ``layout="padded"``), either maybe a ``functools.partial``, or a
            function of your own.

    Raises:
        ValueError: in one line, from the constructor: ``sampler`` is neither a sampler nor a function returning
            one, or missing (or given with a ``TokenBudgetStream``); ``train_dataset`` is missing or a stream (an
            ``IterableDataset``) not wrapped in a ``TokenBudgetStream``, which needs ``max_steps``; a
            ``TrainingArguments`` the sampler decides is set (``gradient_accumulation_steps`` other than 1,
            ``per_device_train_batch_size``, ``train_sampling_strategy``, ``dataloader_drop_last``,
            ``auto_find_batch_size``), or
            ``average_tokens_across_devices=False``, or several GPUs in one process; the sampler plans for another
            rank, or its items' tokens or loss tokens are not ``token_counts(train_dataset)``'s (with your own
            ``collate_fn``, only the tokens are compared); with ``pack_collate``, a model ``check_packable`` refuses;
            a model whose forward takes no ``num_items_in_batch``, without ``compute_loss_func``. From ``train``: a
            checkpoint without ``sampler_state.json`` (a stream's: ``stream_state_{rank}.pt``), or epochs or
            ``max_steps`` the sampler's steps never reach.

    Example:
        >>> import tempfile
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
        >>> from balance_batch import TokenBudgetSampler
        >>> from balance_batch.integrations.transformers import TokenBudgetTrainer, token_counts
        >>> rows = [{"input_ids": torch.randint(0, 256, (n,))} for n in (5, 9, 3, 12, 7, 4)]
        >>> lengths, loss_tokens = token_counts(rows)
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
        ...                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, use_cpu=True, report_to="none")
        >>> sampler = TokenBudgetSampler(lengths, loss_tokens_per_sequence=loss_tokens, max_tokens_per_microbatch=16,
        ...                              tokens_per_step=20)
        >>> trainer = TokenBudgetTrainer(model=model, args=args, train_dataset=rows, sampler=sampler)
        >>> trainer.train()  # doctest: +SKIP
    """

    def _check_settings(self) -> None:
        super()._check_settings()
        if not self.model_accepts_loss_kwargs and self.compute_loss_func is None:
            raise ValueError(f"{type(self).__name__}: the model's forward takes no num_items_in_batch, so its loss "
                             "would be a per-micro-batch mean; give compute_loss_func(outputs, labels, "
                             "num_items_in_batch) that sums over tokens and divides by num_items_in_batch")
