"""How far a figure can be trusted: the spread of repeated measurements, a confidence interval, and paired ratios.

Throughput on a shared machine drifts (other tenants, frequency, memory placement), and its noise is
multiplicative: a pass 5% slower is 5% slower whatever its size. So every interval here is a **t-interval on
the logarithms** of the values: the mean log ± t(n−1) · s/√n, back on the original scale. It is a confidence
interval (95% by default) for the geometric mean of the values, and for a ratio of two throughputs it is
symmetric in which one is on top. The median, minimum and maximum are reported beside it; a figure whose
largest repeat is more than ``NOISY_RATIO`` times its smallest is flagged noisy.

A speedup is measured in pairs: the point's pass and the baseline's run side by side in time, in alternating
order (A B, B A, A B, ...), and each pair gives one ratio. A drift that slows the machine between two points
slows both passes of a pair alike, so it cancels in the ratio; a linear drift within a pair cancels over
each two pairs of alternating order.

Pure Python (the quantiles of Student's t are tabulated): no numpy, no torch.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

LEVEL = 0.95
NOISY_RATIO = 1.10  # max / min of a figure's repeats above this: the row is flagged noisy
METHOD = "t-interval (95%) of the mean of log values: a confidence interval for the geometric mean"
# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom 1..30.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (the table, then a Cornish-Fisher step)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df * df)


def interval(values: Sequence[float]) -> Optional[tuple[float, float]]:
    """The 95% t-interval of the geometric mean of positive ``values``, or None with fewer than two."""
    logs = [math.log(v) for v in values if v is not None and v > 0]
    if len(logs) < 2:
        return None
    mean = statistics.fmean(logs)
    half = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean - half), math.exp(mean + half)


def half_width_pct(ci: Optional[Sequence[float]]) -> Optional[float]:
    """An interval's half width as a percentage of its centre (geometric), or None without one."""
    if not ci:
        return None
    lo, hi = ci
    return 100.0 * (math.sqrt(hi / lo) - 1.0)


# Above this half width (in % of the centre) an interval is shown by its bounds: "±1548%" would read as reaching
# below zero, while an interval on the logarithms never does (it is lopsided: 1,017–277,111 around 16,788).
WIDE_PCT = 25.0


def interval_text(ci: Optional[Sequence[float]], n: Optional[int], fmt: str = "{:,.0f}", unit: str = "repeats") -> str:
    """A figure's 95% interval as a table cell shows it after the figure: " ±3.1%" while narrow, else its bounds,
    " (95% 1,017–277,111)"; ", only 2 repeats" where two values made it (Student's t with one degree of freedom is
    12.7: two values give an interval that wide whatever they are). "" without an interval."""
    if not ci or len(ci) != 2 or not ci[0]:
        return ""
    width = half_width_pct(ci)
    few = f", only {n} {unit}" if n is not None and n == 2 else ""
    if width <= WIDE_PCT:
        return f" ±{width:.1f}%" + (f" ({few[2:]})" if few else "")
    return f" (95% {fmt.format(ci[0])}–{fmt.format(ci[1])}{few})"


def summary(values: Sequence[float]) -> dict:
    """``median``, ``min``, ``max``, ``ci`` ([low, high], null below two values), ``ci_pct`` (its half width in % of
    the centre), ``n`` and ``noisy`` (max / min above ``NOISY_RATIO``) of repeated measurements."""
    known = [float(v) for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "ci": None, "ci_pct": None, "n": 0, "noisy": False}
    ci = interval(known)
    return {"median": statistics.median(known), "min": min(known), "max": max(known),
            "ci": None if ci is None else [ci[0], ci[1]], "ci_pct": half_width_pct(ci), "n": len(known),
            "noisy": min(known) > 0 and max(known) / min(known) > NOISY_RATIO}


def paired_speedup(point: Sequence[float], baseline: Sequence[float]) -> dict:
    """The speedup of ``point`` over ``baseline`` from throughputs measured in pairs (index i of each side by side).

    ``median`` is the median pair ratio, ``ci`` the 95% interval of their geometric mean, ``pairs`` every ratio.
    """
    if len(point) != len(baseline):
        raise ValueError(f"paired measurements need as many baseline runs as point runs ({len(baseline)} vs "
                         f"{len(point)})")
    ratios = [p / b for p, b in zip(point, baseline) if p and b]
    out = summary(ratios)
    out["pairs"] = ratios
    return out


def needs_more(values: Sequence[float], target_pct: Optional[float]) -> bool:
    """Whether ``values`` need more repeats for ``target_pct``: no interval yet, or one whose half width is wider."""
    if target_pct is None:
        return False
    width = half_width_pct(interval(values))
    return width is None or width > target_pct


# -- choosing among settings that cannot be told apart ----------------------------------------------------
TIE_RULE = "its interval above 1 (shown faster than mbs=1), then the least peak memory, then the smallest budget"


def overlap(a: Optional[Sequence[float]], b: Optional[Sequence[float]]) -> bool:
    """Whether two 95% intervals overlap (False where either is missing: nothing says the two are alike)."""
    if not a or not b:
        return False
    return a[0] <= b[1] and b[0] <= a[1]


def choose(options: Sequence[dict], floor: Optional[float] = None) -> tuple[int, list[int], Optional[str]]:
    """The setting to recommend of ``options`` (each ``median``, ``ci``, ``peak_bytes``, ``budget``; higher median
    is better): (its index, the indices it ties with, the rule that chose among them, or None without a tie).

    The leader is the highest median. Every option whose 95% interval overlaps the leader's cannot be told apart
    from it: ranking those by their medians would be a coin toss, so the tie is settled by ``TIE_RULE``, what a
    user paying for the run would want of equals: one shown better than ``floor`` (speedups over mbs=1: 1.0) over
    one that is not, then the one that peaks lower in memory (peaks within 1% are alike), then the smaller budget
    (``budget`` None: fixed micro-batches, after any budget).
    """
    lead = max(range(len(options)), key=lambda i: options[i]["median"])
    tied = [i for i in range(len(options)) if i != lead and overlap(options[i].get("ci"), options[lead].get("ci"))]
    if not tied:
        return lead, [], None
    group = [lead] + tied
    rules = []
    shown = [i for i in group if floor is not None and options[i].get("ci") and options[i]["ci"][0] > floor]
    if shown and len(shown) < len(group):
        rules.append("its interval above 1 (shown faster than mbs=1)")
    low = shown or group
    peak = lambda i: options[i].get("peak_bytes") or math.inf  # noqa: E731
    least = min(peak(i) for i in low)
    if len(low) > 1:
        lowest = [i for i in low if peak(i) <= least * 1.01]
        if len(lowest) < len(low):
            rules.append("the least peak memory")
        if len(lowest) > 1:
            rules.append("the smallest budget")
        low = lowest
    budget = lambda i: options[i].get("budget") if options[i].get("budget") is not None else math.inf  # noqa: E731
    pick = min(low, key=lambda i: (budget(i), group.index(i)))
    return pick, [i for i in group if i != pick], ", then ".join(rules)


def tie_text(names: Sequence[str], rule: str, pairs: Optional[int] = None) -> str:
    """"ties with mtpm=32,768 (95% intervals overlap after 5 pairs each): chosen for the least peak memory"."""
    after = f" after {pairs} pairs each" if pairs else ""
    return f"ties with {', '.join(names)} (95% intervals overlap{after}): chosen for {rule}"
