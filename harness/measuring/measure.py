"""The measurement protocol: warm-up, timed repeats (each beside a baseline pass when paired), throughput, device
utilisation and peak memory, and one more pass under the profiler.

measure_pass is a loop over a PairedRunner (harness/measuring/runner.py: which side runs, settling passes) and a
RepeatStats (harness/measuring/stats.py: what the repeats measured, whether the interval asks for more); the record it
returns is harness/measuring/records.py's PassRecord. What samples the devices during a repeat is in
harness/measuring/samplers.py.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional, Sequence

from backends.backend import Backend
from backends.messages import PASS_TYPES, Example, PassCommand, PassResult, make_command
from backends.runtime.profiling import PROFILE_RANKS, PROFILE_STEPS
from harness.measuring.records import PassRecord
from harness.measuring.runner import PairedRunner, Pairing
from harness.measuring.samplers import make_sampler
from harness.measuring.stats import RepeatStats
from harness.metrics.spread import WIDE_PCT

log = logging.getLogger("harness.measure")  # the log channel's name, kept when the module moved


def measure_pass(
    backend: Backend,
    examples: Sequence[Example],
    pass_type: str,
    warmup: int,
    repeat: int,
    command_for: Callable[[str], PassCommand],
    sample_interval_s: float = 0.1,
    label: str = "",
    on_repeat: Optional[Callable[[str, int, float, float, Optional[float]], None]] = None,
    release_first: bool = True,
    snapshot_dir: Optional[str] = None,
    target_ci_pct: Optional[float] = None,
    max_repeats: Optional[int] = None,
    pairing: Optional[Pairing] = None,
) -> tuple[PassRecord, PassResult]:
    """Warm-up runs, then at least ``repeat`` timed runs of one pass type; returns the record and the last result.

    ``release_first=False`` keeps what the pass type's earlier runs left cached (more repeats of a pass measured
    just before: harness/auto/model.py tops up the chosen budget's).
    ``snapshot_dir`` (bench.memory_snapshot): the warm-up
    runs record the CUDA allocator's history, and one that runs out of memory leaves its snapshot there.
    ``target_ci_pct`` (bench.target_ci_pct): more timed runs, up to ``max_repeats``, until the 95% interval of the
    tok/s (and of the speedup, when paired) is within that many percent. ``pairing``: every timed run is one pair,
    the point's pass and the baseline's side by side in alternating order (harness/metrics/spread.py), each timed pass
    after an untimed one of its own shape (``settle``); the record's ``speedup`` is the median of the pair ratios with
    its interval."""
    real_tokens = sum(len(e) for e in examples)
    runner = PairedRunner(backend, pass_type, command_for, pairing, release_first)
    result, warm_compile = runner.warm_up(warmup, snapshot_dir, label)
    stats = RepeatStats(real_tokens, paired=pairing is not None)
    sampler = make_sampler(backend, sample_interval_s)
    limit = max(repeat, max_repeats or repeat)
    while stats.more(repeat, limit, target_ci_pct):
        i = stats.count
        # pairs alternate their order (A B, B A, ...): a drift within a pair cancels over two pairs
        baseline_first = pairing is not None and i % 2 == 1
        if baseline_first:
            stats.add_baseline(runner.timed_baseline())
        result, wall, util, mem_pct = runner.timed_point(sampler)
        if pairing is not None and not baseline_first:
            stats.add_baseline(runner.timed_baseline())
        dt = stats.add(result, wall, util, mem_pct, sampler, backend)
        if on_repeat is not None:
            on_repeat(pass_type, i, dt, real_tokens / dt, util)
        _log_repeat(label, pass_type, i, repeat, target_ci_pct, dt, real_tokens, util,
                    stats.base_elapsed[-1] if pairing is not None else None)
    assert result is not None
    _warn_timed_compile(label, pass_type, stats.timed_compile)
    record = stats.record(result, warm_compile, target_ci_pct, runner.baseline_plan, runner.settled)
    _log_spread(label, pass_type, record, repeat)
    if record.spread_fields()["target_ci_reached"] is False:
        _log_target_missed(label, pass_type, record, limit)
    return record, result


def _log_repeat(label: str, pass_type: str, i: int, repeat: int, target_ci_pct: Optional[float], dt: float,
                real_tokens: int, util: Optional[float], base_s: Optional[float]) -> None:
    """One line per timed repeat: its seconds, tok/s, utilisation and (paired) its pair ratio."""
    paired = f", pair ratio {real_tokens / dt / (real_tokens / base_s):.3f}" if base_s is not None else ""
    log.info(
        "%s%s repeat %d/%s: %.2f s, %s tok/s%s%s",
        label,
        pass_type,
        i + 1,
        repeat if i < repeat else f"{repeat}+ (bench.target_ci_pct={target_ci_pct:g})",
        dt,
        f"{real_tokens / dt:,.0f}",
        f", util {util:.0f}%" if util is not None else "",
        paired,
    )


def _warn_timed_compile(label: str, pass_type: str, timed_compile: Optional[dict]) -> None:
    if timed_compile and timed_compile["compilations"] + timed_compile["backward_compilations"]:
        log.warning("%s%s: compiled %d graph(s) during the timed repeats (%.1f s, inside their tok/s); "
                    "raise bench.warmup so the warm-up sees every shape", label, pass_type,
                    timed_compile["compilations"] + timed_compile["backward_compilations"], timed_compile["compile_s"])


def _log_target_missed(label: str, pass_type: str, record: "PassRecord", limit: int) -> None:
    """One line when bench.target_ci_pct was not reached: the repeats ran out (bench.max_repeats) first."""
    d = record.spread_fields()
    widths = [f"tok/s ±{d['tok_per_s_ci_pct']:.1f}%" if d["tok_per_s_ci_pct"] is not None else "tok/s: no interval"]
    speed = d.get("speedup")
    if speed and speed.get("ci_pct") is not None:
        widths.append(f"speedup ±{speed['ci_pct']:.1f}%")
    log.warning("%s%s: bench.target_ci_pct=%g not reached after %d repeats (the most bench.max_repeats=%d allows): "
                "%s; results.json records target_ci_reached false and the wider interval", label, pass_type,
                record.target_ci_pct, len(record.elapsed_s), limit, ", ".join(widths))


def _log_spread(label: str, pass_type: str, record: "PassRecord", repeat: int) -> None:
    """One line: the median and interval of the pass's tok/s (and of its paired speedup), flagged when noisy."""
    d = record.spread_fields()
    ci = d["tok_per_s_ci"]
    # a wide interval is lopsided on this scale: its bounds, not a ± that would read as reaching below zero
    width = f" (±{d['tok_per_s_ci_pct']:.1f}%)" if ci and d["tok_per_s_ci_pct"] <= WIDE_PCT else ""
    few = " from only 2 repeats: too few for a usable interval" if d["repeats"] == 2 else ""
    interval = f", 95% interval {ci[0]:,.0f}–{ci[1]:,.0f}{width}{few}" if ci else ""
    extra = f" after {d['repeats']} repeats" if d["repeats"] > repeat else ""
    speed = d.get("speedup")
    paired = ""
    if speed and speed["median"] is not None:
        sci = speed["ci"]
        paired = (f"; speedup over mbs=1 {speed['median']:.3f}× in {speed['n']} pairs"
                  + (f" ({sci[0]:.3f}–{sci[1]:.3f})" if sci else ""))
    noisy = "; noisy: its repeats spread more than 10%, rerun on a quiet machine or raise bench.repeat" \
        if d["noisy"] else ""
    log.info("%s%s: median %s tok/s%s%s%s%s", label, pass_type, f"{d['tok_per_s_median']:,.0f}", interval, extra,
             paired, noisy)


PROFILE_DIR = "profile"  # in the point's folder: <pass>-rank<r>.json.gz


def profile_pass(backend: Backend, pass_type: str, command_for: Callable[[str], PassCommand], out_dir,
                 timed_s: Optional[Sequence[float]] = None, label: str = "", steps: int = PROFILE_STEPS,
                 ranks: Optional[Sequence[int]] = PROFILE_RANKS, memory: bool = False) -> dict:
    """One more run of ``pass_type`` under torch.profiler, after its timed repeats (not counted in tok/s): ``steps``
    micro-batches after the first (0: the whole pass) on ``ranks`` (None: every rank), the allocator's events with
    ``memory`` (bench.profile_steps, profile_ranks, profile_memory).

    Returns ``passes.<type>.profile``: the traces (relative to ``out_dir``), the profiled pass's seconds and
    its breakdown's shares per rank, the shares averaged over ranks (they sum to 1) and each rank's top ops;
    ``slowdown``: the profiled run's timed region over the mean of ``timed_s`` (the profiler's own cost).
    """
    from pathlib import Path

    out_dir = Path(out_dir).resolve()  # every rank writes there, whatever its working folder
    t0 = time.perf_counter()
    result = backend.run_pass(
        command_for(pass_type).replace(profile_dir=str(out_dir / PROFILE_DIR), release_memory=False,
                                       profile_steps=steps, profile_ranks=None if ranks is None else tuple(ranks),
                                       profile_memory=memory)
    )
    # the ranks the command asked to profile (PassCommand.profile_ranks; by default rank 0 alone)
    profiled = [(i, r) for i, r in enumerate(result.profile or []) if r]
    if not profiled:
        asked = None if ranks is None else list(ranks)
        raise RuntimeError(f"{pass_type}: the backend ran the profiled pass but no rank profiled it "
                           f"(bench.profile_ranks={asked}, ranks 0 to {backend.world_size - 1})")
    ranks = [r for _, r in profiled]
    shares = {k: sum(r["breakdown"]["shares"][k] for r in ranks) / len(ranks) for k in ranks[0]["breakdown"]["shares"]}
    record = {
        # beside results.json (a rank on another node wrote its trace there, on its own disk)
        "traces": [os.path.relpath(r["trace"], out_dir) for r in ranks],
        "elapsed_s": result.step_s,
        "slowdown": result.step_s / (sum(timed_s) / len(timed_s)) if timed_s and result.step_s else None,
        "shares": shares,
        "per_rank": [{"rank": i, "steps": r["steps"], "trace_bytes": r["trace_bytes"], "events": r["events"],
                      "memory": r["memory"], **r["breakdown"]} for i, r in profiled],
    }
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:3]
    log.info("%s%s profiled (%.1f s with the trace): %s; traces in %s", label, pass_type, time.perf_counter() - t0,
             ", ".join(f"{k} {100 * v:.0f}%" for k, v in top), out_dir / PROFILE_DIR)
    return record


def default_command_for(
    examples: Sequence[Example], mtpm: Optional[int], mbs: int, **options
) -> Callable[[str], PassCommand]:
    """Commands with a fixed budget; ``options`` are make_command's (layout, planner, the cap on sequences per
    micro-batch, progress interval, time-out)."""
    return lambda pass_type: make_command(pass_type, examples, mtpm, mbs, **options)


__all__ = ["PASS_TYPES", "measure_pass", "default_command_for", "profile_pass"]
