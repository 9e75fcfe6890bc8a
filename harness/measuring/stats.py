"""The timed repeats of one pass type as they come in: seconds, wall and host time, utilisation, memory peaks per
rank, what compiling cost, the ranks' step times and the paired baseline's seconds; whether the interval asks for
more repeats; and the PassRecord they make."""

from __future__ import annotations

from typing import Optional, Sequence

from backends.messages import PassResult
from backends.model import compiling
from harness.measuring.records import PassRecord, max_per_rank
from harness.metrics.balance import timeline_record
from harness.metrics.spread import needs_more


class RepeatStats:
    """What the timed repeats of one pass type measured so far (``paired``: each beside a baseline pass)."""

    def __init__(self, real_tokens: int, paired: bool):
        self.real_tokens = real_tokens
        self.paired = paired
        self.elapsed: list[float] = []
        self.base_elapsed: list[float] = []
        self.walls: list[float] = []
        self.hosts: list[float] = []
        self.utils: list[Optional[float]] = []
        self.mems: list[Optional[float]] = []
        self.timelines: list = []
        self.rank_peaks: Optional[list[Optional[int]]] = None
        self.allocated: Optional[list[Optional[int]]] = None
        self.reserved: Optional[list[Optional[int]]] = None
        self.device_used: Optional[list[Optional[int]]] = None
        self.timed_compile: Optional[dict] = None

    @property
    def count(self) -> int:
        return len(self.elapsed)

    def more(self, repeat: int, limit: int, target_ci_pct: Optional[float]) -> bool:
        """At least ``repeat``, at most ``limit``; in between, while an interval is wider than ``target_ci_pct``."""
        if len(self.elapsed) < repeat:
            return True
        if len(self.elapsed) >= limit:
            return False
        if needs_more([self.real_tokens / t for t in self.elapsed], target_ci_pct):
            return True
        return self.paired and needs_more(_ratios(self.elapsed, self.base_elapsed), target_ci_pct)

    def add_baseline(self, seconds: float) -> None:
        self.base_elapsed.append(seconds)

    def add(self, result: PassResult, wall: float, util: Optional[float], mem_pct: Optional[float], sampler,
            backend) -> float:
        """One timed pass of the point; its seconds: the timed region the backend measured (the steps only), else
        the whole call."""
        dt = result.step_s if result.step_s is not None else wall
        if sampler is not None:
            self.device_used = max_per_rank(self.device_used, sampler.device_mem_used_bytes())
        self.allocated = max_per_rank(self.allocated, result.mem_peak_allocated_bytes_per_rank)
        self.reserved = max_per_rank(self.reserved, result.mem_peak_reserved_bytes_per_rank)
        self.walls.append(wall)
        self.hosts.append(max(0.0, wall - dt))
        if result.mem_peak_bytes is not None and backend.device.type == "cuda":
            mem_pct = 100.0 * result.mem_peak_bytes / backend.device_memory_bytes()
        self.rank_peaks = max_per_rank(self.rank_peaks, result.mem_peak_bytes_per_rank)
        self.elapsed.append(dt)
        self.utils.append(util)
        self.mems.append(mem_pct)
        self.timed_compile = compiling.add(self.timed_compile, result.compile)
        self.timelines.append(result.timeline)
        return dt

    def record(self, last: PassResult, warm_compile: Optional[dict], target_ci_pct: Optional[float],
               baseline_plan: Optional[dict], settled: int) -> PassRecord:
        """The pass type's record (``last``: the last timed result: its gradient norm and kernels)."""
        mean = sum(self.elapsed) / len(self.elapsed)
        known = [u for u in self.utils if u is not None]
        known_mem = [m for m in self.mems if m is not None]
        timed = self.timed_compile
        return PassRecord(
            elapsed_s=self.elapsed,
            tok_per_s=self.real_tokens / mean,
            util_pct=(sum(known) / len(known)) if known else None,
            mem_pct=max(known_mem) if known_mem else None,
            real_tokens=self.real_tokens,
            grad_norm=last.grad_norm,
            mem_peak_bytes=self.rank_peaks,
            mem_peak_allocated_bytes=self.allocated,
            mem_peak_reserved_bytes=self.reserved,
            device_mem_used_bytes=self.device_used,
            pass_wall_s=self.walls,
            host_s=self.hosts,
            kernels=last.kernels,
            compile=None if warm_compile is None and timed is None else {"warmup": warm_compile, "timed": timed},
            timeline=timeline_record(self.timelines),
            target_ci_pct=target_ci_pct,
            baseline_elapsed_s=self.base_elapsed if self.paired else None,
            baseline_plan=baseline_plan,
            settling_passes=settled if self.paired else None,
        )


def _ratios(elapsed: Sequence[float], base_elapsed: Sequence[float]) -> list[float]:
    """Pair ratios of throughput (point ÷ baseline) for the pairs both sides of which have run."""
    return [b / e for e, b in zip(elapsed, base_elapsed)]
