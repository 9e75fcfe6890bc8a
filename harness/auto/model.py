"""mtpm=auto: the fastest token budget that fits in memory, searched on one loaded backend.

The search, in order:

1. **Candidates** are the workload's plans at budgets 2^k, from about half the longest sequence to the budget
   that puts every rank's share in one micro-batch. Budgets that plan identically are one candidate (the
   smallest budget names it; ``same_plan`` lists the others).
2. **The baseline** (fixed micro-batches of one sequence) is measured first: the speedup's reference, and a
   memory point (its largest micro-batch is the longest sequence).
3. **Probes**: the smallest candidate, then the one near the geometric middle of the largest micro-batch sizes;
   one that runs out of memory is recorded and the next probe is taken halfway below it.
4. **A memory model** is fitted to every measured peak: peak = fixed + per_token x T (+ per_square x Q where
   attention materialises its scores), T the largest micro-batch's tokens (padded tokens for padded rows), Q its
   attention term (sum of squared sequence lengths packed, count x longest^2 padded). Each remaining candidate's
   peak is predicted against the limit: the device's memory less ``bench.memory_headroom`` (CPU ranks share the
   host's), or ``bench.memory_limit_gb``.
5. **The rest** are measured smallest first while predicted to fit, the model refitted after each; a candidate
   predicted over the limit is ``over_limit`` and not run, and one that runs out of memory stops the ascent
   (every larger one is over the limit).
6. **The choice** is the fastest fwd+bwd candidate that ran ``ok`` with its measured peak under the limit: by its
   speedup over an mbs=1 pass run beside it (``bench.paired``), so the machine's drift during the search does not
   decide, else by its tok/s.

Every candidate's peak is predicted: "ahead" when the model predicted it before it ran, "held_out" (a probe) from
the model fitted to every other measured point. Nothing here imports torch: ``search`` takes the measuring as a
function, so the tests can drive it with a fake device as well as a real backend.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

log = logging.getLogger("harness.auto")  # the log channel's name, kept when the module moved

MIN_POINTS = 2  # peaks needed for the linear model (fixed + per token)


@dataclass
class Candidate:
    """One distinct plan of the workload, and what the search learnt of it."""

    mtpm: int
    tokens: int  # T: the largest micro-batch's tokens (padded tokens for padded rows)
    square: int  # Q: the largest micro-batch attention term (sum of squared lengths; count x longest^2 padded)
    steps: int
    same_plan: list[int] = field(default_factory=list)  # larger budgets that plan exactly as this one
    predicted_peak_bytes: Optional[int] = None
    prediction: Optional[str] = None  # "ahead" (predicted before it ran, or instead of running), "held_out"
    measured_peak_bytes: Optional[int] = None
    tok_per_s: Optional[float] = None
    status: str = "pending"  # ok, oom, over_limit, error, pending (not reached)
    reason: Optional[str] = None
    # fwd+bwd tok/s over an mbs=1 pass run beside it (bench.paired): what the search ranks by, drift cancelled
    speedup: Optional[float] = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Measured:
    """What measuring one candidate gave: ``status`` ok / oom / error, its fwd+bwd tok/s and peak (per rank max)."""

    status: str
    tok_per_s: Optional[float] = None
    peak_bytes: Optional[int] = None
    error: Optional[str] = None
    speedup: Optional[float] = None  # the pair ratio over an mbs=1 pass beside it (None: not paired)


@dataclass
class MemoryModel:
    """peak = fixed + per_token x T + per_square x Q, fitted by least squares to measured peaks (no negative slopes)."""

    fixed: float
    per_token: float
    per_square: float = 0.0
    points: int = 0
    quadratic: bool = False

    def predict(self, tokens: int, square: int) -> int:
        return int(round(self.fixed + self.per_token * tokens + self.per_square * square))

    def as_dict(self) -> dict:
        return {"form": "fixed + per_token*T" + (" + per_square*Q" if self.quadratic else ""),
                "fixed_bytes": self.fixed, "per_token_bytes": self.per_token, "per_square_bytes": self.per_square,
                "points": self.points}


def fit_memory_model(points: Sequence[tuple[int, int, int]], quadratic: bool = False) -> Optional[MemoryModel]:
    """The model of ``points`` ((T, Q, peak) each); None without two distinct T (a slope needs two sizes).

    The quadratic term is fitted only when asked and there are three distinct T or more; a negative slope (noise
    on near-equal sizes) is clamped to zero and the rest refitted, so a larger micro-batch never predicts less.
    """
    import numpy as np

    if len({t for t, _, _ in points}) < MIN_POINTS:
        return None
    use_q = quadratic and len({t for t, _, _ in points}) >= 3
    t = np.array([p[0] for p in points], dtype=float)
    q = np.array([p[1] for p in points], dtype=float)
    y = np.array([p[2] for p in points], dtype=float)
    cols = [np.ones_like(t), t] + ([q] if use_q else [])
    coef = np.linalg.lstsq(np.stack(cols, axis=1), y, rcond=None)[0]
    if use_q and coef[2] < 0:  # no quadratic growth seen: the linear model
        return fit_memory_model(points, quadratic=False)
    if coef[1] < 0:
        return MemoryModel(float(y.max()), 0.0, 0.0, len(points), False)
    return MemoryModel(float(coef[0]), float(coef[1]), float(coef[2]) if use_q else 0.0, len(points), use_q)


def power_of_two_budgets(lengths: Sequence[int], world_size: int, layout: str) -> list[int]:
    """Budgets 2^k from the one at or above half the longest sequence up to the one that holds a rank's whole share
    in one micro-batch (padded: its sequences x the longest; packed: its tokens plus the longest), at most 24."""
    longest = max(lengths)
    per_rank = math.ceil(len(lengths) / world_size)
    if layout == "padded":
        whole = per_rank * longest
    else:
        whole = math.ceil(sum(lengths) / world_size) + longest
    lo = 1 << max(0, math.ceil(math.log2(max(1, longest // 2))))
    hi = 1 << math.ceil(math.log2(max(lo, whole)))
    budgets = []
    b = lo
    while b <= hi and len(budgets) < 24:
        budgets.append(b)
        b *= 2
    return budgets


def attention_term(lengths: Sequence[int], microbatch: Sequence[int], layout: str) -> int:
    """Q of one micro-batch: what attention scores grow with (sum of squares packed, count x longest^2 padded)."""
    if not microbatch:
        return 0
    ls = [lengths[i] for i in microbatch]
    return sum(n * n for n in ls) if layout == "packed" else len(ls) * max(ls) ** 2


def candidates_of(lengths: Sequence[int], budgets: Sequence[int], plan_at: Callable[[int], object],
                  layout: str, on_planned: Optional[Callable[[int, int, int], None]] = None,
                  refused: Optional[list] = None) -> list[Candidate]:
    """One candidate per distinct plan over ``budgets`` (ascending); ``plan_at(b)`` plans the workload at budget b.

    ``on_planned(done, total, budget)`` is called after each budget is planned (progress: PlanningProgress). A budget
    a peer planner refuses (its own refusal: a sequence over its budget) is no candidate: with ``refused`` (a list)
    it is appended there as ``{"mtpm", "reason"}`` and the search goes on; without, the refusal is raised."""
    from balance_batch.peers.common import PeerRefusal

    out: list[Candidate] = []
    previous = None
    ordered = sorted(set(budgets))
    for done, b in enumerate(ordered, 1):
        try:
            plan = plan_at(b)
        except PeerRefusal as exc:
            if refused is None:
                raise
            refused.append({"mtpm": b, "reason": str(exc)})
            continue
        if on_planned is not None:
            on_planned(done, len(ordered), b)
        schedules = plan.schedules
        if previous is not None and schedules == previous:
            out[-1].same_plan.append(b)
            continue
        previous = schedules
        mbs = [mb for sched in schedules for mb in sched if mb]
        out.append(
            Candidate(
                mtpm=b,
                tokens=int(plan.stats.max_microbatch_padded_tokens),
                square=max(attention_term(lengths, mb, layout) for mb in mbs),
                steps=int(plan.stats.steps),
            )
        )
    return out


class PlanningProgress:
    """Planning the candidates, on the console: a line as it starts, then one every ``every_s`` while it lasts
    (a million sequences take about 3 s a budget: 20 budgets were a minute of silence)."""

    def __init__(self, label: str, budgets: Sequence[int], n_sequences: int, every_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.label, self.every_s, self.clock = label, every_s, clock
        self.start = self.last = clock()
        log.info("%smtpm=auto: planning %d budgets (mtpm=%s to %s) for %s sequences", label, len(budgets),
                 f"{min(budgets):,}", f"{max(budgets):,}", f"{n_sequences:,}")

    def __call__(self, done: int, total: int, budget: int) -> None:
        now = self.clock()
        if now - self.last >= self.every_s and done < total:
            self.last = now
            log.info("%smtpm=auto: planned %d/%d budgets (up to mtpm=%s) in %.0f s", self.label, done, total,
                     f"{budget:,}", now - self.start)


@dataclass
class SearchResult:
    candidates: list[Candidate]
    memory_model: Optional[MemoryModel]
    limit_bytes: int
    chosen: Optional[Candidate]
    baseline: Optional[dict] = None

    def as_dict(self, headroom: Optional[float], limit_source: str) -> dict:
        return {
            "candidates": [c.as_dict() for c in self.candidates],
            "memory_model": None if self.memory_model is None else self.memory_model.as_dict(),
            "headroom": headroom,
            "limit_bytes": self.limit_bytes,
            "limit_source": limit_source,
            "baseline": self.baseline,
            "chosen": None if self.chosen is None else self.chosen.mtpm,
        }


def _probe_order(cands: Sequence[Candidate]) -> list[int]:
    """Indices of the first two probes: the smallest, and the one nearest the geometric middle of T."""
    if not cands:
        return []
    if len(cands) == 1:
        return [0]
    mid_t = math.sqrt(cands[0].tokens * cands[-1].tokens)
    mid = min(range(1, len(cands)), key=lambda i: (abs(math.log(max(cands[i].tokens, 1) / mid_t)), i))
    return [0, mid]


def search(
    cands: list[Candidate],
    measure: Callable[[Candidate], Measured],
    limit_bytes: int,
    quadratic: bool = False,
    baseline_point: Optional[tuple[int, int, int]] = None,
    on_candidate: Optional[Callable[[Candidate], None]] = None,
) -> SearchResult:
    """Run the search over ``cands`` (ascending T); ``measure`` runs one (fwd+bwd) and returns what it gave.

    ``baseline_point`` is the mbs=1 run's (T, Q, peak): one more point for the memory model.
    ``on_candidate`` is called after each candidate changes (to save progress).
    """
    points: list[tuple[int, int, int]] = [baseline_point] if baseline_point else []
    model: Optional[MemoryModel] = None
    ceiling = len(cands)  # candidates at or above this index are over the limit (one ran out of memory below)

    def note(c: Candidate) -> None:
        if on_candidate is not None:
            on_candidate(c)

    def run(i: int) -> bool:
        """Measure candidate i; False when it ran out of memory (everything from it up is then over the limit)."""
        nonlocal model, ceiling
        c = cands[i]
        got = measure(c)
        c.measured_peak_bytes = got.peak_bytes
        c.tok_per_s = got.tok_per_s
        c.speedup = got.speedup
        if got.status == "oom":
            c.status, c.reason = "oom", got.error
            ceiling = min(ceiling, i)
            note(c)
            return False
        if got.status != "ok":
            c.status, c.reason = "error", got.error
            note(c)
            return True
        if got.peak_bytes is not None and got.peak_bytes > limit_bytes:
            c.status, c.reason = (
                "over_limit",
                f"measured peak {_gib(got.peak_bytes)} over the limit {_gib(limit_bytes)}",
            )
        else:
            c.status = "ok"
        if got.peak_bytes is not None:
            points.append((c.tokens, c.square, got.peak_bytes))
            model = fit_memory_model(points, quadratic)
        note(c)
        return True

    # Probes: the smallest, then near the middle; an out-of-memory probe is followed by one halfway below it.
    order = _probe_order(cands)
    if order:
        if run(order[0]) and len(order) > 1:
            lo, hi = 0, order[1]
            while hi > lo:
                if model is not None and cands[hi].status == "pending":
                    _predict(cands[hi], model, "ahead")
                if run(hi):
                    break
                hi = lo + (hi - lo) // 2
    # The rest, smallest first, while the model says they fit.
    for i, c in enumerate(cands):
        if c.status != "pending":
            continue
        if i >= ceiling:
            c.status, c.reason = "over_limit", f"larger than mtpm={cands[ceiling].mtpm}, which ran out of memory"
            note(c)
            continue
        if model is not None:
            _predict(c, model, "ahead")
            if c.predicted_peak_bytes > limit_bytes:
                c.status = "over_limit"
                c.reason = f"predicted peak {_gib(c.predicted_peak_bytes)} over the limit {_gib(limit_bytes)}"
                note(c)
                continue
        run(i)
    _held_out_predictions(cands, points, quadratic, baseline_point)
    return SearchResult(cands, model, limit_bytes, _choose(cands))


def _choose(cands: Sequence[Candidate]) -> Optional[Candidate]:
    """The fastest candidate that ran ``ok`` under the limit, or None."""
    fitting = [c for c in cands if c.status == "ok" and c.tok_per_s is not None]
    # Paired candidates are ranked by their speedup over the mbs=1 pass run beside each: a machine that slows
    # during the search would otherwise favour the candidates it measured first.
    paired = bool(fitting) and all(c.speedup is not None for c in fitting)
    chosen = max(fitting, key=lambda c: c.speedup if paired else c.tok_per_s) if fitting else None
    return chosen


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _predict(c: Candidate, model: MemoryModel, how: str) -> None:
    c.predicted_peak_bytes = model.predict(c.tokens, c.square)
    c.prediction = how


def _held_out_predictions(cands, points, quadratic, baseline_point) -> None:
    """A measured candidate the model had not predicted ahead (a probe) gets the prediction of the model fitted
    to every other measured point, when those still fit one."""
    for c in cands:
        if c.prediction is not None or c.measured_peak_bytes is None or c.status == "oom":
            continue
        others = list(points)
        mine = (c.tokens, c.square, c.measured_peak_bytes)
        if mine in others:
            others.remove(mine)
        model = fit_memory_model(others, quadratic)
        if model is not None:
            _predict(c, model, "held_out")


def memory_limit(limit_gb: Optional[float], device: dict, world_size: int, headroom: float) -> tuple[int, str]:
    """The bytes one rank may peak at, and where the figure comes from.

    ``bench.memory_limit_gb`` as given; else the device's memory less the headroom: one GPU's, or on CPU the host's
    shared by the ranks on it (LOCAL_WORLD_SIZE under torchrun, else every rank).
    """
    import os

    if limit_gb is not None:
        return int(limit_gb * 1024**3), "bench.memory_limit_gb"
    total = int(device.get("memory_bytes") or 0)
    if device.get("type") == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size or 1)
        return int(total * (1 - headroom) / max(1, local)), f"host memory / {local} rank(s), less {headroom:.0%}"
    return int(total * (1 - headroom)), f"device memory less {headroom:.0%}"


__all__ = ["Candidate", "Measured", "MemoryModel", "PlanningProgress", "SearchResult", "candidates_of",
           "fit_memory_model", "memory_limit", "power_of_two_budgets", "search"]
