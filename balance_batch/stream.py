"""Token-budget steps from a stream: items whose lengths are not known up front (a ``datasets`` stream, a shard
reader, a generator that tokenizes as it reads), cut into optimizer steps as ``TokenBudgetSampler`` cuts a dataset,
each step planned over every rank's items together.

Each rank reads its own source into a buffer. At each step every rank offers the lengths of up to a whole step of
its buffer (a seeded draw); the ranks gather the offers, take the step from them in turn (one item from each rank in
rank order, again and again, until the step size is reached) and plan it with the library's pipeline
(``balance_batch.plan.planned_rows``): the same plan on every rank, no rank deciding for the others. An item the plan
gives another rank is sent to it over the process group; of the plan's equally good rank orders, the one that moves
the fewest tokens is used. An untaken offer goes back to its buffer. When no rank has anything left to offer, every
rank stops at the same step.

No torch import here: the collectives are the initialised ``torch.distributed``'s (world size 1 needs none).
"""

from __future__ import annotations

import copy
import functools
import itertools
import numbers
import pickle
import sys
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

import numpy as np

from balance_batch.cost import CostModel
from balance_batch.errors import shown
from balance_batch.plan import checked_settings, planned_rows
from balance_batch.sampler_state import settings_config
from balance_batch.step_cutter import StepSize, size_at, step_size
from balance_batch.step_plans import Step
from balance_batch.tokens import loss_tokens
from balance_batch.world import resolve_world

__all__ = ["Step", "TokenBudgetStream"]
WHO = "TokenBudgetStream"
STATE_VERSION = 1
# What decides which items form each step: a state saved under other values would train other items, so it is
# refused. The budget, layout, planner and cost model only decide how a step's items are planned, and may change.
STEP_KEYS = ("seed", "sequences_per_step", "tokens_per_step", "buffer_size", "world_size", "rank")


class StreamError(ValueError, TypeError):
    """A bad source, item or length function: one line naming it and what would be valid (a ValueError, and a
    TypeError where a value has the wrong type)."""


def _default_length(item) -> int:
    if not isinstance(item, Mapping) or "input_ids" not in item:
        raise StreamError(f"{WHO}: an item has no input_ids ({type(item).__name__}); give length=, a function of an "
                          "item that returns its tokens")
    return len(item["input_ids"])


def _default_loss_tokens(item, length: int) -> int:
    """The tokens an item's loss counts as ``pack_collate`` lays it out: its labels after the first that are not
    -100, or, without labels, every token but the first."""
    if isinstance(item, Mapping) and "labels" in item:
        return loss_tokens(item["labels"])
    return max(length - 1, 0)


def _count(value, what: str, item_no: int, at_most: Optional[int] = None) -> int:
    """``value`` as a count of tokens, or one StreamError naming ``what`` returned it for which item."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StreamError(f"{WHO}: {what} returned {shown(value)} for item {item_no} of this rank's source; it must "
                          "return an integer count of tokens")
    if value < 0 or (at_most is not None and value > at_most):
        bound = f"between 0 and its length {at_most}" if at_most is not None else "0 or more"
        raise StreamError(f"{WHO}: {what} returned {int(value)} for item {item_no} of this rank's source; it must be "
                          f"{bound}")
    return int(value)


class _Exchange:
    """The step's collectives over ``group``: gathering every rank's offer, moving items to the ranks that run them.
    World size 1 has none."""

    def __init__(self, world_size: int, group: Any):
        self.world_size, self.group = world_size, group
        self.dist = sys.modules.get("torch.distributed") if world_size > 1 else None
        if world_size > 1 and (self.dist is None or not self.dist.is_initialized()):
            raise StreamError(f"{WHO}: world_size={world_size} needs an initialised torch.distributed process group "
                              "to exchange items: call torch.distributed.init_process_group() first")

    def gather(self, offer: np.ndarray, error: Optional[str] = None) -> list[np.ndarray]:
        """Every rank's offer, in rank order; a rank's reading error raised on every rank (one line naming the rank),
        so no rank waits in a collective the failed one never joins."""
        gathered = [(offer, error)]
        if self.dist is not None:
            gathered = [None] * self.world_size
            self.dist.all_gather_object(gathered, (offer, error), group=self.group)
        failed = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
        if failed:
            rank, message = failed[0]
            raise StreamError(message if self.dist is None else f"rank {rank}: {message}")
        return [o for o, _ in gathered]

    def move(self, outgoing: list[list]) -> list[list]:
        """``outgoing[d]``: the items for rank ``d``; returns the items each rank sent here, in rank order."""
        if self.dist is None:
            return outgoing
        import torch

        payloads = [pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL) if items else b"" for items in outgoing]
        nccl = "nccl" in str(self.dist.get_backend(self.group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=device)
        incoming = torch.empty_like(sizes)
        self.dist.all_to_all_single(incoming, sizes, group=self.group)
        data = b"".join(payloads)
        send = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8))
        receive_sizes = incoming.tolist()
        received = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=device)
        self.dist.all_to_all_single(received, send.to(device), output_split_sizes=receive_sizes,
                                    input_split_sizes=sizes.tolist(), group=self.group)
        raw, out, at = received.cpu().numpy().tobytes(), [], 0
        for n in receive_sizes:
            out.append(pickle.loads(raw[at:at + n]) if n else [])
            at += n
        return out


def _within(lengths: np.ndarray, size: int, by_count: bool) -> int:
    """How many of ``lengths``, from the first, a step of ``size`` takes: the most whose sequences (or tokens) stay
    within it, at least one (as the sampler's cutter takes them)."""
    units = np.ones(len(lengths), dtype=np.int64) if by_count else lengths
    return max(int(np.searchsorted(np.cumsum(units), size, side="right")), 1)


def _round_robin(offers: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The offers taken in turn, one from each rank in rank order: (rank, index in its offer) per item."""
    ranks = np.concatenate([np.full(len(o), r, dtype=np.int64) for r, o in enumerate(offers)])
    index = np.concatenate([np.arange(len(o), dtype=np.int64) for o in offers])
    order = np.lexsort((ranks, index))  # by place in the offer, then by rank
    return ranks[order], index[order]


def _fewest_moved(rows: list[list], owner: np.ndarray, lengths: np.ndarray) -> list[list]:
    """The plan's rank schedules given to the ranks so that the most tokens stay where they were read (largest
    first, greedily); any order of whole schedules is as balanced as the plan."""
    world = len(rows)
    kept = np.zeros((world, world), dtype=np.int64)  # kept[s, r]: tokens of schedule s that rank r holds
    for s, schedule in enumerate(rows):
        ids = [i for mb in schedule if mb for i in mb]
        if ids:
            np.add.at(kept[s], owner[ids], lengths[ids])
    order = np.argsort(-kept, axis=None, kind="stable")
    given, taken, out = [-1] * world, set(), [None] * world
    for flat in order.tolist():
        s, r = divmod(flat, world)
        if given[s] < 0 and r not in taken:
            given[s] = r
            taken.add(r)
            out[r] = rows[s]
    return out


class _Reader:
    """This rank's source and buffer: the items read and not yet trained, in the order they were read (an untaken
    offer stays where it was), with their lengths and loss tokens; and the source's position, its own
    ``state_dict`` where it has one, else the count of items read (skipped when it is opened again)."""

    def __init__(self, source, length: Optional[Callable], loss_tokens: Optional[Callable]):
        if isinstance(source, (str, bytes, Mapping)) or not (hasattr(source, "__iter__")
                                                             or hasattr(source, "__getitem__")):
            raise StreamError(f"{WHO}: source must be an iterable of items (a datasets.IterableDataset, a generator, "
                              f"a list), got {type(source).__name__}")
        for name, fn in (("length", length), ("loss_tokens", loss_tokens)):
            if fn is not None and not callable(fn):
                raise StreamError(f"{WHO}: {name} must be a function of an item returning an integer, got "
                                  f"{type(fn).__name__}")
        self.source, self.length, self.loss_tokens = source, length or _default_length, loss_tokens
        self.stateful = callable(getattr(source, "state_dict", None)) and callable(
            getattr(source, "load_state_dict", None))
        self.reset()

    def reset(self) -> None:
        self.it: Optional[Iterator] = None  # opened at the first read, after any load_state_dict
        self.skip = 0  # items of a source without a state_dict to skip on opening (read before a resume)
        self.read = 0  # items read from the source (those of 0 tokens too), before a resume included
        self.dry = False
        self.items: list = []
        self.lengths: list[int] = []
        self.losses: list[int] = []

    def _open(self) -> Iterator:
        self.it = iter(self.source)
        if self.skip:
            skipped = sum(1 for _ in itertools.islice(self.it, self.skip))
            if skipped < self.skip:
                raise StreamError(f"{WHO}: the state says this rank had read {self.skip} items of its source, which "
                                  f"now holds {skipped}: resume on the same source")
            self.skip = 0
        return self.it

    def counts(self, item, number: int) -> tuple[int, int]:
        """The item's (tokens, loss tokens), or one StreamError naming the function and the item."""
        try:
            n = _count(self.length(item), "length", number)
            if n == 0:
                return 0, 0
            loss = _default_loss_tokens(item, n) if self.loss_tokens is None else self.loss_tokens(item)
        except StreamError:
            raise
        except Exception as exc:  # the user's function: whatever it raises is named in one line
            raise StreamError(f"{WHO}: length or loss_tokens raised {type(exc).__name__}: {exc} on item {number} of "
                              "this rank's source") from exc
        return n, _count(loss, "loss_tokens", number, at_most=n)

    def add(self, item, number: int) -> None:
        """``item`` into the buffer, unless it has 0 tokens (placed nowhere, as elsewhere in the library)."""
        n, loss = self.counts(item, number)
        if n:
            self.items.append(item)
            self.lengths.append(n)
            self.losses.append(loss)

    def fill(self, size: int, by_count: bool, buffer_size: int) -> None:
        """Read until the buffer holds ``buffer_size`` items and a whole step of ``size``, or the source is dry."""
        it = self.it if self.it is not None else self._open()
        held = len(self.items) if by_count else sum(self.lengths)
        while not self.dry and (len(self.items) < buffer_size or held < size):
            try:
                item = next(it)
            except StopIteration:
                self.dry = True
                return
            before, self.read = len(self.items), self.read + 1
            self.add(item, self.read - 1)
            if len(self.items) > before:
                held += 1 if by_count else self.lengths[-1]

    def offer(self, draw_seed: list[int], size: int, by_count: bool) -> tuple[np.ndarray, np.ndarray]:
        """Positions in the buffer drawn (a permutation seeded by ``draw_seed``), up to a whole step, and their
        (length, loss tokens) as a 2 × n array."""
        n = len(self.items)
        if n == 0:
            return np.zeros(0, dtype=np.int64), np.zeros((2, 0), dtype=np.int64)
        draw = np.random.default_rng(draw_seed).permutation(n)
        lengths = np.asarray(self.lengths, dtype=np.int64)[draw]
        k = _within(lengths, size, by_count)
        draw = draw[:k]
        return draw, np.stack([lengths[:k], np.asarray(self.losses, dtype=np.int64)[draw]])

    def remove(self, positions) -> None:
        gone = set(positions)
        keep = [j for j in range(len(self.items)) if j not in gone]
        self.items = [self.items[j] for j in keep]
        self.lengths = [self.lengths[j] for j in keep]
        self.losses = [self.losses[j] for j in keep]

    def state(self) -> dict:
        position = {"state": copy.deepcopy(self.source.state_dict())} if self.stateful else {"read": self.read}
        return {"source": position, "source_read": self.read, "source_dry": self.dry, "buffer": list(self.items)}

    def load(self, state: dict, who: str) -> None:
        source = state["source"]
        if ("state" in source) != self.stateful:
            raise StreamError(f"{who}: the state was saved from a source "
                              f"{'with' if 'state' in source else 'without'} a state_dict; this one has "
                              f"{'one' if self.stateful else 'none'}")
        self.reset()
        if self.stateful:
            self.source.load_state_dict(copy.deepcopy(source["state"]))
        else:
            self.skip = int(source["read"])
        self.dry, self.read = bool(state["source_dry"]), int(state["source_read"])
        if self.dry:  # the source had run dry: not opened again
            self.it = iter(())
        for item in state["buffer"]:  # their lengths and loss tokens counted again, as when read
            self.add(item, -1)


def _as_torch_dataset() -> None:
    """Where torch's data utilities are imported, a stream counts as their ``IterableDataset`` (a virtual subclass),
    so ``DataLoader`` and torchdata's ``StatefulDataLoader`` take it as it is (``batch_size=None``)."""
    data = sys.modules.get("torch.utils.data")
    if data is not None and not issubclass(TokenBudgetStream, data.IterableDataset):
        data.IterableDataset.register(TokenBudgetStream)


def _in_loader_worker() -> bool:
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def _planned_step(offers: list[np.ndarray], size: int, by_count: bool, settings) -> Optional[tuple]:
    """The step taken from every rank's offer in turn and planned: (owner rank and index in its offer, length, loss
    tokens) per item, and each rank's micro-batches (indices into the step; None a dummy), the plan's schedules
    given to the ranks that hold most of their tokens. None when no rank offered anything."""
    ranks, index = _round_robin([o[0] for o in offers])
    if len(ranks) == 0:
        return None
    offered = np.concatenate(offers, axis=1)
    at = np.concatenate([[0], np.cumsum([o.shape[1] for o in offers])])[ranks] + index
    lengths, losses = offered[0][at], offered[1][at]
    k = _within(lengths, size, by_count)
    ranks, index, lengths, losses = ranks[:k], index[:k], lengths[:k], losses[:k]
    rows, _ = planned_rows(lengths.tolist(), settings)
    return ranks, index, lengths, losses, _fewest_moved(rows, ranks, lengths)


class TokenBudgetStream:
    """Optimizer steps from this rank's stream of items, each planned over every rank's items into micro-batches of
    at most ``max_tokens_per_microbatch`` tokens, every rank running the same number (docs/library.md#streams).

    Args:
        source: this rank's iterable of items (a ``datasets.IterableDataset`` split by node, a generator, a list).
        max_tokens_per_microbatch: the budget of one micro-batch; a longer item runs alone.
        tokens_per_step / sequences_per_step: the step size over all ranks, exactly one of them, or a ramp
            ``[(consumed, size), ...]``; ``rampup``: Megatron-LM's ``(start, increment, over)``, as the sampler takes
            them.
        seed: seeds each step's draw from each rank's buffer.
        buffer_size: items each rank keeps to draw from (it reads at least a step's worth); more mixes the stream
            more, at the memory of the items held.
        length: ``length(item)``, the item's tokens (default ``len(item["input_ids"])``). An item of 0 tokens is
            read and placed nowhere.
        loss_tokens: ``loss_tokens(item)``, the tokens its loss counts (default: as ``pack_collate`` lays it out,
            its labels after the first that are not -100, or every token but the first).
        process_group, world_size, rank: the ranks that share the steps (default the initialised group's, as
            ``DistributedSampler``'s); the collectives run on ``process_group`` (a NCCL group moves items through
            the current CUDA device).
        layout, planner, max_seqs_per_microbatch, cost_model: as ``TokenBudgetSampler`` takes them.

    Yields:
        One ``Step`` per optimizer step: this rank's ``microbatches`` (lists of the items themselves; ``[]`` is a
        dummy the rank must still run, with zero loss weight), the step's ``global_tokens`` and
        ``global_loss_tokens`` over every rank (the loss denominator), ``step`` and the tokens and sequences consumed
        before it. Iteration ends on every rank at the same step, when no rank has an item left.

    Raises:
        ValueError: one line naming the first bad argument, item, length or state (a ``StreamError``, also a
            ``TypeError`` where a value has the wrong type).

    Example:
        >>> stream = TokenBudgetStream(({"input_ids": [7] * n} for n in (5, 9, 3, 12, 7, 4)),
        ...                            max_tokens_per_microbatch=16, tokens_per_step=24, world_size=1, rank=0)
        >>> [([[len(item["input_ids"]) for item in mb] for mb in step.microbatches], step.global_loss_tokens)
        ...  for step in stream]
        [([[12], [4, 3]], 16), ([[7, 5], [9]], 18)]
    """

    def __init__(self, source, *, max_tokens_per_microbatch: int, tokens_per_step: Optional[StepSize] = None,
                 sequences_per_step: Optional[StepSize] = None, rampup=None, seed: int = 0, buffer_size: int = 1000,
                 length: Optional[Callable[[Any], int]] = None, loss_tokens: Optional[Callable[[Any], int]] = None,
                 process_group: Any = None, world_size: Optional[int] = None, rank: Optional[int] = None,
                 layout: str = "packed", planner: str = "balanced", max_seqs_per_microbatch: Optional[int] = None,
                 cost_model: Optional[CostModel] = None):
        self._reader = _Reader(source, length, loss_tokens)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise StreamError(f"{WHO}: seed must be an integer, got {seed!r}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, numbers.Integral) or buffer_size < 1:
            raise StreamError(f"{WHO}: buffer_size must be a positive integer, got {buffer_size!r}")
        world_size, rank = resolve_world(world_size, rank, process_group, who=WHO)
        self.unit, ramp, self.sequences_per_step = step_size(sequences_per_step, tokens_per_step, rampup, WHO)
        self.ramp = tuple(ramp)
        settings = checked_settings(world_size=world_size, budget=max_tokens_per_microbatch, layout=layout,
                                    planner=planner, max_seqs=max_seqs_per_microbatch, cost_model=cost_model,
                                    budget_required=True, who=WHO)
        self._settings = settings._replace(refine=False)  # planned every step, as the sampler's
        self.source, self.seed, self.buffer_size = source, int(seed), int(buffer_size)
        self.world_size, self.rank = world_size, rank
        self._exchange = _Exchange(world_size, process_group)
        self._step, self._consumed, self._ended = 0, (0, 0), False  # consumed: (tokens, sequences), all ranks
        self._states: dict[int, dict] = {-1: self._state()}  # the state after each of the last steps, by step
        _as_torch_dataset()

    # ------------------------------------------------------------------ settings, read-only

    max_tokens_per_microbatch = property(lambda self: self._settings.budget)
    layout = property(lambda self: self._settings.layout)
    planner = property(lambda self: self._settings.planner)

    @property
    def step(self) -> int:
        """The steps yielded so far: the index of the next."""
        return self._step

    # ------------------------------------------------------------------ the steps

    def _size(self) -> int:
        """The step size now: the ramp's last threshold the consumed tokens (or sequences) have reached."""
        return size_at(self.ramp, self._consumed[1] if self.unit == "sequences" else self._consumed[0])

    def _next_step(self) -> Optional[Step]:
        if self._ended:
            return None
        size, by_count, reader = self._size(), self.unit == "sequences", self._reader
        error = None
        try:
            reader.fill(size, by_count, self.buffer_size)
        except StreamError as bad:
            if self.world_size == 1:
                raise
            error = str(bad)  # told to every rank at the gather, raised there on each
        drawn, offer = reader.offer([self.seed, self.rank, self._step], size, by_count)
        planned = _planned_step(self._exchange.gather(offer, error), size, by_count, self._settings)
        if planned is None:  # no rank has an item left: every rank ends here
            self._ended = True
            self._states = {self._step - 1: self._state()}
            return None
        ranks, index, lengths, losses, rows = planned
        runs_on = np.empty(len(ranks), dtype=np.int64)
        for r, schedule in enumerate(rows):
            for mb in schedule:
                if mb:
                    runs_on[mb] = r
        # this rank's taken items (by place in the step: buffer position), each sent to the rank that runs it
        taken = dict(zip(np.flatnonzero(ranks == self.rank).tolist(), drawn[index[ranks == self.rank]].tolist()))
        outgoing = [[reader.items[b] for c, b in taken.items() if runs_on[c] == d] if d != self.rank else []
                    for d in range(self.world_size)]
        incoming = self._exchange.move(outgoing)
        held = {c: reader.items[b] for c, b in taken.items() if runs_on[c] == self.rank}
        for src in range(self.world_size):
            if src != self.rank:
                held.update(zip(np.flatnonzero((ranks == src) & (runs_on == self.rank)).tolist(), incoming[src]))
        reader.remove(taken.values())
        tokens, sequences = self._consumed
        step = Step(microbatches=[[held[c] for c in mb] if mb else [] for mb in rows[self.rank]],
                    global_tokens=int(lengths.sum()), global_loss_tokens=int(losses.sum()), step=self._step, epoch=0,
                    consumed_tokens=tokens, consumed_sequences=sequences)
        self._consumed = (tokens + int(lengths.sum()), sequences + len(ranks))
        self._step += 1
        self._states[step.step] = self._state()
        for old in [s for s in self._states if s < step.step - 2]:
            del self._states[old]
        return step

    def __iter__(self) -> Iterator[Step]:
        """The steps from the position on, until every rank's source and buffer are empty (then on every rank)."""
        if _in_loader_worker():
            raise StreamError(f"{WHO}: read in a loader worker, but its steps are planned with collectives over the "
                              "ranks, in the main process: use num_workers=0")
        while True:
            step = self._next_step()
            if step is None:
                return
            yield step

    # ------------------------------------------------------------------ resume

    @functools.cached_property
    def _config(self) -> dict:
        """What the stream was built with (fixed at construction), as its states record it."""
        return {"seed": self.seed, "sequences_per_step": self.sequences_per_step,
                "tokens_per_step": None if self.unit == "sequences" else [list(p) for p in self.ramp],
                "buffer_size": self.buffer_size, "rank": self.rank, **settings_config(self._settings)}

    def _state(self) -> dict:
        return {"version": STATE_VERSION, "step": self._step, "consumed_tokens": self._consumed[0],
                "consumed_sequences": self._consumed[1], "ended": self._ended, **self._reader.state(),
                "config": dict(self._config)}

    def state_dict(self, after: Optional[Step] = None) -> dict:
        """This rank's position after the last step yielded (with ``after``, after that step, one of the last
        three): the source's own ``state_dict`` where it has one, else the count of items read; the items read and
        not yet trained; the steps and tokens consumed. Each rank saves and loads its own."""
        at = self._step - 1 if after is None else after.step
        if at not in self._states:
            raise StreamError(f"{WHO}.state_dict: after= step {at}, but only the state after steps "
                              f"{sorted(self._states)} is kept (save after the step, before the next few)")
        return self._states[at]

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``: this rank's own state, saved by a stream of the same source, seed, step size, buffer
        size, world size and rank (each refused in one line otherwise); the budget, layout, planner and cost model
        may change. Call it before iterating."""
        who = f"{WHO}.load_state_dict"
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise StreamError(f"{who}: not a stream state (version {STATE_VERSION})")
        saved, mine = state.get("config", {}), self._config
        differ = [k for k in STEP_KEYS if saved.get(k) != mine[k]]
        if differ:
            raise StreamError(f"{who}: the state was saved with "
                              + "; ".join(f"{k}={saved.get(k)!r}, this stream has {mine[k]!r}" for k in differ)
                              + " (these decide which items form each step; each rank loads its own state)")
        self._reader.load(state, who)
        self._step, self._ended = int(state["step"]), bool(state["ended"])
        self._consumed = (int(state["consumed_tokens"]), int(state["consumed_sequences"]))
        self._states = {self._step - 1: self._state()}
