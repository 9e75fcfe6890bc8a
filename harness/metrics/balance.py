"""Balance measured, not only modeled: a pass's per-rank step times (its timeline) read against the plan that ran.

The ranks time every step of every timed repeat (backends/runtime/timeline.py).
From those times this module gives what the plan statistics give from the
cost model, so the two sit side by side in results.json:

- ``measured_critical_path``: lock-step ranks (FSDP2) wait for the slowest at
  every step, so it is the sum over steps of the busiest rank's busy time
  divided by the mean rank's total busy time; independent ranks (Megatron DDP)
  wait once, at the gradient sync, so it is the busiest rank's total over the
  mean. 1.0: no rank ever waits. Busy times are averaged over the timed repeats
  first, so the maximum of noisy repeats does not inflate it.
- ``idle_fraction`` per rank: the share of the pass's timed region (the slowest
  rank's) the rank was not busy: waiting for other ranks, blocked in
  collectives, and on a CPU the collectives' own transfers.
- ``cost_prediction``: how well a cost model predicts the measured micro-batch
  times: the best scale from model units to seconds (least squares through the
  origin: balance needs only the model's ratios), its R² and the worst relative
  error over the pass's micro-batches (dummy steps left out: the model gives
  them no cost).

Pure Python and numpy: no torch, no Hydra.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from balance_batch.cost import CostModel, microbatch_cost

Schedule = Sequence[Optional[Sequence[int]]]
_DIGITS = 6
TIMELINE_KEYS = ("step_s", "busy_s", "start_s", "sync_s", "elapsed_s")
OPTIONAL_KEYS = ("wait_s",)  # a lock-step rank's collective waits per step, where its backend counts them


def timeline_record(timelines: Sequence[Optional[dict]]) -> Optional[dict]:
    """``passes.<type>.timeline``: every timed repeat's per-rank times, compactly ([repeat][rank][step]).

    ``timelines`` holds each repeat's ``PassResult.timeline``; None when any repeat has none (a backend that does not
    time its steps, a server too old to send them).
    """
    if not timelines or any(t is None for t in timelines):
        return None
    first = timelines[0]
    ranks = [rank for t in timelines for rank in t["per_rank"]]
    keys = TIMELINE_KEYS + tuple(k for k in OPTIONAL_KEYS if all(k in rank for rank in ranks))
    per_key = {k: [[rank[k] for rank in t["per_rank"]] for t in timelines] for k in keys}
    return {"step_clock": first.get("step_clock"), "busy_clock": first.get("busy_clock"), "repeats": len(timelines),
            **per_key}


def merge_timelines(first: Optional[dict], more: Optional[dict]) -> Optional[dict]:
    """One timeline over the repeats of both (``more`` ran after ``first``, the same plan)."""
    if first is None or more is None:
        return first or more
    out = dict(first)
    for k in TIMELINE_KEYS + OPTIONAL_KEYS:
        if k in first and k in more:
            out[k] = list(first[k]) + list(more[k])
        else:
            out.pop(k, None)
    out["repeats"] = first["repeats"] + more["repeats"]
    return out


def mean_busy(timeline: dict) -> list[list[float]]:
    """[rank][step]: each step's busy seconds, averaged over the timed repeats."""
    reps = timeline["busy_s"]
    ranks = len(reps[0])
    return [np.mean([rep[r] for rep in reps], axis=0).tolist() if reps[0][r] else [] for r in range(ranks)]


def ran_schedules(schedules: Sequence[Schedule], lockstep: bool) -> list[list]:
    """The steps each rank ran: a lock-step rank runs its dummies (None), an independent one skips them."""
    return [list(s) if lockstep else [b for b in s if b is not None] for s in schedules]


def measured_balance(timeline: dict, lockstep: bool) -> dict:
    """``measured_critical_path`` and per-rank ``idle_fraction`` and ``busy_s`` (see the module docstring)."""
    busy = mean_busy(timeline)
    totals = [float(sum(b)) for b in busy]
    mean = sum(totals) / len(totals) if totals else 0.0
    if mean <= 0:
        critical = 1.0
    elif lockstep:
        steps = max((len(b) for b in busy), default=0)
        padded = np.zeros((len(busy), steps))
        for r, b in enumerate(busy):
            padded[r, : len(b)] = b
        critical = float(padded.max(axis=0).sum()) / mean
    else:
        critical = max(totals) / mean
    idle = []
    for r in range(len(busy)):
        shares = []
        for rep_busy, rep_elapsed in zip(timeline["busy_s"], timeline["elapsed_s"]):
            region = max(rep_elapsed)
            shares.append(1.0 - sum(rep_busy[r]) / region if region > 0 else 0.0)
        idle.append(round(max(0.0, float(np.mean(shares))), 4))
    return {"measured_critical_path": round(critical, 4), "idle_fraction": idle,
            "busy_s": [round(t, _DIGITS) for t in totals]}


def microbatch_times(timeline: dict, schedules: Sequence[Schedule], lockstep: bool) -> Optional[list[tuple]]:
    """(micro-batch, mean busy seconds) for every step every rank ran, dummies as None; None when the timeline's
    steps are not the schedules' (then nothing can be paired)."""
    ran = ran_schedules(schedules, lockstep)
    busy = mean_busy(timeline)
    if len(busy) != len(ran) or any(len(b) != len(s) for b, s in zip(busy, ran)):
        return None
    return [(batch, t) for s, b in zip(ran, busy) for batch, t in zip(s, b)]


def prediction_quality(times: Sequence[float], costs: Sequence[float]) -> dict:
    """How well ``costs`` (model units) predict ``times`` (seconds), as ``time ≈ scale × cost``.

    ``scale`` is the least-squares fit through the origin; ``r2`` is 1 − residual / total sum of squares of the
    times, null with fewer than 3 micro-batches or when the model gives them about equal costs (within 10%: a
    balanced plan's are, and then the times vary only by noise, which no model explains); ``worst_rel_err`` the
    largest |measured − predicted| ÷ measured.
    """
    t = np.asarray(times, dtype=np.float64)
    c = np.asarray(costs, dtype=np.float64)
    keep = (t > 0) & (c > 0)
    t, c = t[keep], c[keep]
    n = int(len(t))
    if n == 0:
        return {"micro_batches": 0, "scale": None, "r2": None, "worst_rel_err": None}
    scale = float((c * t).sum() / (c * c).sum())
    resid = t - scale * c
    total = float(((t - t.mean()) ** 2).sum())
    varied = c.max() > 1.1 * c.min() and total > 1e-12 * float((t**2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if n >= 3 and varied else None
    return {"micro_batches": n, "scale": scale, "r2": None if r2 is None else round(r2, 4),
            "worst_rel_err": round(float(np.max(np.abs(resid) / t)), 4)}


def cost_prediction(pairs: Sequence[tuple], lengths: Sequence[int], layout: str,
                    models: dict[str, CostModel]) -> dict:
    """Per named cost model, ``prediction_quality`` of its micro-batch costs against the measured times."""
    real = [(batch, t) for batch, t in pairs if batch]
    times = [t for _, t in real]
    return {name: prediction_quality(times, [microbatch_cost(b, lengths, layout, m) for b, _ in real])
            for name, m in models.items()}


def balance_fields(timeline: Optional[dict], schedules: Optional[Sequence[Schedule]], lengths: Sequence[int],
                   layout: str, lockstep: bool, models: dict[str, CostModel]) -> dict:
    """What a pass record adds from its timeline: measured critical path, idle and busy per rank, cost prediction.

    Empty without a timeline; ``cost_prediction`` is null when the timeline's steps are not the plan's.
    """
    if not timeline:
        return {}
    fields = measured_balance(timeline, lockstep)
    pairs = microbatch_times(timeline, schedules, lockstep) if schedules is not None else None
    fields["cost_prediction"] = cost_prediction(pairs, lengths, layout, models) if pairs is not None else None
    return fields
