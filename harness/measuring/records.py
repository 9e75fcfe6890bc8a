"""One pass type's measurements as results.json holds them (PassRecord), and two records of the same commands
merged into one (more repeats measured after the first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from backends.model import compiling
from harness.metrics.balance import merge_timelines
from harness.metrics.spread import METHOD, needs_more, paired_speedup, summary


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
    # What ran in the last timed repeat: {op: {implementation: calls}} over all ranks (the library's kernels.py).
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
        mem_peak_bytes=max_per_rank(first.mem_peak_bytes, more.mem_peak_bytes),
        mem_peak_allocated_bytes=max_per_rank(first.mem_peak_allocated_bytes, more.mem_peak_allocated_bytes),
        mem_peak_reserved_bytes=max_per_rank(first.mem_peak_reserved_bytes, more.mem_peak_reserved_bytes),
        device_mem_used_bytes=max_per_rank(first.device_mem_used_bytes, more.device_mem_used_bytes),
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


def max_per_rank(
    so_far: Optional[list[Optional[int]]], new: Optional[list[Optional[int]]]
) -> Optional[list[Optional[int]]]:
    if not new:
        return so_far
    if not so_far or len(so_far) != len(new):
        return list(new)
    return [b if a is None else a if b is None else max(a, b) for a, b in zip(so_far, new)]
