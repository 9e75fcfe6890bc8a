"""A harness process's children, ended and reaped before the process exits.

A controller process starts the ranks' fork server (backends/runtime/forkserver.py) and multiprocessing's
resource tracker; the fork server forks the ranks, and a rank may start processes of its own. Both servers
leave when every copy of a pipe they watch is closed, and the controller's copy closed only with its own exit:
after a 2-rank run exited 0 both were still running, for 0.8-1.3 s (8 runs of 8, loaded 2-core machine).
``end_children`` closes those pipes itself, then waits until every child has exited and is reaped. With
``become_subreaper`` a descendant whose parent died becomes this process's child, so it is waited for too. A
child still running ``WAIT_S`` after the run ended is killed, with one warning line naming it, and reaped.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

log = logging.getLogger(__name__)

# How long the children get to leave by themselves, then how long killed ones get to be reaped. Told to leave, the
# fork server and the resource tracker were gone within 0.2 s (loaded 2-core machine; backends/runtime/preload.py).
WAIT_S = 30.0
KILLED_WAIT_S = 10.0
_POLL_S = 0.01

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Linux: an orphaned descendant of this process (a rank whose fork server died, a process a killed rank
    started) becomes its child instead of init's, so ``end_children`` waits for it and reaps it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):
        pass


def is_own_child(pid: int) -> bool:
    """Whether ``pid`` is a child of this process (running, or exited and not yet reaped). A process forked from
    the one that started a server (tests/warm_cli.py's runs) uses that server without being its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


def _stop_fork_server() -> None:
    """This process's fork server told to leave (the pipe it watches closed), or killed at once when no rank was
    asked of it (it may still be importing: seconds of CPU that nothing would use). A fork server this process did
    not start (tests/warm_cli.py's, which its runs share) is left running."""
    from multiprocessing import forkserver, util

    from backends.runtime.forkserver import ranks_asked

    server = forkserver._forkserver
    with server._lock:
        pid, fd, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
        if pid is None or not is_own_child(pid):
            return
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    if fd is not None:
        os.close(fd)
    if address is not None and not util.is_abstract_socket_namespace(address):
        try:
            os.unlink(address)
        except OSError:
            pass
    if not ranks_asked():
        os.kill(pid, signal.SIGKILL)


def _end_multiprocessing() -> None:
    """Stop this process's fork server and resource tracker, with multiprocessing's exit finalizers between the two:
    those finalizers are the tracker's last users (semaphores unregistered), and a use after it stopped would start
    a new one."""
    import multiprocessing
    from multiprocessing import resource_tracker, util

    # A controller stops its ranks when it closes; one still running here dies with its fork server (die_with_parent)
    running = multiprocessing.active_children()
    if running:
        log.warning("exit: %s still running; stopped with the fork server", ", ".join(p.name for p in running))
    _stop_fork_server()
    # What the interpreter's exit runs for multiprocessing (util._exit_function), less its join of children that
    # has no time limit: the finalizers (queues closed, semaphores unregistered, its temporary folder removed).
    # Marked as run, so that the exit does not run it again.
    util._exiting = True
    util._run_finalizers(0)
    util._run_finalizers()
    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        fd, pid = tracker._fd, tracker._pid
        if fd is None or pid is None or not is_own_child(pid):
            return
        tracker._fd = tracker._pid = None
    os.close(fd)  # the tracker reads EOF, unlinks what nobody unregistered, and exits


def _reap_exited() -> bool:
    """Reap every child that has exited; True while a child is still running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _wait(seconds: float) -> bool:
    """Reap children as they exit, for up to ``seconds``; True once there are none."""
    deadline = time.monotonic() + seconds
    while _reap_exited():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _descendants() -> list:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _names(procs) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.name()} (pid {p.pid})")
        except Exception:  # noqa: BLE001 - it exited meanwhile: its pid still names it
            out.append(f"pid {p.pid}")
    return ", ".join(out)


def end_children(wait_s: float = WAIT_S) -> None:
    """Before this process exits: stop the servers multiprocessing started here, then wait for every child to exit
    and reap it. After ``wait_s`` every descendant still running is killed (one warning line) and reaped; one that
    does not exit within ``KILLED_WAIT_S`` of its kill is left, with a second line."""
    if "multiprocessing.util" in sys.modules:
        _end_multiprocessing()
    if _wait(wait_s):
        return
    left = _descendants()
    for p in left:
        try:
            p.send_signal(signal.SIGKILL)
        except Exception:  # noqa: BLE001 - it exited meanwhile
            pass
    log.warning("exit: killed %s, still running %g s after the run ended", _names(left), wait_s)
    if not _wait(KILLED_WAIT_S):
        log.warning("exit: %s not gone %g s after being killed; leaving", _names(_descendants()), KILLED_WAIT_S)
