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
   attention materialises its scores). T is the largest micro-batch's computed tokens: its real tokens packed, its
   count x longest padded (what the layers run on; a rank's total barely differs between candidates, so it cannot
   tell them apart). Q is its attention term (sum of squared sequence lengths packed, count x longest^2 padded).
   Each remaining candidate's peak is predicted against the limit: the device's memory less
   ``bench.memory_headroom`` (CPU ranks share the host's), or ``bench.memory_limit_gb``.
5. **The rest** are measured smallest first while predicted to fit, the model refitted after each. A candidate
   predicted over the limit by less than the model's own error (the largest error of its predictions checked by a
   measurement so far, or of its extrapolating to the largest T measured from the points below; ``DEFAULT_MARGIN``
   before either can be checked) is measured too; one predicted further over is
   ``over_limit`` and not run, its reason stating the margin. A measured peak over the limit, or an out of memory,
   ends the ascent (every larger one is over the limit). When the search is done, each refusal is checked again
   against the last refit: one it moves within the limit (or within the error) is measured after all.
6. **The choice** is the fastest fwd+bwd candidate that ran ``ok`` with its measured peak under the limit: by its
   speedup over an mbs=1 pass run beside it (``bench.paired``), so the machine's drift during the search does not
   decide, else by its tok/s.

Each candidate records the prediction its decision used (``predicted_peak_bytes``, None for a probe run before
two sizes were measured), the model that made it (``predicted_by``: coefficients and the points it was fitted to),
why it ran or not (``decision``), and the last refit's prediction (``refit_peak_bytes``, by ``memory_model``).
Nothing here imports torch: ``search`` takes the measuring as a function, so the tests can drive it with a fake
device as well as a real backend.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional, Sequence

log = logging.getLogger("harness.auto")  # the log channel's name, kept when the module moved

MIN_POINTS = 2  # peaks needed for the linear model (fixed + per token)
# The margin a refusal by prediction allows before any prediction of the model is checked by a measurement: the
# accuracy the search is held to (every measured candidate's prediction within 15% of its peak). Once some are
# checked, the margin is the largest error seen, and never under MIN_MARGIN (one lucky prediction proves little).
DEFAULT_MARGIN = 0.15
MIN_MARGIN = 0.05

# Why a candidate ran, or did not (Candidate.decision)
PROBE = "probe"  # measured to fit the model (the smallest, then near the middle of T, then halfway below a failure)
FITS = "predicted_fit"  # predicted under the limit
WITHIN_ERROR = "within_error"  # predicted over the limit by less than the model's error: measured to know
NO_MODEL = "no_model"  # measured: no model to predict with yet (fewer than two sizes measured)
OVER = "predicted_over"  # not run: predicted over the limit by more than the model's error
ABOVE_FAILURE = "above_failure"  # not run: larger than a candidate that ran out of memory or peaked over the limit
REVISITED = "revisited"  # refused on an earlier model, measured after the last refit put it within reach


@dataclass
class Candidate:
    """One distinct plan of the workload, and what the search learnt of it."""

    mtpm: int
    tokens: int  # T: the largest micro-batch's computed tokens (real packed; count x longest padded)
    square: int  # Q: the largest micro-batch attention term (sum of squared lengths; count x longest^2 padded)
    steps: int
    same_plan: list[int] = field(default_factory=list)  # larger budgets that plan exactly as this one
    predicted_peak_bytes: Optional[int] = None  # the prediction its decision used (None: none was made)
    prediction: Optional[str] = None  # "ahead": made before it ran, or instead of running it
    predicted_by: Optional[dict] = None  # the model that made predicted_peak_bytes (MemoryModel.as_dict)
    decision: Optional[str] = None  # why it ran or not: PROBE, FITS, WITHIN_ERROR, NO_MODEL, OVER, ...
    margin: Optional[dict] = None  # a decision against the limit: the model's error allowed, and where it comes from
    refit_peak_bytes: Optional[int] = None  # the search's last model's prediction (SearchResult.memory_model)
    revisited: Optional[dict] = None  # a refusal the last refit moved: the first decision's prediction and model
    measured_peak_bytes: Optional[int] = None
    tok_per_s: Optional[float] = None
    status: str = "pending"  # ok, oom, over_limit, error, pending (not reached)
    reason: Optional[str] = None
    # fwd+bwd tok/s over an mbs=1 pass run beside it (bench.paired): what the search ranks by, drift cancelled
    speedup: Optional[float] = None
    # an out of memory in a process that lives on: what a limit counts of it before the candidate ran and after its
    # memory was handed back (``measure``, ``before_bytes``, ``after_bytes``, ``back``); None elsewhere
    after_oom: Optional[dict] = None

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
    after_oom: Optional[dict] = None  # an out of memory: the footprint before it and after (harness/auto/run.py)


@dataclass
class MemoryModel:
    """peak = fixed + per_token x T + per_square x Q, fitted by least squares to measured peaks (no negative slopes)."""

    fixed: float
    per_token: float
    per_square: float = 0.0
    points: int = 0
    quadratic: bool = False
    fitted_to: list = field(default_factory=list)  # the (T, Q, peak) points it was fitted to
    quadratic_asked: bool = False  # the fit was asked for the Q term (used only with three sizes or more)

    def predict(self, tokens: int, square: int) -> int:
        return int(round(self.fixed + self.per_token * tokens + self.per_square * square))

    def as_dict(self) -> dict:
        """results.json's record of the model: its form, coefficients, and the points (T, Q, peak) it was fitted
        to (``fit_memory_model`` of those points gives it again)."""
        return {"form": "fixed + per_token*T" + (" + per_square*Q" if self.quadratic else ""),
                "fixed_bytes": self.fixed, "per_token_bytes": self.per_token, "per_square_bytes": self.per_square,
                "points": self.points, "fitted_to": [list(p) for p in self.fitted_to],
                "quadratic_asked": self.quadratic_asked}

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryModel":
        """The model a record holds (as_dict's inverse): what recomputes a recorded prediction."""
        return cls(d["fixed_bytes"], d["per_token_bytes"], d["per_square_bytes"], d["points"],
                   d["form"].endswith("per_square*Q"), [tuple(p) for p in d.get("fitted_to") or []],
                   bool(d.get("quadratic_asked")))


def fit_memory_model(points: Sequence[tuple[int, int, int]], quadratic: bool = False) -> Optional[MemoryModel]:
    """The model of ``points`` ((T, Q, peak) each); None without two distinct T (a slope needs two sizes).

    The quadratic term is fitted only when asked and there are three distinct T or more; a negative slope (noise
    on near-equal sizes) is clamped to zero and the rest refitted, so a larger micro-batch never predicts less.
    """
    import numpy as np

    points = [tuple(int(v) for v in p) for p in points]
    if len({t for t, _, _ in points}) < MIN_POINTS:
        return None
    use_q = quadratic and len({t for t, _, _ in points}) >= 3
    t = np.array([p[0] for p in points], dtype=float)
    q = np.array([p[1] for p in points], dtype=float)
    y = np.array([p[2] for p in points], dtype=float)
    cols = [np.ones_like(t), t] + ([q] if use_q else [])
    coef = np.linalg.lstsq(np.stack(cols, axis=1), y, rcond=None)[0]
    if use_q and coef[2] < 0:  # no quadratic growth seen: the linear model
        return replace(fit_memory_model(points, quadratic=False), quadratic_asked=True)
    if coef[1] < 0:
        return MemoryModel(float(y.max()), 0.0, 0.0, len(points), False, points, quadratic)
    return MemoryModel(float(coef[0]), float(coef[1]), float(coef[2]) if use_q else 0.0, len(points), use_q, points,
                       quadratic)


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
    from harness.peers.common import PeerRefusal

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
    return _Search(cands, measure, limit_bytes, quadratic, baseline_point, on_candidate).run()


class _Search:
    """The search's state: the measured points, the model they fit, and the index from which every candidate is over
    the limit (one below ran out of memory or peaked over it)."""

    def __init__(self, cands, measure, limit_bytes, quadratic, baseline_point, on_candidate):
        self.cands, self.measure, self.limit, self.quadratic = cands, measure, limit_bytes, quadratic
        self.on_candidate = on_candidate
        self.points: list[tuple[int, int, int]] = [baseline_point] if baseline_point else []
        self.model: Optional[MemoryModel] = fit_memory_model(self.points, quadratic)
        self.ceiling = len(cands)

    def run(self) -> SearchResult:
        cands = self.cands
        # Probes: the smallest, then near the middle; one that fails (out of memory, or a peak over the limit) is
        # followed by one halfway below it.
        order = _probe_order(cands)
        if order and self._run(order[0], PROBE) and len(order) > 1:
            lo, hi = 0, order[1]
            while hi > lo and not self._run(hi, PROBE):
                hi = lo + (hi - lo) // 2
        # The rest, smallest first, while the model says they fit (or cannot tell within its error).
        for i, c in enumerate(cands):
            if c.status == "pending":
                self._decide(i)
        # Refusals made on an earlier model, checked against the last refit (each measurement refits: again).
        while True:
            moved = next((i for i, c in enumerate(cands) if c.decision == OVER and i < self.ceiling
                          and self.model is not None
                          and self._reachable(self.model.predict(c.tokens, c.square))[0]), None)
            if moved is None:
                break
            c = cands[moved]
            c.revisited = {"predicted_peak_bytes": c.predicted_peak_bytes, "predicted_by": c.predicted_by,
                           "margin": c.margin}
            c.status, c.reason = "pending", None
            self._predict(c)
            margin, source = self.error()
            c.margin = {"fraction": round(margin, 4), "from": source}
            self._run(moved, REVISITED)
        for c in cands:
            if self.model is not None:
                c.refit_peak_bytes = self.model.predict(c.tokens, c.square)
        return SearchResult(cands, self.model, self.limit, _choose(cands))

    # -- one candidate ---------------------------------------------------------------------------------------
    def _note(self, c: Candidate) -> None:
        if self.on_candidate is not None:
            self.on_candidate(c)

    def _predict(self, c: Candidate) -> None:
        """The current model's prediction, recorded with the model that made it (none yet: no prediction)."""
        if self.model is None:
            c.predicted_peak_bytes = c.prediction = c.predicted_by = None
            return
        c.predicted_peak_bytes = self.model.predict(c.tokens, c.square)
        c.prediction = "ahead"
        c.predicted_by = self.model.as_dict()

    def error(self) -> tuple[float, str]:
        """The model's own error, and where it comes from: the largest of (a) |predicted - measured| / measured of
        its predictions made before a candidate ran, and (b) its error extrapolating: the largest measured T as
        predicted by the model of the points below it (a refusal is an extrapolation, and memory that grows less
        than linearly is over-predicted there far more than between points). At least ``MIN_MARGIN``;
        ``DEFAULT_MARGIN`` while neither can be checked."""
        parts = []
        checked = [abs(c.predicted_peak_bytes - c.measured_peak_bytes) / c.measured_peak_bytes for c in self.cands
                   if c.prediction == "ahead" and c.predicted_peak_bytes and c.measured_peak_bytes]
        if checked:
            worst = max(checked)
            words = f"{worst:.1%}, the largest error of its {len(checked)} prediction(s) checked by a measurement"
            parts.append((worst, words))
        outward = self._extrapolation_error()
        if outward is not None:
            parts.append(outward)
        if not parts:
            return DEFAULT_MARGIN, f"no prediction checked by a measurement yet: {DEFAULT_MARGIN:.0%} assumed"
        worst, source = max(parts)
        return max(MIN_MARGIN, worst), source + (f" (at least {MIN_MARGIN:.0%})" if worst < MIN_MARGIN else "")

    def _extrapolation_error(self) -> Optional[tuple[float, str]]:
        """The largest measured T's peak as the model of the smaller points predicts it: the error, and in words."""
        if not self.points:
            return None
        top = max(t for t, _, _ in self.points)
        model = fit_memory_model([p for p in self.points if p[0] < top], self.quadratic)
        if model is None:
            return None
        worst = max(abs(model.predict(t, q) - peak) / peak for t, q, peak in self.points if t == top)
        return worst, f"{worst:.1%}, its error extrapolating to T={top:,} from the points below it"

    def _reachable(self, predicted: int) -> tuple[bool, float, str]:
        """Whether a candidate predicted at ``predicted`` may fit: under the limit, or over it by less than the
        model's error (an over-prediction by that much would put it under)."""
        margin, source = self.error()
        return predicted / (1 + margin) <= self.limit, margin, source

    def _decide(self, i: int) -> None:
        c = self.cands[i]
        if i >= self.ceiling:
            failed = self.cands[self.ceiling]
            c.status, c.decision = "over_limit", ABOVE_FAILURE
            c.reason = (f"larger than mtpm={failed.mtpm}, which "
                        + ("ran out of memory" if failed.status == "oom" else "peaked over the limit"))
            self._note(c)
            return
        self._predict(c)
        if self.model is None:
            self._run(i, NO_MODEL)
            return
        if c.predicted_peak_bytes <= self.limit:
            self._run(i, FITS)
            return
        reachable, margin, source = self._reachable(c.predicted_peak_bytes)
        c.margin = {"fraction": round(margin, 4), "from": source}
        if reachable:
            self._run(i, WITHIN_ERROR)
            return
        over = c.predicted_peak_bytes / self.limit - 1
        c.status, c.decision = "over_limit", OVER
        c.reason = (f"not run: predicted peak {_gib(c.predicted_peak_bytes)}, {over:.0%} over the limit "
                    f"{_gib(self.limit)}, beyond the model's error ({margin:.0%}: {source})")
        self._note(c)

    def _run(self, i: int, decision: str) -> bool:
        """Measure candidate i; False when it failed (out of memory, or a peak over the limit): everything from it
        up is then over the limit."""
        c = self.cands[i]
        if decision == PROBE:
            self._predict(c)
        c.decision = decision
        got = self.measure(c)
        c.measured_peak_bytes = got.peak_bytes
        c.tok_per_s = got.tok_per_s
        c.speedup = got.speedup
        if got.status == "oom":
            c.status, c.reason, c.after_oom = "oom", got.error, got.after_oom
            self.ceiling = min(self.ceiling, i)
            self._note(c)
            return False
        if got.status != "ok":
            c.status, c.reason = "error", got.error
            self._note(c)
            return True
        over = got.peak_bytes is not None and got.peak_bytes > self.limit
        if over:
            c.status, c.reason = "over_limit", f"measured peak {_gib(got.peak_bytes)} over the limit {_gib(self.limit)}"
            self.ceiling = min(self.ceiling, i)
        else:
            c.status = "ok"
        if got.peak_bytes is not None:
            self.points.append((c.tokens, c.square, got.peak_bytes))
            self.model = fit_memory_model(self.points, self.quadratic)
        self._note(c)
        return not over


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
