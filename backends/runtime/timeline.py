"""One rank's clock over one pass: when each micro-batch step started and ended, and how much of it the rank was busy.

``StepClock`` is started where the timed region starts, marked where each step
starts and where the last one ends, and finished once the device is
synchronized. On a GPU the marks are CUDA events on the current stream, read
once at the end (no synchronization per step), so a step's time is the
device's. On a CPU they are the host's ``perf_counter``. A step's busy time
is its time, except where the step itself holds collectives: FSDP2's
all-gathers and reduce-scatters run inside every step, and a rank blocked in
one (waiting for a slower rank) spends wall time but no CPU time, so on CPU
ranks of a lock-step backend the busy time is the rank's own thread CPU time
(``time.thread_time``). That holds while each rank computes on one thread (2
CPU ranks on 2 cores here); with more intra-op threads a thread's CPU time
would miss their work, and the busy time is the wall time. Megatron DDP and
PyTorch hold no collective inside a step: their busy time is the step's, and
a Megatron rank's waiting is its gradient sync after the last step
(``sync_s``). ``busy_clock`` says which clock was used.
"""

from __future__ import annotations

import time

import torch

# Rounded in results.json: a microsecond is well below what a step's time means on either clock.
_DIGITS = 6


def busy_clock(device: torch.device, lockstep: bool) -> str:
    """What a step's busy time is measured with (results.json ``timeline.busy_clock``): see the module docstring."""
    if device.type == "cuda":
        return "cuda-events"  # device time: FSDP2's waits for its all-gathers are inside it
    if lockstep and torch.get_num_threads() == 1:
        return "thread-cpu"  # collectives inside the step: blocked time is not busy
    return "wall"  # no collective inside a step, or intra-op threads the calling thread's CPU time would miss


def step_clock_name(device: torch.device) -> str:
    """What a step's (wall) time is measured with: CUDA events on a GPU, the host's clock on a CPU."""
    return "cuda-events" if device.type == "cuda" else "perf_counter"


class StepClock:
    """Marks of one rank's pass: ``start()`` where the timed region starts, ``mark()`` before each step and after
    the last one, ``finish()`` after the device is synchronized, which returns the rank's timeline."""

    def __init__(self, device: torch.device, lockstep: bool = False, on_step_end=None):
        self.cuda = device.type == "cuda"
        self.on_step_end = on_step_end  # called where each step ends (bench.profile's window moves on)
        self.busy = busy_clock(device, lockstep)
        self._wall: list[float] = []
        self._cpu: list[float] = []
        self._events: list = []
        self._t0 = self._cpu0 = 0.0
        self._start_event = None

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._t0, self._cpu0 = time.perf_counter(), time.thread_time()
        if self.cuda:
            self._start_event = self._event()

    def mark(self) -> None:
        """A step starts here (or, after the last step, the steps end here)."""
        if self._wall and self.on_step_end is not None:
            self.on_step_end()
        self._wall.append(time.perf_counter())
        self._cpu.append(time.thread_time())
        if self.cuda:
            self._events.append(self._event())

    def finish(self, end_event=None) -> dict:
        """This rank's timeline, in seconds: ``start_s`` (before the first step), ``step_s`` and ``busy_s`` per step,
        ``sync_s`` (after the last step: the gradient sync and norm) and ``elapsed_s`` (the whole timed region).

        Call it after the device is synchronized; on a GPU ``end_event`` (recorded where the region ends, before the
        synchronization) times ``sync_s`` on the device too.
        """
        t_end = time.perf_counter()
        elapsed = t_end - self._t0
        if not self._wall:  # no step at all (a rank with nothing to run on an independent backend)
            return _rounded(0.0, [], [], elapsed, elapsed)
        if self.cuda:
            ms = [a.elapsed_time(b) / 1000.0 for a, b in zip(self._events, self._events[1:])]
            start = self._start_event.elapsed_time(self._events[0]) / 1000.0
            sync = (
                (self._events[-1].elapsed_time(end_event) / 1000.0) if end_event is not None else t_end - self._wall[-1]
            )
            return _rounded(start, ms, ms, sync, elapsed)
        steps = [b - a for a, b in zip(self._wall, self._wall[1:])]
        busy = [b - a for a, b in zip(self._cpu, self._cpu[1:])] if self.busy == "thread-cpu" else steps
        return _rounded(self._wall[0] - self._t0, steps, busy, t_end - self._wall[-1], elapsed)

    def end_event(self):
        """A CUDA event where the timed region ends (None on a CPU): pass it to ``finish``."""
        return self._event() if self.cuda else None


def _rounded(start: float, steps: list[float], busy: list[float], sync: float, elapsed: float) -> dict:
    r = lambda x: round(float(x), _DIGITS)  # noqa: E731
    return {"start_s": r(start), "step_s": [r(x) for x in steps], "busy_s": [r(x) for x in busy], "sync_s": r(sync),
            "elapsed_s": r(elapsed)}
