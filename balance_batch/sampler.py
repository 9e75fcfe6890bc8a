"""A token-budget batch sampler for a dataset: seeded epochs cut into optimizer steps (a count of sequences, or a
token count that may ramp up), each step planned over the ranks into micro-batches by the library's planner.

No torch here: ``iter(sampler)`` yields lists of dataset indices, which is what ``torch.utils.data.DataLoader``'s
``batch_sampler`` takes; the packing collate is in ``balance_batch.collate``.

Every rank builds the same sampler (same lengths, seed, budget, world size) and computes the same plan of every
step, so ranks agree without a collective: each gets the same number of micro-batches in every step (an empty list
is a dummy it must still run, so lock-step backends such as FSDP2 do not hang), and each step's token and loss-token
totals over all ranks are known before the step runs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from balance_batch.balanced import balanced_schedules
from balance_batch.cost import LAYOUTS, CostModel
from balance_batch.errors import check_choice, positive_int
from balance_batch.plan import PLANNERS, plan_step

STATE_VERSION = 1
Schedule = Union[int, Sequence[Sequence[int]]]  # tokens_per_step: a number, or [(consumed_tokens, tokens), ...]
_PLAN_CACHE = 64  # planned steps kept, so iter() (a DataLoader's prefetch) and steps() plan each step once


@dataclass(frozen=True)
class Step:
    """One optimizer step, as this rank sees it.

    ``microbatches``: this rank's micro-batches, lists of dataset indices, run in this order; ``[]`` is a dummy (run
    it with zero loss weight: every rank runs the same number). ``global_tokens`` / ``global_loss_tokens``: the
    step's tokens and loss tokens over all ranks (the loss denominator). ``step``: optimizer steps before this one,
    since epoch 0; ``consumed_tokens``: tokens of those steps, all ranks.
    """

    microbatches: list[list[int]]
    global_tokens: int
    global_loss_tokens: int
    step: int
    epoch: int
    consumed_tokens: int


def _ramp(tokens_per_step: Schedule) -> list[tuple[int, int]]:
    """``tokens_per_step`` as [(threshold, tokens), ...] from threshold 0, thresholds increasing."""
    if not isinstance(tokens_per_step, (list, tuple)):
        positive_int("tokens_per_step", tokens_per_step, who="TokenBudgetSampler")
        return [(0, int(tokens_per_step))]
    bad = ValueError("TokenBudgetSampler: tokens_per_step must be a positive integer or a schedule "
                     f"[(consumed_tokens, tokens_per_step), ...] starting at 0 with increasing thresholds and "
                     f"positive sizes, got {tokens_per_step!r}")
    try:
        pairs = [(int(c), int(t)) for c, t in tokens_per_step]
    except (TypeError, ValueError):
        raise bad from None
    ok = (pairs and pairs[0][0] == 0 and all(t > 0 for _, t in pairs)
          and all(a[0] < b[0] for a, b in zip(pairs, pairs[1:])))
    if not ok:
        raise bad
    return pairs


class TokenBudgetSampler:
    """Optimizer steps of a dataset, planned into equal-count micro-batches per rank; see docs/library.md.

    ``lengths``: tokens of each dataset item. ``max_tokens_per_microbatch``: the budget of one micro-batch (packed:
    the sum of lengths; padded: count x longest); a longer sequence runs alone. A step is ``sequences_per_step``
    sequences, or at most ``tokens_per_step`` tokens over all ranks (a number, or a ramp
    ``[(consumed_tokens, tokens_per_step), ...]``: the size from the last threshold the tokens consumed before the step
    have reached). ``loss_tokens_per_sequence``: per item, the tokens its loss counts (default length - 1: a causal LM
    predicts every token but the first, as ``balance_batch.collate.pack_collate`` lays it out). ``cost_model``
    (default: cost = tokens) is what the planner balances; ``max_seqs_per_microbatch`` caps a micro-batch's sequences.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens_per_microbatch: int,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        sequences_per_step: Optional[int] = None,
        tokens_per_step: Optional[Schedule] = None,
        layout: str = "packed",
        planner: str = "balanced",
        drop_last: bool = False,
        max_seqs_per_microbatch: Optional[int] = None,
        loss_tokens_per_sequence: Optional[Sequence[int]] = None,
        cost_model: Optional[CostModel] = None,
    ):
        positive_int("max_tokens_per_microbatch", max_tokens_per_microbatch, who="TokenBudgetSampler")
        positive_int("world_size", world_size, who="TokenBudgetSampler")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise ValueError(f"TokenBudgetSampler: rank must be an integer in [0, world_size={world_size}), "
                             f"got {rank!r}")
        if (sequences_per_step is None) == (tokens_per_step is None):
            raise ValueError("TokenBudgetSampler: give exactly one of sequences_per_step and tokens_per_step, got "
                             f"{'both' if sequences_per_step is not None else 'neither'}")
        positive_int("sequences_per_step", sequences_per_step, none_ok=True, who="TokenBudgetSampler")
        self._ramp = None if tokens_per_step is None else _ramp(tokens_per_step)
        check_choice("layout", layout, LAYOUTS, who="TokenBudgetSampler")
        check_choice("planner", planner, PLANNERS, who="TokenBudgetSampler")
        positive_int("max_seqs_per_microbatch", max_seqs_per_microbatch, none_ok=True, who="TokenBudgetSampler")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"TokenBudgetSampler: seed must be an integer, got {seed!r}")
        L = np.asarray(lengths)
        if L.ndim != 1 or L.size == 0 or not np.issubdtype(L.dtype, np.integer) or (L <= 0).any():
            raise ValueError("TokenBudgetSampler: lengths must be a non-empty sequence of positive integers")
        self.lengths = L.astype(np.int64)
        if loss_tokens_per_sequence is None:
            self.loss_tokens = self.lengths - 1
        else:
            lt = np.asarray(loss_tokens_per_sequence)
            if (lt.shape != L.shape or not np.issubdtype(lt.dtype, np.integer) or (lt < 0).any()
                    or (lt > self.lengths).any()):
                raise ValueError("TokenBudgetSampler: loss_tokens_per_sequence must give, per item, an integer in "
                                 "[0, its length]")
            self.loss_tokens = lt.astype(np.int64)
        self.max_tokens_per_microbatch = int(max_tokens_per_microbatch)
        self.world_size, self.rank, self.seed = int(world_size), int(rank), int(seed)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.sequences_per_step = None if sequences_per_step is None else int(sequences_per_step)
        self.layout, self.planner = layout, planner
        self.max_seqs_per_microbatch = max_seqs_per_microbatch
        self.cost_model = cost_model or CostModel.tokens()
        self._epoch_starts: dict[int, tuple[int, int]] = {0: (0, 0)}  # epoch -> (steps, tokens) before it
        self._plans: OrderedDict = OrderedDict()
        self._epoch, self._position = 0, 0  # the next step steps() yields, within the epoch
        self._cut_epoch: Optional[int] = None

    # ------------------------------------------------------------------ the epoch's steps

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.lengths))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))

    def _cut(self, epoch: int):
        """``_cut_steps(epoch)``, kept for the epoch last asked about."""
        if self._cut_epoch != epoch:
            self._cut_value, self._cut_epoch = self._cut_steps(epoch), epoch
        return self._cut_value

    def _cut_steps(self, epoch: int):
        """(order, step bounds [(start, end)] into order, tokens consumed before each step, tokens consumed after the
        epoch) for ``epoch``."""
        order = self._order(epoch)
        prefix = np.concatenate([[0], np.cumsum(self.lengths[order])])
        n = len(order)
        _, consumed = self._epoch_start(epoch)
        bounds, before, p = [], [], 0
        longest = int(self.lengths.max())
        while p < n:
            if self.sequences_per_step is not None:
                q, full = min(n, p + self.sequences_per_step), p + self.sequences_per_step <= n
            else:
                target = self._target(consumed)
                # the most sequences from p whose tokens stay within the target; at least one
                q = max(p + 1, int(np.searchsorted(prefix, prefix[p] + target, side="right")) - 1)
                full = q < n or int(prefix[q] - prefix[p]) >= target - longest
            if q == n and not full and self.drop_last:
                break
            bounds.append((p, q))
            before.append(consumed)
            consumed += int(prefix[q] - prefix[p])
            p = q
        return order, bounds, before, consumed

    def _target(self, consumed: int) -> int:
        return next(t for c, t in reversed(self._ramp) if consumed >= c)

    def _epoch_start(self, epoch: int) -> tuple[int, int]:
        """Steps and tokens of all epochs before ``epoch`` (each epoch's cut depends on the tokens before it)."""
        known = max(e for e in self._epoch_starts if e <= epoch)
        while known < epoch:
            steps, _ = self._epoch_starts[known]
            _, bounds, _, end = self._cut_value if self._cut_epoch == known else self._cut_steps(known)
            self._epoch_starts[known + 1] = (steps + len(bounds), end)
            known += 1
        return self._epoch_starts[epoch]

    @property
    def epoch(self) -> int:
        return self._epoch

    def steps_before(self, epoch: int) -> int:
        """Optimizer steps of all epochs before ``epoch`` (``steps_before(3)``: the steps of 3 epochs from the start;
        with a token ramp, each epoch's count depends on the tokens before it)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"TokenBudgetSampler.steps_before: epoch must be a non-negative integer, got {epoch!r}")
        return self._epoch_start(int(epoch))[0]

    @property
    def steps_in_epoch(self) -> int:
        """Optimizer steps in the current epoch (all of them, including those already taken)."""
        return len(self._cut(self._epoch)[1])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new seeded order); the current epoch keeps its position (so a resumed run may call it)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"TokenBudgetSampler.set_epoch: epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self._epoch:
            self._epoch, self._position = int(epoch), 0

    # ------------------------------------------------------------------ planning

    def plan(self, step_in_epoch: int, epoch: Optional[int] = None) -> Step:
        """Step ``step_in_epoch`` of ``epoch`` (default: the current one) for this rank; moves no position."""
        epoch = self._epoch if epoch is None else epoch
        key = (epoch, step_in_epoch)
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        order, bounds, before, _ = self._cut(epoch)
        p, q = bounds[step_in_epoch]
        members = order[p:q]
        schedules = self._schedules(self.lengths[members].tolist())
        mine = [members[mb].tolist() if mb else [] for mb in schedules[self.rank]]
        start_steps, _ = self._epoch_start(epoch)
        step = Step(microbatches=mine, global_tokens=int(self.lengths[members].sum()),
                    global_loss_tokens=int(self.loss_tokens[members].sum()), step=start_steps + step_in_epoch,
                    epoch=epoch, consumed_tokens=before[step_in_epoch])
        self._plans[key] = step
        if len(self._plans) > _PLAN_CACHE:
            self._plans.popitem(last=False)
        return step

    def _schedules(self, lengths: list[int]) -> list[list]:
        """Per rank, the step's micro-batches (indices into ``lengths``), equal counts, ``None`` or [] for a dummy."""
        B, W = self.max_tokens_per_microbatch, self.world_size
        if self.planner == "balanced":
            # plan_step's planner without its refinement rounds: planned every step, it must take milliseconds, and the
            # rounds change a step's critical path by 0.01% (docs/measurements/2026-12-04-sampler.md)
            return balanced_schedules(lengths, W, B, self.layout, self.cost_model, self.max_seqs_per_microbatch,
                                      work=0)
        return plan_step(lengths, world_size=W, max_tokens_per_microbatch=B, layout=self.layout, planner=self.planner,
                         cost_model=self.cost_model, max_seqs_per_microbatch=self.max_seqs_per_microbatch).microbatches

    # ------------------------------------------------------------------ iteration

    def steps(self) -> Iterator[Step]:
        """This rank's steps from the current position to the end of the epoch; the position moves past each step as
        it is yielded (so ``state_dict()`` after a step is taken resumes at the next one)."""
        epoch = self._epoch
        while self._epoch == epoch and self._position < self.steps_in_epoch:
            step = self.plan(self._position)
            self._position += 1
            yield step

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro-batches from the current position to the end of the epoch, one at a time (a
        ``DataLoader``'s ``batch_sampler``). Starts where ``steps()`` is when ``iter`` is called, and moves no position:
        a loader prefetches, so the training loop's ``steps()`` is what says how far training has got."""
        return self._microbatches(self._epoch, self._position)  # the position now, not at the first next()

    def _microbatches(self, epoch: int, start: int) -> Iterator[list[int]]:
        for s in range(start, len(self._cut(epoch)[1])):
            yield from (list(mb) for mb in self.plan(s, epoch).microbatches)

    def __len__(self) -> int:
        """Micro-batches ``iter`` yields from the current position (plans the rest of the epoch)."""
        return sum(len(self.plan(s).microbatches) for s in range(self._position, self.steps_in_epoch))

    # ------------------------------------------------------------------ resume

    def _config(self) -> dict:
        digest = hashlib.sha256(self.lengths.tobytes() + b"|" + self.loss_tokens.tobytes()).hexdigest()[:16]
        return {
            "dataset": f"{len(self.lengths)} items, sha256 {digest}",
            "max_tokens_per_microbatch": self.max_tokens_per_microbatch,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "sequences_per_step": self.sequences_per_step,
            "tokens_per_step": None if self._ramp is None else [list(p) for p in self._ramp],
            "layout": self.layout,
            "planner": self.planner,
            "drop_last": self.drop_last,
            "max_seqs_per_microbatch": self.max_seqs_per_microbatch,
            "cost_model": [self.cost_model.a, self.cost_model.b, self.cost_model.c, self.cost_model.fixed],
        }

    def state_dict(self, after: Optional[Step] = None) -> dict:
        """Where ``steps()`` has got to (plain ints, lists and strings: JSON- and torch.save-able); with ``after``, the
        position just after that step instead (a loader that prefetches steps saves the last one trained)."""
        epoch, position = self._epoch, self._position
        if after is not None:
            epoch = after.epoch
            position = after.step - self._epoch_start(epoch)[0] + 1
        steps, tokens = self._epoch_start(epoch)
        return {"version": STATE_VERSION, "epoch": epoch, "step_in_epoch": position,
                "epoch_start_step": steps, "epoch_start_tokens": tokens, "config": self._config()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position; refuses (one-line ValueError) a state saved with other settings."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"TokenBudgetSampler.load_state_dict: not a version-{STATE_VERSION} sampler state")
        saved, mine = state.get("config", {}), self._config()
        differ = [k for k in mine if saved.get(k) != mine[k]]
        if differ:
            raise ValueError("TokenBudgetSampler.load_state_dict: the state was saved with "
                             + "; ".join(f"{k}={saved.get(k)!r}, this sampler has {mine[k]!r}" for k in differ))
        epoch = int(state["epoch"])
        self._epoch_starts = {0: (0, 0), epoch: (int(state["epoch_start_step"]), int(state["epoch_start_tokens"]))}
        self._cut_epoch, self._plans = None, OrderedDict()
        self._epoch, self._position = epoch, int(state["step_in_epoch"])
