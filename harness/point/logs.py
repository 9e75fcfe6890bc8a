"""A point's log lines: its plan, its last line, and mtpm=auto's progress and answer (what the report's first line
says)."""

from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger("harness")


def log_plan(label: str, st, n_examples: int, max_seqs: Optional[int] = None) -> None:
    """Two lines on what the plan is: tokens and padding, then steps and the modeled cost."""
    log.info(
        "%splan (%s, %s%s): %d examples, %s real / %s padded tokens, pad efficiency %.3f, "
        "micro-batches per rank %s, dummies %s",
        label,
        st.planner,
        st.layout,
        "" if max_seqs is None else f", at most {max_seqs} sequences per micro-batch",
        n_examples,
        f"{st.real_tokens:,}",
        f"{st.padded_tokens:,}",
        st.pad_efficiency,
        st.n_microbatches,
        st.n_dummy,
    )
    log.info(
        "%s%d steps (fewest possible %d), %d micro-batches over budget, "
        "modeled cost per rank max/mean %.4f, critical path %.4f",
        label,
        st.steps,
        st.lower_bound_steps,
        st.over_budget,
        st.cost_imbalance,
        st.critical_path,
    )


def log_ok(label: str, doc: dict[str, Any]) -> None:
    """The point's last line: throughput of both pass types, pad efficiency and MFU."""
    fwd, fb = doc["passes"]["forward"], doc["passes"]["forward_backward"]
    log.info(
        "%sok: forward %s tok/s, forward_backward %s tok/s, pad efficiency %.3f, MFU (fwd+bwd) %s",
        label,
        f"{fwd['tok_per_s']:,.0f}",
        f"{fb['tok_per_s']:,.0f}",
        doc["plan"]["pad_efficiency"],
        "—" if fb["mfu_pct"] is None else f"{fb['mfu_pct']:.2f}%",
    )


def log_candidate(label: str, c, limit: int) -> None:
    """mtpm=auto's progress: one line per candidate as the search settles it, with why it ran or not and the
    prediction that decided it."""
    gib = lambda n: "—" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    speed = f", {c.tok_per_s:,.0f} tok/s fwd+bwd" if c.tok_per_s else ""
    model = c.predicted_by or {}
    predicted = (f" (predicted {gib(c.predicted_peak_bytes)} by the model of {model.get('points')} points; "
                 f"{c.decision})" if c.predicted_peak_bytes else f" ({c.decision}: no prediction yet)" if c.decision
                 else "")
    peak = f", peak {gib(c.measured_peak_bytes)}{predicted}" if c.measured_peak_bytes else predicted
    shown = c.status == "ok" or (c.status == "over_limit" and c.reason and c.reason.startswith("not run: predicted"))
    why = f" ({c.reason})" if c.reason and not shown else ""
    log.info("%smtpm=auto: mtpm=%d %s%s%s, limit %s%s", label, c.mtpm, c.status, speed, peak, gib(limit), why)


def log_answer(label: str, doc: dict[str, Any]) -> None:
    """mtpm=auto's last line: the answer, as the report's first line says it (the paired speedup results.json holds,
    with its interval; the ratio to the search's own mbs=1 run only where nothing was paired, and called unpaired)."""
    auto = doc["auto"]
    fb = doc["passes"]["forward_backward"]
    base = (auto.get("baseline") or {}).get("tok_per_s")
    paired = doc.get("speedup") if isinstance(doc.get("speedup"), dict) else None
    ci = (paired or {}).get("ci")
    if paired is not None and paired.get("median") is not None:
        speed = paired["median"]
        interval = f", 95% interval {ci[0]:.2f}–{ci[1]:.2f}" if ci else ""
        versus = f"{speed:.2f}× mbs=1 ({len(paired.get('pairs') or [])} pairs{interval})"
    elif base:
        speed = fb["tok_per_s"] / base
        versus = f"{speed:.2f}× mbs=1 (unpaired)"
    else:
        speed, versus = None, "no mbs=1 run"
    peaks = [p for p in fb.get("mem_peak_bytes") or [] if p is not None]
    if ci and ci[0] <= 1.0 <= ci[1]:
        verdict = "; not told apart from mbs=1 here (its interval holds 1.0)"
    elif speed is not None and speed < 1:
        verdict = "; mbs=1 ran faster: no budget pays here"
    else:
        verdict = ""
    log.info("%s%s: set mtpm=%d (%s, %s): %s tok/s fwd+bwd, %s, peak %s of %.1f GiB%s%s", label, doc["backend"],
             doc["mtpm"], doc["planner"], doc["layout"], f"{fb['tok_per_s']:,.0f}", versus,
             f"{max(peaks) / 2**30:.1f} GiB" if peaks else "unknown", auto["limit_bytes"] / 2**30, verdict,
             _tie_phrase(auto.get("tie")) + _one_pair_phrase(auto.get("ranking")) + _not_tried_phrase(auto))


def _not_tried_phrase(auto: dict) -> str:
    """"; not tried: mtpm=32768 (predicted 3.68 GiB, 23% over the limit, beyond the model's 10% error)": the budgets
    refused without a measurement, and why (a measured refusal is a fact the candidates' lines gave)."""
    limit = auto["limit_bytes"]
    out = []
    for c in auto.get("candidates") or []:
        if c.get("decision") == "predicted_over":
            margin = (c.get("margin") or {}).get("fraction")
            out.append(f"mtpm={c['mtpm']} (predicted {c['predicted_peak_bytes'] / 2**30:.2f} GiB, "
                       f"{c['predicted_peak_bytes'] / limit - 1:.0%} over the limit, beyond the model's "
                       f"{margin:.0%} error)")
        elif c.get("decision") == "above_failure":
            out.append(f"mtpm={c['mtpm']} ({c['reason']})")
    return f"; not tried: {', '.join(out)}" if out else ""


def _one_pair_phrase(ranking: Optional[dict]) -> str:
    """"; ranked on one pair each (bench.repeat=1)", or the budgets left out on their single pair: a ranking by one
    noisy ratio is said, not implied."""
    if not ranking or len(ranking.get("pairs") or {}) < 2:
        return ""
    if ranking.get("repeat", 1) <= 1 and all(n <= 1 for n in (ranking.get("pairs") or {}).values()):
        return "; every budget ranked on one pair (bench.repeat=1: no interval tells them apart)"
    left = ranking.get("on_one_pair") or []
    if not left:
        return ""
    return "; ranked below the leaders on one pair each: " + ", ".join(
        f"mtpm={c['mtpm']} ({c['speedup']:.2f}×)" for c in left)


def _tie_phrase(tie: Optional[dict]) -> str:
    """"; ties with mtpm=32768 (...): chosen by ..." when the leading budgets could not be told apart, else ""."""
    from harness.metrics.spread import tie_text

    if not tie:
        return ""
    peaks = tie.get("peaks") or {}
    weighed = (f" ({', '.join(f'mtpm={m} {p / 2**30:.2f} GiB' for m, p in peaks.items() if p)})"
               if "peak memory" in (tie["rule"] or "") and peaks else "")
    return "; " + tie_text([f"mtpm={m}" for m in tie["with"]], tie["rule"], tie.get("pairs")) + weighed
