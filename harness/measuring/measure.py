"""The measurement protocol: warm-up, timed repeats, throughput, device utilisation and peak memory.

What samples the devices during a repeat is in harness/measuring/samplers.py.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from backends.backend import Backend
from backends.messages import PASS_TYPES, Example, PassCommand, PassResult, make_command
from backends.model import compiling
from harness.measuring.samplers import make_sampler
from harness.metrics.balance import merge_timelines, timeline_record
from harness.metrics.spread import METHOD, WIDE_PCT, needs_more, paired_speedup, summary

log = logging.getLogger("harness.measure")  # the log channel's name, kept when the module moved


@dataclass
class PassRecord:
    """One pass type's measurements, as written to results.json."""

    elapsed_s: list[float]
    tok_per_s: float
    util_pct: Optional[float]
    mem_pct: Optional[float]
    real_tokens: int
    grad_norm: Optional[float] = None
    # Per rank, the largest over the timed repeats (see PassResult.mem_peak_bytes_per_rank); None where unknown.
    mem_peak_bytes: Optional[list[Optional[int]]] = None
    # Per rank, the CUDA allocator's peaks over the timed repeats: tensors (allocated) and tensors plus the
    # allocator's cache (reserved); None on CPU.
    mem_peak_allocated_bytes: Optional[list[Optional[int]]] = None
    mem_peak_reserved_bytes: Optional[list[Optional[int]]] = None
    # Per device the run uses, the most NVML saw in use (nvidia-smi's figure); None without NVML or on CPU.
    device_mem_used_bytes: Optional[list[Optional[int]]] = None
    # Per repeat: the caller's wall time of the whole pass, and the part of it outside the timed
    # region (elapsed_s): sending the examples, planning, copying outputs to the host, gathering them.
    pass_wall_s: Optional[list[float]] = None
    host_s: Optional[list[float]] = None
    # What ran in the last timed repeat: {op: {implementation: calls}} over all ranks (backends/model/kernels.py).
    kernels: Optional[dict] = None
    # backend.compile: what compiling cost, in the warm-up and in the timed repeats (backends/model/compiling.py
    # ``merge``); None when nothing is compiled. Anything compiled in the timed repeats is in their seconds.
    compile: Optional[dict] = None
    # Every timed repeat's per-rank, per-step times (harness/metrics/balance.py ``timeline_record``); None where the
    # backend does not time its steps.
    timeline: Optional[dict] = None
    target_ci_pct: Optional[float] = None  # bench.target_ci_pct the repeats were measured to (None: a fixed count)
    # A paired speedup's baseline passes, one per timed repeat, side by side with them (None: not paired)
    baseline_elapsed_s: Optional[list[float]] = None
    baseline_plan: Optional[dict] = None  # what the paired baseline passes ran: their layout, planner and micro-batches
    settling_passes: Optional[int] = None  # untimed passes run after a switch between the pair's two sides

    def spread_fields(self) -> dict:
        """tok/s median, min, max and 95% interval over the repeats, ``noisy``, ``repeats``; the paired speedup."""
        per_repeat = [self.real_tokens / t for t in self.elapsed_s]
        s = summary(per_repeat)
        out = {"tok_per_s_median": s["median"], "tok_per_s_min": s["min"], "tok_per_s_max": s["max"],
               "tok_per_s_ci": s["ci"], "tok_per_s_ci_pct": s["ci_pct"], "ci_method": METHOD, "noisy": s["noisy"],
               "repeats": len(self.elapsed_s), "target_ci_pct": self.target_ci_pct}
        target = self.target_ci_pct
        reached = None if target is None else not needs_more(per_repeat, target)
        if self.baseline_elapsed_s is not None:
            base = [self.real_tokens / t for t in self.baseline_elapsed_s]
            speed = paired_speedup(per_repeat, base)
            if target is not None:
                reached = reached and not needs_more(speed["pairs"], target)
            speed["baseline_tok_per_s"] = summary(base)
            speed["baseline_elapsed_s"] = list(self.baseline_elapsed_s)
            speed["baseline_plan"] = self.baseline_plan
            speed["settling_passes"] = self.settling_passes
            speed["method"] = ("paired: each timed repeat beside an mbs=1 pass, in alternating order, each timed pass "
                               "after an untimed one of its own shape; median pair ratio, " + METHOD)
            out["speedup"] = speed
        # bench.target_ci_pct met by every interval it applies to (None: no target); false: max_repeats ran out first
        out["target_ci_reached"] = reached
        return out

    def as_dict(self) -> dict:
        return {
            "elapsed_s": self.elapsed_s,
            "tok_per_s": self.tok_per_s,
            "util_pct": self.util_pct,
            "mem_pct": self.mem_pct,
            "mem_peak_bytes": self.mem_peak_bytes,
            "mem_peak_allocated_bytes": self.mem_peak_allocated_bytes,
            "mem_peak_reserved_bytes": self.mem_peak_reserved_bytes,
            "device_mem_used_bytes": self.device_mem_used_bytes,
            "pass_wall_s": self.pass_wall_s,
            "host_s": self.host_s,
            "real_tokens": self.real_tokens,
            "grad_norm": self.grad_norm,
            "kernels": self.kernels,
            "compile": self.compile,
            "timeline": self.timeline,
            **{k: v for k, v in self.spread_fields().items() if k != "speedup"},
        }


# What a paired speedup records of the baseline passes it ran beside the point's (their PassResult.plan)
BASELINE_PLAN_KEYS = ("layout", "planner", "n_microbatches", "padded_tokens", "max_microbatch_size")


@dataclass
class Pairing:
    """The baseline a point's passes are measured side by side with, for a speedup measured in pairs.

    ``command_for`` gives the baseline's commands (mbs=1 fixed slices, greedy, padded); ``point`` and
    ``baseline`` are the (mtpm, mbs) each runs with, set in the backend's control file between passes where it
    has one (a hot sweep's backend takes its budget from there, not from the command).
    """

    command_for: Callable[[str], PassCommand]
    point: tuple[Optional[int], int]
    baseline: tuple[Optional[int], int] = (None, 1)
    # the baseline gets bench.warmup untimed runs of its own, the settling pass before its first timed one the last
    # (False: only that settling pass: it ran just before, warm)
    warm: bool = True

    def run(self, backend: Backend, command: PassCommand, which: str) -> PassResult:
        control = getattr(backend, "control", None)
        if control is not None:
            mtpm, mbs = self.point if which == "point" else self.baseline
            control.set_max_tokens_per_microbatch(mtpm)
            control.set_micro_batch_size(mbs)
        try:
            return backend.run_pass(command)
        finally:
            if control is not None and which != "point":
                control.set_max_tokens_per_microbatch(self.point[0])
                control.set_micro_batch_size(self.point[1])


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
    result: Optional[PassResult] = None
    real_tokens = sum(len(e) for e in examples)
    runs = 0

    def command(make: Callable[[str], PassCommand] = command_for) -> PassCommand:
        # Cached memory is released once, before this pass type's first run (so the peak is this pass's, not
        # what an earlier point or pass left); later runs keep it, as the steps of a training loop do: releasing
        # before every timed repeat would time the allocator's (and the kernel's) cold start each time.
        nonlocal runs
        runs += 1
        return make(pass_type).replace(release_memory=runs == 1 and release_first)

    baseline_plan: Optional[dict] = None
    last: Optional[str] = None  # which side ran the backend's last pass ("point" or "baseline"); None: not known
    settled = 0

    def run(which: str, cmd: PassCommand) -> PassResult:
        nonlocal baseline_plan, last
        if pairing is None:
            return backend.run_pass(cmd)
        out = pairing.run(backend, cmd, which)
        last = which
        if which == "baseline":  # a row is what ran: the baseline's own plan, not the one it was asked for
            baseline_plan = {k: (out.plan or {}).get(k) for k in BASELINE_PLAN_KEYS}
        return out

    def settle(which: str) -> None:
        """Paired passes switch shapes: the first pass after a switch pays for it (the other side's cached memory
        released, pages faulted in again: up to 1.5x slower on CPU), which a training loop never does. That pass runs
        untimed, so every timed pass follows one of its own shape."""
        nonlocal settled
        if pairing is None or last == which:
            return
        cmd = command(pairing.command_for if which == "baseline" else command_for)
        if last is not None:  # the other side ran last: release what it left cached, as a pass type's first run does
            cmd = cmd.replace(release_memory=True)
        run(which, cmd)
        settled += 1

    warm_compile = timed_compile = None
    if pairing is not None and pairing.warm:  # the baseline's warm-ups but one, before the point's; the settling pass
        for _ in range(warmup - 1):  # before its first timed pass is the last one
            run("baseline", command(pairing.command_for))
    for i in range(warmup):
        t0 = time.perf_counter()
        result = run("point", command().replace(memory_snapshot_dir=snapshot_dir))
        warm_compile = compiling.add(warm_compile, result.compile)
        log.info("%s%s warm-up %d/%d: %.2f s%s", label, pass_type, i + 1, warmup, time.perf_counter() - t0,
                 _compiled_phrase(result.compile))
    elapsed, walls, hosts, utils, mems, timelines = [], [], [], [], [], []
    base_elapsed: list[float] = []
    rank_peaks: Optional[list[Optional[int]]] = None
    allocated: Optional[list[Optional[int]]] = None
    reserved: Optional[list[Optional[int]]] = None
    device_used: Optional[list[Optional[int]]] = None
    sampler = make_sampler(backend, sample_interval_s)
    limit = max(repeat, max_repeats or repeat)

    def more() -> bool:
        if len(elapsed) < repeat:
            return True
        if len(elapsed) >= limit:
            return False
        if needs_more([real_tokens / t for t in elapsed], target_ci_pct):
            return True
        return pairing is not None and needs_more(_ratios(elapsed, base_elapsed), target_ci_pct)

    while more():
        i = len(elapsed)
        # pairs alternate their order (A B, B A, ...): a drift within a pair cancels over two pairs
        baseline_first = pairing is not None and i % 2 == 1
        if baseline_first:
            settle("baseline")
            base_elapsed.append(_timed(run("baseline", command(pairing.command_for))))
        settle("point")
        if sampler is not None:
            sampler.start()
        t0 = time.perf_counter()
        result = run("point", command())
        wall = time.perf_counter() - t0
        util, mem_pct = sampler.stop() if sampler is not None else (None, None)
        if pairing is not None and not baseline_first:
            settle("baseline")
            base_elapsed.append(_timed(run("baseline", command(pairing.command_for))))
        # The timed region the backend measured (the steps only); else the whole call.
        dt = result.step_s if result.step_s is not None else wall
        if sampler is not None:
            device_used = _max_per_rank(device_used, sampler.device_mem_used_bytes())
        allocated = _max_per_rank(allocated, result.mem_peak_allocated_bytes_per_rank)
        reserved = _max_per_rank(reserved, result.mem_peak_reserved_bytes_per_rank)
        walls.append(wall)
        hosts.append(max(0.0, wall - dt))
        if result.mem_peak_bytes is not None and backend.device.type == "cuda":
            mem_pct = 100.0 * result.mem_peak_bytes / backend.device_memory_bytes()
        rank_peaks = _max_per_rank(rank_peaks, result.mem_peak_bytes_per_rank)
        elapsed.append(dt)
        utils.append(util)
        mems.append(mem_pct)
        timed_compile = compiling.add(timed_compile, result.compile)
        timelines.append(result.timeline)
        if on_repeat is not None:
            on_repeat(pass_type, i, dt, real_tokens / dt, util)
        paired = (f", pair ratio {real_tokens / dt / (real_tokens / base_elapsed[-1]):.3f}"
                  if pairing is not None else "")
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
    assert result is not None
    if timed_compile and timed_compile["compilations"] + timed_compile["backward_compilations"]:
        log.warning("%s%s: compiled %d graph(s) during the timed repeats (%.1f s, inside their tok/s); "
                    "raise bench.warmup so the warm-up sees every shape", label, pass_type,
                    timed_compile["compilations"] + timed_compile["backward_compilations"], timed_compile["compile_s"])
    mean = sum(elapsed) / len(elapsed)
    known = [u for u in utils if u is not None]
    known_mem = [m for m in mems if m is not None]
    record = PassRecord(
        elapsed_s=elapsed,
        tok_per_s=real_tokens / mean,
        util_pct=(sum(known) / len(known)) if known else None,
        mem_pct=max(known_mem) if known_mem else None,
        real_tokens=real_tokens,
        grad_norm=result.grad_norm,
        mem_peak_bytes=rank_peaks,
        mem_peak_allocated_bytes=allocated,
        mem_peak_reserved_bytes=reserved,
        device_mem_used_bytes=device_used,
        pass_wall_s=walls,
        host_s=hosts,
        kernels=result.kernels,
        compile=None if warm_compile is None and timed_compile is None else {"warmup": warm_compile,
                                                                             "timed": timed_compile},
        timeline=timeline_record(timelines),
        target_ci_pct=target_ci_pct,
        baseline_elapsed_s=base_elapsed if pairing is not None else None,
        baseline_plan=baseline_plan,
        settling_passes=settled if pairing is not None else None,
    )
    _log_spread(label, pass_type, record, repeat)
    if record.spread_fields()["target_ci_reached"] is False:
        _log_target_missed(label, pass_type, record, limit)
    return record, result


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


def _timed(result: PassResult) -> float:
    if result.step_s is None:
        raise RuntimeError("a paired baseline pass needs the backend's timed region (PassResult.step_s)")
    return result.step_s


def _ratios(elapsed: Sequence[float], base_elapsed: Sequence[float]) -> list[float]:
    """Pair ratios of throughput (point ÷ baseline) for the pairs both sides of which have run."""
    return [b / e for e, b in zip(elapsed, base_elapsed)]


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


def _compiled_phrase(record: Optional[dict]) -> str:
    """", compiled 12 graphs in 40.1 s (3 graph breaks)" for a pass that compiled, else ""."""
    if not record or not record["compilations"] + record["backward_compilations"]:
        return ""
    graphs = record["compilations"] + record["backward_compilations"]
    return f", compiled {graphs} graph(s) in {record['compile_s']:.1f} s ({record['graph_breaks']} graph breaks)"


def merge_records(first: PassRecord, more: PassRecord) -> PassRecord:
    """One pass type's record over the timed repeats of both (``more`` ran after ``first``, same commands)."""
    elapsed = first.elapsed_s + more.elapsed_s
    utils = [(r.util_pct, len(r.elapsed_s)) for r in (first, more) if r.util_pct is not None]
    mems = [m for m in (first.mem_pct, more.mem_pct) if m is not None]
    return PassRecord(
        elapsed_s=elapsed,
        tok_per_s=first.real_tokens / (sum(elapsed) / len(elapsed)),
        util_pct=sum(u * n for u, n in utils) / sum(n for _, n in utils) if utils else None,
        mem_pct=max(mems) if mems else None,
        real_tokens=first.real_tokens,
        grad_norm=more.grad_norm,
        mem_peak_bytes=_max_per_rank(first.mem_peak_bytes, more.mem_peak_bytes),
        mem_peak_allocated_bytes=_max_per_rank(first.mem_peak_allocated_bytes, more.mem_peak_allocated_bytes),
        mem_peak_reserved_bytes=_max_per_rank(first.mem_peak_reserved_bytes, more.mem_peak_reserved_bytes),
        device_mem_used_bytes=_max_per_rank(first.device_mem_used_bytes, more.device_mem_used_bytes),
        pass_wall_s=(first.pass_wall_s or []) + (more.pass_wall_s or []),
        host_s=(first.host_s or []) + (more.host_s or []),
        kernels=more.kernels,
        compile=_added_compile(first.compile, more.compile),
        timeline=merge_timelines(first.timeline, more.timeline),
        target_ci_pct=more.target_ci_pct or first.target_ci_pct,
        baseline_elapsed_s=(None if first.baseline_elapsed_s is None or more.baseline_elapsed_s is None
                            else first.baseline_elapsed_s + more.baseline_elapsed_s),
        baseline_plan=more.baseline_plan or first.baseline_plan,
        settling_passes=(None if first.settling_passes is None or more.settling_passes is None
                         else first.settling_passes + more.settling_passes),
    )


def _added_compile(first: Optional[dict], more: Optional[dict]) -> Optional[dict]:
    if not first or not more:
        return first or more
    return {"warmup": compiling.add(first["warmup"], more["warmup"]),
            "timed": compiling.add(first["timed"], more["timed"])}


PROFILE_DIR = "profile"  # in the point's folder: <pass>-rank<r>.json.gz


def profile_pass(backend: Backend, pass_type: str, command_for: Callable[[str], PassCommand], out_dir,
                 timed_s: Optional[Sequence[float]] = None, label: str = "") -> dict:
    """One more run of ``pass_type`` under torch.profiler, after its timed repeats (not counted in tok/s).

    Returns ``passes.<type>.profile``: the traces (relative to ``out_dir``), the profiled pass's seconds and
    its breakdown's shares per rank, the shares averaged over ranks (they sum to 1) and each rank's top ops;
    ``slowdown``: the profiled run's timed region over the mean of ``timed_s`` (the profiler's own cost).
    """
    from pathlib import Path

    out_dir = Path(out_dir).resolve()  # every rank writes there, whatever its working folder
    t0 = time.perf_counter()
    result = backend.run_pass(
        command_for(pass_type).replace(profile_dir=str(out_dir / PROFILE_DIR), release_memory=False)
    )
    ranks = result.profile or []
    if not ranks or any(r is None for r in ranks):
        raise RuntimeError(f"{pass_type}: the backend ran the profiled pass but returned no profile for every rank")
    shares = {k: sum(r["breakdown"]["shares"][k] for r in ranks) / len(ranks) for k in ranks[0]["breakdown"]["shares"]}
    record = {
        # beside results.json (a rank on another node wrote its trace there, on its own disk)
        "traces": [os.path.relpath(r["trace"], out_dir) for r in ranks],
        "elapsed_s": result.step_s,
        "slowdown": result.step_s / (sum(timed_s) / len(timed_s)) if timed_s and result.step_s else None,
        "shares": shares,
        "per_rank": [{"rank": i, **r["breakdown"]} for i, r in enumerate(ranks)],
    }
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:3]
    log.info("%s%s profiled (%.1f s with the trace): %s; traces in %s", label, pass_type, time.perf_counter() - t0,
             ", ".join(f"{k} {100 * v:.0f}%" for k, v in top), out_dir / PROFILE_DIR)
    return record


def _max_per_rank(
    so_far: Optional[list[Optional[int]]], new: Optional[list[Optional[int]]]
) -> Optional[list[Optional[int]]]:
    if not new:
        return so_far
    if not so_far or len(so_far) != len(new):
        return list(new)
    return [b if a is None else a if b is None else max(a, b) for a, b in zip(so_far, new)]


def default_command_for(
    examples: Sequence[Example], mtpm: Optional[int], mbs: int, **options
) -> Callable[[str], PassCommand]:
    """Commands with a fixed budget; ``options`` are make_command's (layout, planner, the cap on sequences per
    micro-batch, progress interval, time-out)."""
    return lambda pass_type: make_command(pass_type, examples, mtpm, mbs, **options)


__all__ = ["PASS_TYPES", "Pairing", "PassRecord", "measure_pass", "merge_records", "default_command_for",
           "profile_pass"]
