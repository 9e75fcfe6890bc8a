"""One rank's clock over one pass: when each micro-batch step started and ended, and how much of it the rank was busy.

``StepClock`` is started where the timed region starts, marked where each step
starts and where the last one ends, and finished once the device is
synchronized. On a GPU the marks are CUDA events on the current stream, read
once at the end (no synchronization per step), so a step's time is the
device's. On a CPU they are the host's ``perf_counter``.

A step's busy time is its time less the time the rank spent waiting in the
collectives the step itself holds. FSDP2's all-gathers and reduce-scatters run
inside every step, and a rank whose peer is slower waits in them: on a CPU
(gloo) the host blocks in the work's ``wait``; on a GPU the compute stream
waits on the collective's event (``wait_event``), so a CUDA-event step time
on that stream includes the wait and would read every rank as busy whatever
the imbalance. ``CollectiveWaits`` times the backend's wait points (FSDP2:
each parameter group's ``wait_for_unshard``, ``post_backward`` and
``finalize_backward``, where the host or the compute stream waits for an
all-gather or a reduce-scatter) with the step's own clock: ``perf_counter``
around the call on a CPU, a pair of CUDA events on the current stream around
it on a GPU (the second event completes only once the stream has passed the
wait). The same definition on both: busy = the step less its collective waits
(a slower peer, the transfer not hidden behind compute, FSDP2's copy-in and
copy-out), recorded apart as ``wait_s``. Megatron DDP and PyTorch hold no
collective inside a step: their busy time is the step's, and a Megatron
rank's waiting is its gradient sync after the last step (``sync_s``).
``busy_clock`` says which clock was used.
"""

from __future__ import annotations

import time

import torch

# Rounded in results.json: a microsecond is well below what a step's time means on either clock.
_DIGITS = 6


def busy_clock(device: torch.device, lockstep: bool) -> str:
    """What a step's busy time is measured with (results.json ``timeline.busy_clock``): see the module docstring."""
    clock = "cuda-events" if device.type == "cuda" else "wall"
    return f"{clock} less collective waits" if lockstep else clock


def step_clock_name(device: torch.device) -> str:
    """What a step's (wall) time is measured with: CUDA events on a GPU, the host's clock on a CPU."""
    return "cuda-events" if device.type == "cuda" else "perf_counter"


class CollectiveWaits:
    """Inside a ``with`` block, the time spent in ``points`` (``(object, method name)`` pairs: a backend's collective
    waits) is counted, and ``take()`` hands over what was counted since the last take.

    On a CPU: host seconds (float). On a GPU: the (start, end) CUDA event pairs recorded around each call on the
    current stream, read once the device is synchronized (``waited_s``). A wait inside another is counted once.
    """

    def __init__(self, points, device: torch.device):
        self.points = list(points)
        self.cuda = device.type == "cuda"
        self._s = 0.0
        self._pairs: list = []
        self._depth = 0
        self._saved: list = []

    def __enter__(self) -> "CollectiveWaits":
        for obj, name in self.points:
            own = name in vars(obj)
            original = getattr(obj, name)
            setattr(obj, name, self._timed(original))
            self._saved.append((obj, name, own, original))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, own, original in reversed(self._saved):
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)  # the class's method again
        self._saved.clear()

    def _timed(self, original):
        def timed(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            start = _cuda_event() if self.cuda else time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self.cuda:
                    self._pairs.append((start, _cuda_event()))
                else:
                    self._s += time.perf_counter() - start

        return timed

    def take(self):
        """What was counted since the last take: seconds on a CPU, event pairs on a GPU."""
        if self.cuda:
            taken, self._pairs = self._pairs, []
            return taken
        taken, self._s = self._s, 0.0
        return taken


def waited_s(taken) -> float:
    """The seconds in one ``CollectiveWaits.take()`` (CUDA pairs are read: call it after synchronizing)."""
    if isinstance(taken, float):
        return taken
    return sum(a.elapsed_time(b) for a, b in taken) / 1000.0


def _cuda_event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepClock:
    """Marks of one rank's pass: ``start()`` where the timed region starts, ``mark()`` before each step and after
    the last one, ``finish()`` after the device is synchronized, which returns the rank's timeline."""

    def __init__(self, device: torch.device, lockstep: bool = False, on_step_end=None,
                 waits: "CollectiveWaits | None" = None):
        self.cuda = device.type == "cuda"
        self.on_step_end = on_step_end  # called where each step ends (bench.profile's window moves on)
        self.busy = busy_clock(device, lockstep)
        self.waits = waits  # the backend's collective waits, counted inside its steps (None: none there)
        self._wall: list[float] = []
        self._waited: list = []  # per step, CollectiveWaits.take() where the step ends
        self._events: list = []
        self._t0 = 0.0
        self._start_event = None

    def _event(self):
        return _cuda_event()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.cuda:
            self._start_event = self._event()

    def mark(self) -> None:
        """A step starts here (or, after the last step, the steps end here)."""
        if self._wall and self.on_step_end is not None:
            self.on_step_end()
        self._wall.append(time.perf_counter())
        if self.cuda:
            self._events.append(self._event())
        if self.waits is not None:
            taken = self.waits.take()
            if len(self._wall) > 1:  # the first mark's take is what came before the first step
                self._waited.append(taken)

    def finish(self, end_event=None) -> dict:
        """This rank's timeline, in seconds: ``start_s`` (before the first step), ``step_s`` and ``busy_s`` per step,
        ``wait_s`` per step (its collective waits, where counted), ``sync_s`` (after the last step: the gradient sync
        and norm) and ``elapsed_s`` (the whole timed region).

        Call it after the device is synchronized; on a GPU ``end_event`` (recorded where the region ends, before the
        synchronization) times ``sync_s`` on the device too.
        """
        t_end = time.perf_counter()
        elapsed = t_end - self._t0
        if not self._wall:  # no step at all (a rank with nothing to run on an independent backend)
            return _rounded(0.0, [], [], [], elapsed, elapsed)
        if self.cuda:
            steps = [a.elapsed_time(b) / 1000.0 for a, b in zip(self._events, self._events[1:])]
            start = self._start_event.elapsed_time(self._events[0]) / 1000.0
            sync = (
                (self._events[-1].elapsed_time(end_event) / 1000.0) if end_event is not None else t_end - self._wall[-1]
            )
        else:
            steps = [b - a for a, b in zip(self._wall, self._wall[1:])]
            start, sync = self._wall[0] - self._t0, t_end - self._wall[-1]
        waits = [min(waited_s(w), t) for w, t in zip(self._waited, steps)] if self.waits is not None else []
        busy = [t - w for t, w in zip(steps, waits)] if waits else steps
        return _rounded(start, steps, busy, waits, sync, elapsed)

    def end_event(self):
        """A CUDA event where the timed region ends (None on a CPU): pass it to ``finish``."""
        return self._event() if self.cuda else None


def _rounded(start: float, steps: list[float], busy: list[float], waits: list[float], sync: float,
             elapsed: float) -> dict:
    r = lambda x: round(float(x), _DIGITS)  # noqa: E731
    out = {"start_s": r(start), "step_s": [r(x) for x in steps], "busy_s": [r(x) for x in busy], "sync_s": r(sync),
           "elapsed_s": r(elapsed)}
    if waits:
        out["wait_s"] = [r(x) for x in waits]
    return out
