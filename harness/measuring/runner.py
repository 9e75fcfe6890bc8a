"""How the passes of one pass type run while they are measured: each command numbered (the first releases cached
memory), the point's side or the paired baseline's (Pairing: mbs=1 fixed slices, set in the backend's control file
where it has one), the untimed settling pass after a switch of shape, the warm-up, and one timed pass of each side.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from backends.backend import Backend
from backends.messages import PassCommand, PassResult
from backends.model import compiling

log = logging.getLogger("harness.measure")


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

class PairedRunner:
    """The passes of one pass type, the point's and (with a pairing) the baseline's, as measure_pass runs them."""

    def __init__(self, backend: Backend, pass_type: str, command_for: Callable[[str], PassCommand],
                 pairing: Optional[Pairing], release_first: bool):
        self.backend = backend
        self.pass_type = pass_type
        self.command_for = command_for
        self.pairing = pairing
        self.release_first = release_first
        self.runs = 0
        self.last: Optional[str] = None  # which side ran the backend's last pass ("point" or "baseline"); None: unknown
        self.settled = 0  # settling passes run
        self.baseline_plan: Optional[dict] = None  # what the baseline's passes ran

    def command(self, make: Optional[Callable[[str], PassCommand]] = None) -> PassCommand:
        # Cached memory is released once, before this pass type's first run (so the peak is this pass's, not
        # what an earlier point or pass left); later runs keep it, as the steps of a training loop do: releasing
        # before every timed repeat would time the allocator's (and the kernel's) cold start each time.
        self.runs += 1
        return (make or self.command_for)(self.pass_type).replace(release_memory=self.runs == 1 and self.release_first)

    def run(self, which: str, cmd: PassCommand) -> PassResult:
        pairing = self.pairing
        if pairing is None:
            return self.backend.run_pass(cmd)
        out = pairing.run(self.backend, cmd, which)
        self.last = which
        if which == "baseline":  # a row is what ran: the baseline's own plan, not the one it was asked for
            self.baseline_plan = {k: (out.plan or {}).get(k) for k in BASELINE_PLAN_KEYS}
        return out

    def settle(self, which: str) -> None:
        """Paired passes switch shapes: the first pass after a switch pays for it (the other side's cached memory
        released, pages faulted in again: up to 1.5x slower on CPU), which a training loop never does. That pass runs
        untimed, so every timed pass follows one of its own shape."""
        pairing = self.pairing
        if pairing is None or self.last == which:
            return
        cmd = self.command(pairing.command_for if which == "baseline" else self.command_for)
        if self.last is not None:  # the other side ran last: release what it left cached, as a first run does
            cmd = cmd.replace(release_memory=True)
        self.run(which, cmd)
        self.settled += 1

    def warm_up(self, warmup: int, snapshot_dir: Optional[str],
                label: str) -> tuple[Optional[PassResult], Optional[dict]]:
        """The warm-up runs (the baseline's first, with a pairing); the last result and what compiling cost."""
        pairing = self.pairing
        result, compiled = None, None
        if pairing is not None and pairing.warm:  # the baseline's warm-ups but one, before the point's; the settling
            for _ in range(warmup - 1):  # pass before its first timed pass is the last one
                self.run("baseline", self.command(pairing.command_for))
        for i in range(warmup):
            t0 = time.perf_counter()
            result = self.run("point", self.command().replace(memory_snapshot_dir=snapshot_dir))
            compiled = compiling.add(compiled, result.compile)
            log.info("%s%s warm-up %d/%d: %.2f s%s", label, self.pass_type, i + 1, warmup, time.perf_counter() - t0,
                     compiled_phrase(result.compile))
        return result, compiled

    def timed_baseline(self) -> float:
        """One timed baseline pass after its settling pass: the seconds of its timed region."""
        self.settle("baseline")
        result = self.run("baseline", self.command(self.pairing.command_for))
        if result.step_s is None:
            raise RuntimeError("a paired baseline pass needs the backend's timed region (PassResult.step_s)")
        return result.step_s

    def timed_point(self, sampler) -> tuple[PassResult, float, Optional[float], Optional[float]]:
        """One timed pass of the point after its settling pass: its result, wall seconds, and the devices'
        utilisation and memory the sampler saw (None without one)."""
        self.settle("point")
        if sampler is not None:
            sampler.start()
        t0 = time.perf_counter()
        result = self.run("point", self.command())
        wall = time.perf_counter() - t0
        util, mem_pct = sampler.stop() if sampler is not None else (None, None)
        return result, wall, util, mem_pct


def compiled_phrase(record: Optional[dict]) -> str:
    """", compiled 12 graphs in 40.1 s (3 graph breaks)" for a pass that compiled, else ""."""
    if not record or not record["compilations"] + record["backward_compilations"]:
        return ""
    graphs = record["compilations"] + record["backward_compilations"]
    return f", compiled {graphs} graph(s) in {record['compile_s']:.1f} s ({record['graph_breaks']} graph breaks)"
