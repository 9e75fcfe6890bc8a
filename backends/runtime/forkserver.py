"""Where spawned ranks come from: a fork server that imported the ranks' heavy modules once, per controller process.

A rank started with ``spawn`` imports torch, transformers, peft and
megatron-core again (about 7 s of CPU on this project's 2-core machine, paid by
every rank of every backend start). The fork server imports them once
(megatron-core only where its ranks may be megatron_ddp's: ``preloads``), in a
clean process of its own (no CUDA context, no thread pools: it only imports),
and forks each rank from there. A CUDA context made before a fork is unusable in
the child ("Cannot re-initialize CUDA in forked subprocess"), so the server
imports nothing that touches CUDA at import: not the model's modeling module,
which imports the kernel packages (fla 0.6.0's ``fla/utils/hardware.py`` calls
``torch.cuda.get_device_capability()`` at import), and any
``torch.cuda.is_available()`` a module calls at import asks NVML, not the CUDA
driver. Each rank imports the modeling module itself, after its fork: 0.03 s of
CPU without fla, about 3 s with fla 0.6.0 and Triton (2026-12-04, this 2-core
machine, loaded). Spawning the ranks instead would import everything again in
every rank, about 7 s of CPU each, and that 3 s as well. What a spawned rank saw
is kept: its environment is the controller's at the start
(``apply_environment``), not the fork server's, and its imports come from the
controller's ``sys.path``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import warnings
from collections.abc import Iterable
from typing import Optional

# Imported by the fork server alone, before it forks any rank: importing it calls ``warm``.
_PRELOAD = "backends.runtime.preload"

# Whether this process has asked for the context that starts ranks (start_early only starts the server)
_ranks_asked = False


def preloads(backend: Optional[str] = None) -> list[str]:
    """What the fork server imports before it forks a rank, in order: every backend's modules (``_PRELOAD``), then
    the registry's ``rank_preload`` of ``backend``, or of every backend when it is not known. A server started for
    fsdp2's ranks leaves megatron-core out (its CPU: docs/development.md, "Where the time goes"); megatron_ddp ranks
    it forks later (a sweep over both) import it themselves, as any rank imports what its server did not."""
    from backends.registry import BACKENDS, BY_NAME

    entries = [BY_NAME[backend]] if backend in BY_NAME else BACKENDS
    return [_PRELOAD, *dict.fromkeys(e.rank_preload for e in entries if e.rank_preload)]


def _context(backend: Optional[str] = None):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preloads(backend))  # read only when the server starts: a running one is kept
    return ctx


def rank_context(backend: Optional[str] = None):
    """The multiprocessing context that starts ``backend``'s ranks: the fork server, preloading ``preloads``."""
    global _ranks_asked
    _ranks_asked = True
    return _context(backend)


def is_fork_server(cmdline: str) -> bool:
    """Whether a process's command line is a multiprocessing fork server's (and so of every rank it forked)."""
    return "multiprocessing.forkserver" in cmdline


def apply_environment(environ: dict[str, str]) -> None:
    """Give a forked rank the environment its controller had when it started it (as ``spawn`` would)."""
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


def release_fork_server() -> None:
    """In a forked rank: drop the rank's copy of the fork server's liveness pipe.

    multiprocessing hands every process its fork server forks the write end of the pipe the server watches (so
    that process could ask the same server for children of its own), and the server leaves only when every
    copy is closed. A rank keeping its copy keeps the server alive after the controller dies, and the rank,
    which dies with the server (``die_with_parent``), then outlives both: a Ctrl-C while ranks were starting
    left a fork server and a rank behind for as long as the rank waited on its store. Ranks start no processes.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    server._forkserver_alive_fd = None
    try:
        os.close(fd)
    except OSError:
        pass


def warm() -> None:
    """Import what every rank imports and nothing that can make a CUDA context (the module docstring says why);
    a module that fails here fails again, with its message, in the rank."""
    # Read by torch.cuda.is_available() when it is called: NVML answers without initialising the CUDA driver. The
    # server's environment only: a forked rank gets its controller's back (apply_environment).
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import_each(("backends.fsdp2", "backends.megatron_ddp", "backends.model.build", "backends.model.compiling",
                 "peft", "torch.distributed.fsdp", "torch.distributed.device_mesh"))


def import_each(names: Iterable[str]) -> None:
    """Import each module; one that fails here fails again, with its message, in the rank that needs it."""
    for name in names:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a rank that needs it imports it again and reports the error itself
            pass


def leave_now() -> None:
    """The fork server's exit without the interpreter's teardown: its streams flushed, then ``os._exit(0)``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def start_early(backend: Optional[str] = None) -> None:
    """Start the fork server for ``backend``'s ranks (None: any backend's) now, so its imports run beside the
    controller's own work (about 7 s of CPU on the other core) instead of before the first rank; a later
    ``rank_context`` process finds it running."""
    from multiprocessing import forkserver

    _context(backend)
    forkserver.ensure_running()


def ranks_asked() -> bool:
    """Whether this process has asked for ``rank_context`` (``start_early`` alone only starts the server)."""
    return _ranks_asked
