"""Rank hooks that inject faults into real worker processes (imported by path inside the workers)."""

from __future__ import annotations

import os
import time

from backends.fsdp2 import FSDP2Hooks
from backends.megatron_ddp import MegatronDDPHooks


class _RaiseMidPass:
    """Rank 1 raises on its second step of a forward_backward pass."""

    def start_pass(self, model, pass_type):
        self._pass_type = pass_type
        super().start_pass(model, pass_type)

    def before_step(self, model, step, is_last):
        super().before_step(model, step, is_last)
        if self.rank == 1 and step == 1 and self._pass_type == "forward_backward":
            raise RuntimeError("injected failure on purpose")


class FSDP2RaiseMidPass(_RaiseMidPass, FSDP2Hooks):
    pass


class MegatronRaiseMidPass(_RaiseMidPass, MegatronDDPHooks):
    pass


class FSDP2HangMidPass(FSDP2Hooks):
    """Rank 1 sleeps far past any time-out on its first forward step; its pid is left in a file for the test."""

    def before_step(self, model, step, is_last):
        super().before_step(model, step, is_last)
        if self.rank == 1:
            path = os.environ.get("BALANCE_BATCH_TEST_PIDFILE")
            if path:
                with open(path, "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(3600)


class FSDP2Rank1DropsItsDummies(FSDP2Hooks):
    """Rank 1 pads its schedule, then drops the dummy steps: its step count differs from rank 0's."""

    def pad(self, local):
        schedule = super().pad(local)
        return [b for b in schedule if b is not None] if self.rank == 1 else schedule


class FSDP2HangAtStartUp(FSDP2Hooks):
    """Every rank sleeps far past any deadline before joining the process group (as a rank does that could not
    start a thread of gloo's under a memory limit)."""

    def setup(self):
        time.sleep(3600)


class FSDP2OutOfMemoryInTraining(FSDP2Hooks):
    """Every forward_backward pass runs out of memory on every rank (as under a limit no budget fits)."""

    def start_pass(self, model, pass_type):
        super().start_pass(model, pass_type)
        if pass_type == "forward_backward":
            raise MemoryError("injected: out of memory")


class FSDP2ForwardOutOfMemory(FSDP2Hooks):
    """Every forward pass runs out of memory on every rank; with BALANCE_BATCH_TEST_OOM_ONCE naming a file, only
    while that file does not exist (the first such pass creates it: ranks started after it run). mtpm=auto's search
    runs fwd+bwd alone, so the chosen budget's final forward pass is the one refused."""

    def start_pass(self, model, pass_type):
        super().start_pass(model, pass_type)
        once = os.environ.get("BALANCE_BATCH_TEST_OOM_ONCE")
        if pass_type != "forward" or (once and os.path.exists(once)):
            return
        if once and self.rank == 0:
            open(once, "w").close()
        raise MemoryError("injected: out of memory")


class FSDP2HangAtItsMemoryLimit(FSDP2Hooks):
    """Every rank maps (without touching) all but 16 MiB of what bench.memory_limit_gb leaves it, then waits before
    joining the process group: a rank too close to its limit to start a thread, as gloo's set-up left one."""

    def setup(self):
        import mmap

        with open("/proc/self/status") as f:
            data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        room = int(self.spec.memory_limit_gb * 1024**3) - data - 16 * 1024**2
        self._held = mmap.mmap(-1, room, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        time.sleep(3600)
