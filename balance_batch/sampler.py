"""A token-budget batch sampler for a dataset: seeded epochs cut into optimizer steps (a count of sequences, or a
token count that may ramp up), each step planned over the ranks into micro-batches by the library's planner.

No torch here: ``iter(sampler)`` yields lists of dataset indices, which is what ``torch.utils.data.DataLoader``'s
``batch_sampler`` takes; the packing collate is in ``balance_batch.collate``.

Every rank builds the same sampler (same lengths, seed, budget, world size) and computes the same plan of every
step, so ranks agree without a collective: each gets the same number of micro-batches in every step (an empty list
is a dummy it must still run, so lock-step backends such as FSDP2 do not hang), and each step's token and loss-token
totals over all ranks are known before the step runs.

Three parts: the step cutter (``balance_batch.step_cutter``, a pure function of the lengths, seed, epoch and step
sizes), the plans of its steps (``balance_batch.step_plans``, kept once planned) and the position (``_Run`` here),
which ``steps()`` and a loader's iterator both read and move.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import warnings
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from balance_batch.cost import CostModel
from balance_batch.errors import checked_lengths, checked_loss_tokens
from balance_batch.knobs import checked_groups
from balance_batch.plan import checked_settings
from balance_batch.sampler_state import STATE_VERSION, check_state, settings_config, settings_from_config
from balance_batch.step_cutter import StepCutter, StepSize, megatron_rampup, step_size
from balance_batch.step_plans import Epochs, Partial, Step, StepPlans
from balance_batch.world import resolve_world

__all__ = ["Step", "StepSize", "TokenBudgetSampler", "megatron_rampup"]
WHO = "TokenBudgetSampler"


class _Run:
    """The training position from one start (construction, ``set_epoch``, ``load_state_dict``, an epoch's end) on.

    ``steps()`` and a loader's iterators of this run move it; those of an earlier run no longer do. ``next_step``:
    the step ``steps()`` yields next; ``training``: the step it yielded and the loop has not finished (its generator
    not yet resumed); ``handed``: the furthest (epoch, step, micro-batch) an iterator handed out. Micro-batches count
    those this run takes of a step (after a resume mid-step, from where it resumed).
    """

    def __init__(self, epoch: int, step: int, partial: Optional[Partial] = None):
        self.epoch, self.next_step, self.partial = epoch, step, partial
        self.stepped = False  # whether steps() has yielded: then its position, not an iterator's, is training's
        self.training: Optional[int] = None
        self.handed: Optional[tuple[int, int, int]] = None

    def position(self) -> tuple[int, int, int]:
        """Where training has got to: past the last step ``steps()`` yielded, or, where only a loader's iterator took
        this run's micro-batches, how far it handed them out."""
        if self.handed is not None and not self.stepped:
            return self.handed
        return self.epoch, self.next_step, 0

    def loader_start(self) -> tuple[int, int, int]:
        """Where a loader's iterator begins: at the step the loop is training (an iterator started lazily, by a
        wrapper or accelerate, after ``steps()`` yielded it), else at the position."""
        return (self.epoch, self.training, 0) if self.training is not None else self.position()

    def partial_at(self, epoch: int, step: int) -> Optional[Partial]:
        p = self.partial
        return p if p is not None and (p.epoch, p.step) == (epoch, step) else None


def _epoch_arg(method: str, epoch) -> int:
    """``epoch`` as an int, or one ValueError naming the method it was given to."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"{WHO}.{method}: epoch must be a non-negative integer, got {epoch!r}")
    return int(epoch)


def _checked_items(lengths, loss_tokens_per_sequence) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, loss tokens) as int64 arrays, or one ValueError; loss tokens default to length - 1 (a causal LM
    predicts every token but the first)."""
    L = checked_lengths(lengths, WHO)
    if not L.any():
        raise ValueError(f"{WHO}: lengths must hold at least one positive length (an item of 0 tokens is in no step), "
                         f"got {len(L)} of 0 tokens")
    if loss_tokens_per_sequence is None:
        return L, np.maximum(L - 1, 0)
    return L, checked_loss_tokens(loss_tokens_per_sequence, L, WHO)


class TokenBudgetSampler:
    """A dataset sampled in optimizer steps, each planned over the ranks into micro-batches of at most
    ``max_tokens_per_microbatch`` tokens, every rank running the same number (docs/library.md).

    Args:
        lengths: tokens of each dataset item (an item of 0 tokens is in no step).
        max_tokens_per_microbatch: the budget of one micro-batch (packed: the sum of lengths; padded: count ×
            longest). A longer item runs alone.
        sequences_per_step: items per optimizer step, over all ranks, or a ramp ``[(consumed_sequences, size),
            ...]``. Give this or ``tokens_per_step``.
        tokens_per_step: at most this many tokens per step, over all ranks, or a ramp ``[(consumed_tokens, size),
            ...]`` (the size of the last threshold the tokens consumed before the step have reached).
        world_size, rank: default the initialised ``torch.distributed`` group's (``process_group``, default the
            whole job), as ``DistributedSampler``'s do.
        seed, shuffle: each epoch's order is a permutation seeded by (seed, epoch); ``shuffle=False`` keeps the
            dataset's.
        layout: ``"packed"`` or ``"padded"``; planner: ``"balanced"`` or ``"greedy"`` (``balance_batch.PLANNERS``).
        drop_last: drop a last step that is not full.
        max_seqs_per_microbatch: at most this many items in a micro-batch.
        loss_tokens_per_sequence: per item, the tokens its loss counts (default length − 1, as ``pack_collate``
            lays out a causal LM's labels).
        cost_model: what the planner balances (default: tokens).
        groups, min_microbatches, microbatches_multiple_of, padded_sequences_multiple_of: the peers' knobs, as
            ``plan_step`` takes them; a step holds whole groups.
        rampup: Megatron-LM's ``(start, increment, over)`` ramp up to the step size given.
        longest_first: each epoch's longest item in its first step, run first (a budget too large for the memory
            fails at once), as Hugging Face's ``LengthGroupedSampler`` does.

    Yields:
        ``iter(sampler)``: this rank's micro-batches (lists of dataset indices), a DataLoader's ``batch_sampler``.
        ``steps()``: ``Step`` objects: this rank's micro-batches of each step and the step's ``global_loss_tokens``.

    Raises:
        ValueError: one line naming the first bad argument and what would be valid.

    Example:
        >>> sampler = TokenBudgetSampler([5, 9, 3, 12, 7, 4], max_tokens_per_microbatch=16, tokens_per_step=24,
        ...                              world_size=1, rank=0, shuffle=False)
        >>> [(step.microbatches, step.global_loss_tokens) for step in sampler.steps()]
        [([[1], [0, 2]], 14), ([[3], [4, 5]], 20)]
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens_per_microbatch: int,
        world_size: Optional[int] = None,
        rank: Optional[int] = None,
        process_group: Any = None,
        seed: int = 0,
        shuffle: bool = True,
        sequences_per_step: Optional[StepSize] = None,
        tokens_per_step: Optional[StepSize] = None,
        layout: str = "packed",
        planner: str = "balanced",
        drop_last: bool = False,
        max_seqs_per_microbatch: Optional[int] = None,
        loss_tokens_per_sequence: Optional[Sequence[int]] = None,
        cost_model: Optional[CostModel] = None,
        groups: Optional[Sequence[int]] = None,
        min_microbatches: Optional[int] = None,
        microbatches_multiple_of: Optional[int] = None,
        padded_sequences_multiple_of: Optional[int] = None,
        rampup: Optional[Sequence[int]] = None,
        longest_first: bool = False,
    ):
        world_size, rank = resolve_world(world_size, rank, process_group)
        unit, ramp, self.sequences_per_step = step_size(sequences_per_step, tokens_per_step, rampup, WHO)
        settings = checked_settings(world_size=world_size, budget=max_tokens_per_microbatch, layout=layout,
                                    planner=planner, max_seqs=max_seqs_per_microbatch, cost_model=cost_model,
                                    knobs=(min_microbatches, microbatches_multiple_of, padded_sequences_multiple_of),
                                    groups=groups is not None, budget_required=True, who=WHO)
        self._settings = settings._replace(refine=False)  # planned every step: milliseconds, not refinement rounds
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"{WHO}: seed must be an integer, got {seed!r}")
        if not isinstance(longest_first, (bool, np.bool_)):
            raise ValueError(f"{WHO}: longest_first must be True or False, got {longest_first!r}")
        self.lengths, self.loss_tokens = _checked_items(lengths, loss_tokens_per_sequence)
        self.groups = checked_groups(groups, len(self.lengths), who=WHO)
        self.world_size, self.rank = world_size, rank
        cutter = StepCutter(self.lengths, None if self.groups is None else np.asarray(self.groups), int(seed),
                            bool(shuffle), unit, tuple(ramp), bool(drop_last), bool(longest_first))
        self._epochs = Epochs(cutter)
        self._plans = StepPlans(self._epochs, self.loss_tokens, self._settings, rank)
        self._run = _Run(0, 0)

    # ------------------------------------------------------------------ settings, read-only

    seed = property(lambda self: self._epochs.cutter.seed)
    shuffle = property(lambda self: self._epochs.cutter.shuffle)
    drop_last = property(lambda self: self._epochs.cutter.drop_last)
    longest_first = property(lambda self: self._epochs.cutter.longest_first)
    max_tokens_per_microbatch = property(lambda self: self._settings.budget)
    layout = property(lambda self: self._settings.layout)
    planner = property(lambda self: self._settings.planner)
    max_seqs_per_microbatch = property(lambda self: self._settings.max_seqs)
    cost_model = property(lambda self: self._settings.cost_model)

    @property
    def epoch(self) -> int:
        """The epoch training is in."""
        return self._run.epoch

    @property
    def steps_in_epoch(self) -> int:
        """Optimizer steps in the current epoch (all of them, including those already taken)."""
        return self._epochs.n_steps(self._run.epoch)

    def steps_before(self, epoch: int) -> int:
        """Optimizer steps of all epochs before ``epoch`` (``steps_before(3)``: the steps of 3 epochs from the start;
        with a token ramp, each epoch's count depends on the tokens before it)."""
        return self._epochs.start(_epoch_arg("steps_before", epoch))[0]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new seeded order); the current epoch keeps its position (so a resumed run may call it).

        While the loop trains a step ``steps()`` yielded, the epoch is that step's: a loader that starts lazily calls
        ``set_epoch`` with its own count of passes (accelerate's prepared loader does, at each ``iter``), which would
        hand it another epoch's data; it is left as it is, with a warning.
        """
        epoch = _epoch_arg("set_epoch", epoch)
        run = self._run
        if epoch != run.epoch and run.training is not None:
            warnings.warn(f"{WHO}.set_epoch({epoch}) while the loop trains step {run.training} of epoch {run.epoch} "
                          "from steps(): the epoch stays the step's (a loader started lazily, such as accelerate's, "
                          "counts epochs itself); call set_epoch between steps", stacklevel=2)
        elif epoch != run.epoch:
            self._run = _Run(epoch, 0)

    def plan(self, step_in_epoch: int, epoch: Optional[int] = None) -> Step:
        """Step ``step_in_epoch`` of ``epoch`` (default: the current one) for this rank, whole; moves no position."""
        return self._plans.step(self._run.epoch if epoch is None else epoch, step_in_epoch)

    def _step_to_run(self, run: _Run, epoch: int, step: int) -> Step:
        """The step as ``run`` takes it: whole, or, resumed mid-way into it, the micro-batches still to run."""
        whole, p = self._plans.step(epoch, step), run.partial_at(epoch, step)
        if p is None:
            return whole
        rest = whole.microbatches[p.done:] if p.rest is None else [list(mb) for mb in p.rest[self.rank]]
        return dataclasses.replace(whole, microbatches=rest, first_microbatch=p.done)

    def _current_run(self, at: tuple[int, int, int]) -> _Run:
        """The run, moved on to the next epoch when ``at`` is past its last step (as ``set_epoch(epoch + 1)``): a loop
        that forgets ``set_epoch`` still sees every item once per epoch, in a new order, never an empty epoch."""
        if at[1] >= self._epochs.n_steps(at[0]):
            self._run = _Run(at[0] + 1, 0)
        return self._run

    # ------------------------------------------------------------------ iteration

    def steps(self) -> Iterator[Step]:
        """This rank's steps from the position to the end of the epoch (at the end of a consumed epoch, the next
        one's); the position moves past each step as it is yielded, so ``state_dict()`` resumes at the next one.

        A loader over this sampler in the same loop starts at the step the loop trains, however late its iterator
        starts; one that falls behind (a micro-batch of an earlier step asked for while the loop trains a later one)
        is stopped with a ValueError, never shifted onto another step's data.
        """
        run = self._current_run((self._run.epoch, self._run.next_step, 0))  # its own position, not a loader's
        while self._run is run and run.next_step < self._epochs.n_steps(run.epoch):
            k = run.next_step
            step = self._step_to_run(run, run.epoch, k)
            run.next_step, run.stepped, run.training = k + 1, True, k
            try:
                yield step
            finally:
                if run.training == k:  # the loop came back for the next step (or left): step k is done
                    run.training = None

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro-batches from the position (or the step ``steps()`` is training) to the end of the epoch,
        one at a time (a ``DataLoader``'s ``batch_sampler``). The iterator has its own ``state_dict`` /
        ``load_state_dict`` at micro-batch granularity (what torchdata's ``StatefulDataLoader`` saves)."""
        run = self._current_run(self._run.loader_start())
        return _MicroBatches(self, run, run.loader_start())

    def __len__(self) -> int:
        """Micro-batches ``iter`` yields from where it would begin (at the end of a consumed epoch, the next
        epoch's). Each step's count is planned once and kept: a second call costs nothing."""
        epoch, step, done = self._run.loader_start()
        if step >= self._epochs.n_steps(epoch):
            epoch, step, done = epoch + 1, 0, 0
        counts = self._plans.counts(epoch)
        for s in np.flatnonzero(counts[step:] < 0) + step:
            self._plans.step(epoch, int(s))
        if step >= len(counts):
            return 0
        here = int(counts[step]) if self._run.partial_at(epoch, step) is None else \
            len(self._step_to_run(self._run, epoch, step).microbatches)
        return here - done + int(counts[step + 1:].sum())

    @property
    def batch_size(self) -> None:
        """None: micro-batches vary in size. Read by accelerate's ``prepare`` to shard a batch sampler over its
        processes, which would split this rank's own plan again: refused there (``world_size`` > 1)."""
        if self.world_size > 1:
            raise ValueError(
                f"{WHO}: it already plans rank {self.rank}'s micro-batches of {self.world_size}, and "
                "accelerate's prepare() would shard them again over the processes (each rank would run part of its "
                "plan): leave the DataLoader out of accelerator.prepare() and move each batch to the device with "
                "accelerate.utils.send_to_device(batch, accelerator.device)")
        return None

    # ------------------------------------------------------------------ resume

    @functools.cached_property
    def _digest(self) -> str:  # hashed once, when a state is first saved or loaded
        return hashlib.sha256(self.lengths.tobytes() + b"|" + self.loss_tokens.tobytes()).hexdigest()[:16]

    @functools.cached_property
    def _groups_digest(self) -> Optional[str]:  # as the dataset's: once, not at every micro-batch a loader saves
        if self.groups is None:
            return None
        return "sha256 " + hashlib.sha256(np.asarray(self.groups, dtype=np.int64).tobytes()).hexdigest()[:16]

    def _config(self) -> dict:
        cutter = self._epochs.cutter
        return {
            "dataset": f"{len(self.lengths)} items, sha256 {self._digest}",
            "seed": cutter.seed,
            "shuffle": cutter.shuffle,
            "sequences_per_step": self.sequences_per_step,
            "tokens_per_step": None if cutter.unit == "sequences" else [list(p) for p in cutter.ramp],
            "groups": self._groups_digest,
            "drop_last": cutter.drop_last,
            "longest_first": cutter.longest_first,
            **settings_config(self._settings),
        }

    def state_dict(self, after: Optional[Step] = None) -> dict:
        """Where training has got to (plain ints, lists and strings: JSON- and torch.save-able). With ``after``, the
        position just after that step (a loader that prefetches whole steps saves the last trained)."""
        if after is not None:
            return self._state(after.epoch, after.step - self._epochs.start(after.epoch)[0] + 1, 0)
        return self._state(*self._run.position())

    def _state(self, epoch: int, step: int, done: int, run: Optional[_Run] = None) -> dict:
        """The state at micro-batch ``done`` of the micro-batches ``run`` (default: the current one) takes of
        ``step``."""
        p = (run or self._run).partial_at(epoch, step)
        microbatch, handed = done, None
        if p is not None:
            microbatch += p.done
            if p.rest is not None:  # re-planned after an elastic resume: say which items ran
                handed = sorted(p.handed + [i for rank in p.rest for mb in rank[:done] for i in (mb or ())])
        steps, tokens, sequences = self._epochs.start(epoch)
        state = {"version": STATE_VERSION, "epoch": epoch, "step_in_epoch": step, "microbatch": microbatch,
                 "epoch_start_step": steps, "epoch_start_tokens": tokens, "epoch_start_sequences": sequences,
                 "config": self._config()}
        if handed is not None:
            state["handed"] = handed
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position. A state saved under another world size, budget, layout, planner, cost
        model or sequence cap resumes too, each remaining step holding the items it would have held; one whose
        settings decide other steps (dataset, seed, shuffle, step size or ramp, drop_last, groups, longest_first) is
        refused in one line. States of versions 1 and 2 load."""
        saved = check_state(state, self._config())
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        start = None
        if "epoch_start_sequences" in state:  # else (a state saved before sequences were counted) counted again here
            start = (int(state["epoch_start_step"]), int(state["epoch_start_tokens"]),
                     int(state["epoch_start_sequences"]))
        self._epochs.reset(epoch, start)
        self._plans.clear()
        done, handed = int(state.get("microbatch", 0)), state.get("handed")
        partial = None
        if (done or handed) and step < self._epochs.n_steps(epoch):
            partial = self._plans.rest_of_step(epoch, step, done, handed, settings_from_config(saved))
            if partial is None:  # nothing of the step is left
                step += 1
        self._run = _Run(epoch, step, partial)


class _MicroBatches:
    """``iter(sampler)``: this rank's micro-batches from a position to the end of its epoch, with a state of its own."""

    def __init__(self, sampler: TokenBudgetSampler, run: _Run, at: tuple[int, int, int]):
        self._sampler, self._run, self._at = sampler, run, at

    def __iter__(self) -> "_MicroBatches":
        return self

    def __next__(self) -> list[int]:
        sampler, run = self._sampler, self._run
        epoch, step, done = self._at
        n_steps = sampler._epochs.n_steps(epoch)
        while step < n_steps:
            microbatches = sampler._step_to_run(run, epoch, step).microbatches
            if done < len(microbatches):
                current = run is sampler._run
                if current and run.training is not None and step < run.training:
                    raise ValueError(f"{WHO}: the loader over this sampler is behind steps(): it would hand out a "
                                     f"micro-batch of step {step} while the loop trains step {run.training}; take "
                                     "each step's micro-batches from the loader in the step that yields them")
                self._at = (epoch, step, done + 1) if done + 1 < len(microbatches) else (epoch, step + 1, 0)
                if current:
                    run.handed = self._at
                return list(microbatches[done])
            step, done = step + 1, 0
        self._at = (epoch, step, 0)
        raise StopIteration

    def state_dict(self) -> dict:
        """The sampler's state at the micro-batch this iterator hands out next."""
        return self._sampler._state(*self._at, run=self._run)

    def load_state_dict(self, state: dict) -> None:
        """Resume the sampler (its training position too) and this iterator at ``state``'s micro-batch."""
        self._sampler.load_state_dict(state)
        self._run = self._sampler._run
        self._at = self._run.position()
