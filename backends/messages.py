"""The messages between the harness and a backend: examples in, a pass command, a pass result out (no torch).

``make_command`` is the one place a ``PassCommand`` is built; everything that
changes one for a rank, a live budget or a timed repeat copies it whole with
``PassCommand.replace``. A ``PassResult`` travels whole too: ranks gather
one, the server sends ``as_dict()`` and the client reads it back with
``PassResult.from_dict``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

import harness.peers  # noqa: F401  (registers the peers' planners, which a command may name)
from backends.runtime.profiling import PROFILE_RANKS, PROFILE_STEPS
from balance_batch import LAYOUTS, CostModel, Plan, plan_step
from balance_batch.errors import check_choice
from balance_batch.greedy import Schedule, lockstep_schedules
from balance_batch.planners import get_planner
from balance_batch.stats import plan_stats

PASS_TYPES = ("forward", "forward_backward")
# PassCommand.logprob_chunk_tokens: use the backend's ``logprob_chunk_tokens`` (None there means full logits).
BACKEND_CHUNK = "backend"


@dataclass
class Example:
    """One training sequence. All three arrays have the same length."""

    input_ids: np.ndarray  # int64 token ids
    target_tokens: np.ndarray  # int64 next-token targets
    weights: np.ndarray  # float32 per-token loss weights

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class ExampleOutput:
    """What a pass returns per example: per-token log-probabilities of the targets and the weighted loss sum."""

    logprobs: np.ndarray  # float32, one per token
    loss: float  # -sum(weights * logprobs)


@dataclass(frozen=True)
class PassCommand:
    """One pass, as a backend (and each of its ranks) executes it."""

    pass_type: str  # forward or forward_backward
    # All the examples (a list), or a rank's share keyed by index (with ``lengths``); None in a launched
    # job's pass message, whose examples travel once per point.
    examples: Union[list, dict, None]
    max_tokens_per_microbatch: Optional[int]
    micro_batch_size: int
    layout: str = "padded"
    planner: str = "greedy"
    cost_model: Optional[dict] = None  # CostModel.as_dict(); every rank plans the same global plan from it
    max_seqs_per_microbatch: Optional[int] = None  # at most this many sequences per micro-batch (None: no cap)
    lengths: Optional[list] = None  # every example's length, where ``examples`` is only a rank's share
    # Target log-probs this many tokens at a time; None: full logits; BACKEND_CHUNK: the backend's setting.
    logprob_chunk_tokens: Union[int, None, str] = BACKEND_CHUNK
    timeout_s: Optional[float] = None  # the pass is stopped past this (bench.pass_timeout_s)
    progress_every_s: float = 10.0  # rank 0 logs its progress this often
    release_memory: bool = True  # hand cached memory back before the pass (a pass type's first run)
    # Run the pass under torch.profiler, each rank writing <profile_dir>/<pass>-rank<r>.json.gz (bench.profile)
    profile_dir: Optional[str] = None
    # What a profiled pass records (backends/runtime/profiling.py): this many micro-batches after the first (0: the
    # whole pass), on these ranks (None: every rank), with the allocator's events or not
    profile_steps: int = PROFILE_STEPS
    profile_ranks: Optional[tuple] = PROFILE_RANKS
    profile_memory: bool = False
    # Record the CUDA allocator's history in this pass; out of memory dumps <dir>/<pass>-rank<r>.pickle
    # (bench.memory_snapshot, on warm-up runs; backends/runtime/memory.py MemoryHistory)
    memory_snapshot_dir: Optional[str] = None
    # A plan given whole, per rank and step (example indices, or None for a dummy): the planner is not run and the
    # budget is not used (harness/calibration.py's calibration passes).
    schedules: Optional[list] = None

    def replace(self, **changes) -> "PassCommand":
        return dataclasses.replace(self, **changes)

    def all_lengths(self) -> list[int]:
        """Every example's length: ``lengths`` with a rank's share, else read off the examples."""
        if self.lengths is not None:
            return list(self.lengths)
        return [len(e) for e in self.examples]

    def chunk_tokens(self, backend_default: Optional[int]) -> Optional[int]:
        return backend_default if self.logprob_chunk_tokens == BACKEND_CHUNK else self.logprob_chunk_tokens

    def plan(self, world_size: int, lockstep: bool) -> Plan:
        """The global plan, by the library's ``plan_step``: every rank (and the controller) computes the same one from
        the same inputs."""
        if self.schedules is not None:
            if len(self.schedules) != world_size:
                raise ValueError(f"a given plan has {len(self.schedules)} ranks' schedules for {world_size} ranks")
            return given_plan(self.schedules, self.all_lengths(), lockstep=lockstep, layout=self.layout,
                              cost_model=CostModel.from_dict(self.cost_model))
        return plan_step(
            self.all_lengths(),
            world_size=world_size,
            max_tokens_per_microbatch=self.max_tokens_per_microbatch,
            micro_batch_size=self.micro_batch_size,
            lockstep=lockstep,
            layout=self.layout,
            planner=self.planner,
            cost_model=CostModel.from_dict(self.cost_model),
            max_seqs_per_microbatch=self.max_seqs_per_microbatch,
        )


def _finite_or_none(value: Optional[float]) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else float(value)


def _json_floats(values) -> list:
    """A float array as a JSON list; NaN/inf (a model that overflowed) as null, which JSON can carry."""
    arr = np.asarray(values)
    if np.isfinite(arr).all():
        return arr.tolist()
    return [v if math.isfinite(v) else None for v in arr.tolist()]


def make_command(
    pass_type: str,
    examples: Sequence[Example],
    max_tokens_per_microbatch: Optional[int],
    micro_batch_size: int,
    layout: str = "padded",
    planner: str = "greedy",
    cost_model: Optional[dict] = None,
    **options,
) -> PassCommand:
    """The command for one pass; ``options`` are PassCommand's other fields (logprob_chunk_tokens, timeout_s, ...)."""
    if pass_type not in PASS_TYPES:
        raise ValueError(f"pass type must be one of {PASS_TYPES}, got {pass_type!r}")
    check_choice("layout", layout, LAYOUTS)
    get_planner(planner)  # one ValueError naming the valid ones
    return PassCommand(pass_type, list(examples), max_tokens_per_microbatch, micro_batch_size,
                       layout=layout, planner=planner, cost_model=cost_model, **options)


@dataclass
class PassResult:
    """One pass: outputs in request order, the plan that ran, and what it cost."""

    outputs: list[ExampleOutput]
    plan: dict
    grad_norm: Optional[float] = None
    mem_peak_bytes: Optional[int] = None  # the largest of mem_peak_bytes_per_rank
    # Each rank's memory peak during the pass: CUDA memory reserved on GPU, resident set (VmHWM) on CPU.
    mem_peak_bytes_per_rank: Optional[list[Optional[int]]] = None
    # Each rank's CUDA allocator peaks (tensors; tensors plus the allocator's cache); None on CPU.
    mem_peak_allocated_bytes_per_rank: Optional[list[Optional[int]]] = None
    mem_peak_reserved_bytes_per_rank: Optional[list[Optional[int]]] = None
    # The timed region (first step to the last one's end, device synchronized; the slowest rank's);
    # None where the backend does not time it, and the caller's wall time stands.
    step_s: Optional[float] = None
    # What ran: {op: {implementation: calls}} summed over ranks (the library's kernels.py); None where unknown.
    kernels: Optional[dict] = None
    # A profiled pass (PassCommand.profile_dir): per rank, {"trace": path, "breakdown": ...}
    # (backends/runtime/profiling.py)
    profile: Optional[list] = None
    # backend.compile: what compiling cost inside this pass, over ranks (backends/model/compiling.py ``merge``:
    # compilations, recompilations, seconds, graph breaks, what dynamo traced); None when nothing is compiled.
    compile: Optional[dict] = None
    # Each rank's timed region step by step (backends/runtime/timeline.py): {"step_clock", "busy_clock", "per_rank":
    # [{"start_s", "step_s": [...], "busy_s": [...], "wait_s": [...] (lock-step only), "sync_s", "elapsed_s"}]},
    # steps as the rank ran them (a lock-step rank's dummies included); None where the backend does not time its steps.
    timeline: Optional[dict] = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: outputs as lists (non-finite losses as None), every other field as it is."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "outputs"}
        out["grad_norm"] = _finite_or_none(self.grad_norm)
        out["outputs"] = [{"logprobs": _json_floats(o.logprobs), "loss": _finite_or_none(o.loss)} for o in self.outputs]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PassResult":
        """The inverse of ``as_dict`` (None reads back as NaN); fields the sender did not know stay at defaults."""
        outputs = [
            ExampleOutput(logprobs=np.asarray(o["logprobs"], dtype=np.float32),  # numpy reads None as NaN
                          loss=float("nan") if o["loss"] is None else float(o["loss"]))
            for o in data["outputs"]
        ]
        known = {f.name for f in dataclasses.fields(cls)} - {"outputs"}
        return cls(outputs=outputs, **{k: v for k, v in data.items() if k in known})


def given_plan(
    schedules: Sequence[Schedule],
    lengths: Sequence[int],
    lockstep: bool = False,
    layout: str = "padded",
    cost_model: Optional[CostModel] = None,
) -> Plan:
    """A plan given whole, per rank and step (harness/calibration.py's shapes): no planner runs, only the statistics.

    With ``lockstep`` (lock-step ranks) shorter schedules are padded with ``None``; without it ``None`` entries are
    dropped, as ``plan_step`` does for ranks that run independently (``lockstep=False``).
    """
    check_choice("layout", layout, LAYOUTS)
    lengths = [int(n) for n in lengths]
    cost_model = cost_model or CostModel.tokens()
    for r, schedule in enumerate(schedules):
        for batch in schedule:
            if batch is not None and (not batch or any(not 0 <= i < len(lengths) for i in batch)):
                raise ValueError(f"a given plan's rank {r} has a micro-batch that is empty or indexes past the "
                                 f"{len(lengths)} examples: {batch!r}")
    rows = [[None if b is None else list(b) for b in s] for s in schedules]
    rows = lockstep_schedules(rows) if lockstep else [[b for b in s if b is not None] for s in rows]
    stats = plan_stats(rows, lengths, layout=layout, cost_model=cost_model, lockstep=lockstep, planner="given")
    return Plan(schedules=rows, stats=stats, layout=layout, planner="given", cost_model=cost_model, lengths=lengths,
                lockstep=lockstep)
