"""A job started by torchrun or Slurm, live: this process's connection to it, the job's store, heartbeats and command
channel (how the process was launched is read by backends/runtime/launcher.py).

Under an external launcher every process is one rank. Global rank 0 runs the
harness (Hydra, planning, results.json, W&B, the report) and does its own share
of each pass in a thread; every other rank runs ``follow``: no Hydra, no output
folder, only the worker loop, taking its commands from rank 0 through the job's
TCP store. Nothing is spawned.

Failure: each process beats a heartbeat counter in the store. Rank 0 declares a
rank whose counter stops (killed, stopped, hung with the interpreter locked) or
that posts a failure, records the point's result, raises ``abort`` in the store
and exits; the other ranks see ``abort`` (or rank 0's heartbeat stop, or the
store vanish) and exit too, so the launcher ends the job on every node.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Optional

from backends.errors import UserError
from backends.registry import is_distributed
from backends.runtime.launcher import LaunchEnv, check_world_size, detect_launch
from backends.runtime.liveness import (
    HEARTBEAT_EVERY_S,
    STALE_AFTER_S,
    Heartbeats,
    die_with_parent,
    stopped_line,
)

log = logging.getLogger(__name__)

_BEAT_STORE_TIMEOUT_S = 10.0
# The watchdog's patience once the job has ended: rank 0 first writes the point's result.
_GRACE_S = {0: 30.0, "other": 5.0}
_LATE_RANK_GRACE_S = 60.0  # rank 0 at its end: how long it keeps the store for a rank that never connected
_STORE_TIMEOUT_S = 300.0  # how long a rank waits for the store itself at start-up (nodes start at different times)


class LaunchedJob:
    """This process's place in the launched job: the store, the heartbeats, and the command channel."""

    def __init__(self, env: LaunchEnv):
        import torch.distributed as dist

        self.env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.failed: Optional[str] = None  # rank 0: why the job was ended
        self.store_lost: Optional[str] = None  # rank 0: why the store stopped answering, seen by the heartbeat
        self._seq = 0
        self._forgotten = 0  # commands below this number are deleted from the store
        self._base = self._connect(is_master=self._hosts_store())
        self.store = dist.PrefixStore("balance-batch/ctl/", self._base)
        beat_client = self._connect(is_master=False)
        # a stopped store host must not block the beat
        beat_client.set_timeout(timedelta(seconds=_BEAT_STORE_TIMEOUT_S))
        self._beat_store = dist.PrefixStore("balance-batch/ctl/", beat_client)
        self._beat_watch = Heartbeats(self._beat_store)  # the beat thread's reads (its own client)
        self._peers = Heartbeats(self.store)  # rank 0's peer checks
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="launch-heartbeat", daemon=True)
        self._beats.start()
        self._start_watchdog()

    def _start_watchdog(self) -> None:
        """A small process that SIGKILLs this rank when the job has ended and the rank did not follow.

        A stopped or hung rank cannot exit by itself, and its node's launcher
        may never notice (torchrun watches only its own workers' exits). The
        watchdog dies with this process (PR_SET_PDEATHSIG), so it is never left behind.
        """
        import subprocess

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        args = [str(os.getpid()), str(self.rank), self.env.master_addr, str(self.env.master_port)]
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", "from backends.runtime.job import watch; watch()", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )

    # -- the store ------------------------------------------------------------------------------
    def _hosts_store(self) -> bool:
        # torchrun's agent on the first node hosts the store for its workers; otherwise rank 0 does.
        return self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"

    def _connect(self, is_master: bool):
        import torch.distributed as dist

        try:
            return dist.TCPStore(self.env.master_addr, self.env.master_port, None if not is_master else self.world_size,
                                 is_master=is_master, timeout=timedelta(seconds=_STORE_TIMEOUT_S),
                                 wait_for_workers=False, multi_tenant=True)
        except Exception as exc:  # noqa: BLE001 - a user-facing start-up failure
            raise UserError(f"MASTER_ADDR/MASTER_PORT: rank {self.rank} cannot reach the job's store at "
                            f"{self.env.master_addr}:{self.env.master_port} ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from None

    def process_group_store(self):
        import torch.distributed as dist

        return dist.PrefixStore("balance-batch/pg/", self._base)

    # -- heartbeats -----------------------------------------------------------------------------
    def _beat(self) -> None:
        """Every second: show this process is alive; a non-zero rank also watches rank 0 and ``abort``."""
        while not self._stop.wait(HEARTBEAT_EVERY_S):
            try:
                self._beat_store.add(f"hb/{self.rank}", 1)
                if self.rank == 0:
                    continue
                if self._beat_store.check(["abort"]):
                    reason = self._beat_store.get("abort").decode(errors="replace")
                    self.exit_now(f"rank {self.rank}: the job was ended by rank 0 ({reason})")
                if self._beat_watch.stale(0):
                    self.exit_now(f"rank {self.rank}: rank 0 stopped answering (no heartbeat for {STALE_AFTER_S:g} s); "
                                  "exiting")
            except Exception as exc:  # noqa: BLE001 - the store is gone: the launcher ended the job
                if self._stop.is_set():
                    return
                if self.rank == 0:  # rank 0 writes the point's result first (LaunchedBackend reads this)
                    self.store_lost = (f"lost the job's store at {self.env.master_addr}:{self.env.master_port} "
                                       f"({type(exc).__name__}): the launcher ended the job (a rank or a node failed)")
                    return
                self.exit_now(f"rank {self.rank}: lost the job's store at "
                              f"{self.env.master_addr}:{self.env.master_port} "
                               f"({type(exc).__name__}); the job has ended; exiting")

    def exit_now(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)

    def dead_peer(self) -> Optional[str]:
        """Rank 0: a rank whose heartbeat stopped, as a phrase; None while all beat."""
        for rank in range(1, self.world_size):
            if self._peers.stale(rank):
                return stopped_line(rank)
        return None

    def peer_failure(self) -> Optional[tuple[str, str, Optional[str]]]:
        """Rank 0: (kind, message, details) of a rank that posted its failure, else None."""
        if int(self.store.add("nfail", 0)) == 0:
            return None
        for rank in range(1, self.world_size):
            if self.store.check([f"fail/{rank}"]):
                kind, (message, details) = pickle.loads(self.store.get(f"fail/{rank}"))
                return kind, message, details
        return None

    # -- commands -------------------------------------------------------------------------------
    def send(self, kind: str, payload: Any = None) -> int:
        """Rank 0: the next command for every other rank; returns its number."""
        if self.world_size > 1:
            self.store.set(f"cmd/{self._seq}", pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))
        self._seq += 1
        return self._seq - 1

    def forget(self, before: int) -> None:
        """Rank 0: drop the commands numbered below ``before`` from the store, once every rank has read them."""
        if self.world_size > 1:
            for seq in range(self._forgotten, before):
                self.store.delete_key(f"cmd/{seq}")
        self._forgotten = max(self._forgotten, before)

    def receive(self) -> tuple[str, Any]:
        """A non-zero rank: wait for rank 0's next command (the heartbeat thread ends the wait if the job ends)."""
        key = f"cmd/{self._seq}"
        while True:
            try:
                self.store.wait([key], timedelta(seconds=5))
                break
            except Exception:  # noqa: BLE001 - a wait timed out: keep waiting (rank 0 may be between points)
                continue
        self._seq += 1
        return pickle.loads(self.store.get(key))

    def post_failure(self, kind: str, message: str, details: str) -> None:
        self.store.set(f"fail/{self.rank}", pickle.dumps((kind, (message, details))))
        self.store.add("nfail", 1)

    def abort(self, reason: str) -> None:
        """Rank 0: tell every other rank to exit now (they may be stuck in a collective with a dead peer)."""
        self.failed = self.failed or reason
        try:
            self.store.set("abort", reason[:500])
        except Exception:  # noqa: BLE001 - the store is gone: the other ranks see that instead
            pass

    def finish(self) -> None:
        """At the end of the run: the watchdog goes; rank 0 tells the other ranks to exit cleanly."""
        self._stop.set()
        self._watchdog.kill()  # its parent's heartbeat stops now; it must not take that for a hang
        self._watchdog.wait()
        if self.rank != 0:
            try:
                self.store.add("left", 1)  # rank 0 keeps the store up until every rank has said so
            except Exception:  # noqa: BLE001 - the store is gone already: nothing to tell
                pass
            return
        if self.failed is None and self.store_lost is None:
            try:
                self.send("exit")
                self._wait_for_ranks_to_leave()
            except Exception:  # noqa: BLE001 - the store is gone: the other ranks see that and exit
                pass

    def _wait_for_ranks_to_leave(self) -> None:
        """Rank 0 hosts the store: leaving before a slow rank has even connected (a dry run ends in
        seconds) would leave that rank retrying the connection for minutes. Wait until every rank has read
        ``exit``; give up on one that beat and then stopped (gone another way), and after
        ``_LATE_RANK_GRACE_S`` on one that never connected at all."""
        start = time.monotonic()
        while int(self.store.add("left", 0)) < self.world_size - 1:
            beats = [self._peers.count(r) for r in range(1, self.world_size)]
            if any(b > 0 and self._peers.stale(r) for r, b in enumerate(beats, start=1)):
                return
            if time.monotonic() - start > (_STORE_TIMEOUT_S if all(beats) else _LATE_RANK_GRACE_S):
                return
            time.sleep(0.1)


# This process's one connection to its launched job (store, heartbeat thread, watchdog), opened by the
# first launched_job() and kept for the process's life. No Hydra callback reads it: it is a global because
# every point of a multirun (Hydra calls the task function once per point, with the config alone) and the
# backend each point starts (backends/start.py, LaunchedBackend) must share that one connection.
_JOB: Optional[LaunchedJob] = None


def launched_job() -> Optional[LaunchedJob]:
    """This process's launched job, connected on first use; None when not launched (or a one-rank launch)."""
    global _JOB
    if _JOB is None:
        env = detect_launch()
        if env is None:
            return None
        _JOB = LaunchedJob(env)
    return _JOB


def launch_env() -> Optional[LaunchEnv]:
    return _JOB.env if _JOB is not None else detect_launch()


def launch_record(world_size: int) -> dict:
    """results.json's ``launch``: who started the ranks, on how many nodes."""
    env = launch_env()
    return env.record() if env is not None else {"launcher": "spawn", "nnodes": 1, "world_size": world_size}



def resolve_world_size(backend: str, world_size: Optional[int], device_type: str) -> int:
    """Ranks a backend runs: pytorch 1; otherwise ``world_size``, else one per visible GPU, else 2 CPU ranks.

    Under torchrun or Slurm the launcher's world size, and a ``world_size`` that disagrees is a user error.
    """
    launched = launch_env()
    if launched is not None:
        return check_world_size(backend, world_size, launched)
    if not is_distributed(backend):
        if world_size not in (None, 1):
            raise UserError(f"world_size: backend={backend} runs one process, got {world_size} (valid: 1 or null)")
        return 1
    if world_size is not None:
        return world_size
    if device_type == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return 2


def end_after_failure(exit_code: int) -> None:
    """Rank 0, after a point's result is written: a failed launched job cannot run more points; end the process.

    Its rank thread may be stuck in a collective with a dead peer, so the process
    leaves with ``os._exit`` once the logs are flushed; the other ranks already saw ``abort``.
    """
    job = _JOB
    if job is None or job.failed is None:
        return
    log.error("the launched job ends here (%s); finished points are kept; rerun with resume=true to continue a sweep",
              job.failed)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a handler that cannot flush must not stop the exit
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(max(1, exit_code))


def watch() -> None:
    """The watchdog process of one rank (argv: rank pid, rank, store address, store port); see ``_start_watchdog``."""
    import signal

    parent, rank, addr, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    die_with_parent()
    if os.getppid() != parent:
        return
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the rank's to handle
    client = dist.TCPStore(addr, port, None, is_master=False, timeout=timedelta(seconds=_STORE_TIMEOUT_S))
    client.set_timeout(timedelta(seconds=_BEAT_STORE_TIMEOUT_S))
    store = dist.PrefixStore("balance-batch/ctl/", client)
    beats = Heartbeats(store)

    ended_at, reason = None, ""
    grace = _GRACE_S[0] if rank == 0 else _GRACE_S["other"]
    while True:
        time.sleep(HEARTBEAT_EVERY_S)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return
        if ended_at is None:
            try:
                if beats.stale(rank):
                    ended_at, reason, grace = time.monotonic(), f"rank {rank} is hung or stopped (no heartbeat)", 0.0
                elif store.check(["abort"]):
                    ended_at, reason = time.monotonic(), "the job was ended by rank 0"
                elif rank != 0 and beats.stale(0):
                    ended_at, reason = time.monotonic(), "rank 0 stopped answering"
            except Exception:  # noqa: BLE001 - the store is gone: the job has ended
                ended_at, reason = time.monotonic(), "the job's store is gone"
        if ended_at is not None and time.monotonic() - ended_at >= grace:
            print(f"rank {rank} watchdog: {reason}; killing rank {rank} (pid {parent})", file=sys.stderr, flush=True)
            os.kill(parent, signal.SIGKILL)
            return
