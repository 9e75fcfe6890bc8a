"""``python -m harness`` (or ``reports``) for the tests, forked from an interpreter that already imported the heavy
modules.

A CLI process imports torch, transformers, peft, hydra and matplotlib before it does anything (about 4 s of CPU
on the 2-core machine CI runs on), and the suite starts about a hundred of them. One warm server per pytest
worker (``python tests/warm_cli.py``, started on first use) imports them once and forks a child per run. The child
is a real process with its own pid, working folder, environment, standard streams and exit status; it runs the
module as ``python -m`` does (``runpy``, as ``__main__``, the working folder first on ``sys.path``), and its
interpreter ends as a fresh one's would (exit handlers, a raised ``SystemExit``'s code, a traceback and 1 for an
uncaught error). Only its imports came from its parent. Ranks it starts are forked by the ranks' fork server the
warm server started once (backends/runtime/forkserver.py's, with its preload: about 7 s of CPU saved per run that
starts ranks), and they get the run's environment and ``sys.path``, as from a fork server of the run's own. Such a
rank dies with that shared server, not with its run: a run killed before it stopped its ranks (a timeout) leaves
them to the end of the worker; the tests that kill a run on purpose start it as a plain subprocess.

A run whose environment differs from the server's in more than the run-time variables below (an import may read
the others: PATH, PYTHONPATH, torch's) runs as a plain subprocess; so do tests that signal or kill a CLI process
(they use ``subprocess.Popen`` themselves).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

# Variables read when a run starts, not when torch, transformers or hydra are imported: a run may set its own
# (pytest sets PYTEST_CURRENT_TEST anew for every test)
RUN_TIME_VARIABLES = ("WANDB_", "BALANCE_BATCH_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT", "HYDRA_", "PYTEST_")
PRELOAD = ("torch", "numpy", "transformers", "transformers.modeling_layers", "transformers.masking_utils",
           "transformers.activations", "peft", "hydra", "omegaconf", "psutil", "matplotlib.pyplot")


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket):
    head = _read_exactly(sock, 4)
    if head is None:
        return None
    return pickle.loads(_read_exactly(sock, struct.unpack("!I", head)[0]))


def _read_exactly(sock: socket.socket, n: int):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class WarmCLI:
    """The client: one server process, one run at a time (a pytest worker runs one test at a time)."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     env=self.env, stdin=subprocess.DEVNULL)
        theirs.close()

    def suits(self, env: dict[str, str]) -> bool:
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) or k.startswith(RUN_TIME_VARIABLES) for k in keys)

    def run(self, module: str, args, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="warm-cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            _send(self.sock, {"module": module, "args": list(args), "cwd": str(cwd), "env": dict(env),
                              "stdout": str(out), "stderr": str(err)})
            pid = _recv(self.sock)
            self.sock.settimeout(timeout)
            try:
                code = _recv(self.sock)
            except socket.timeout:
                os.kill(pid, 9)  # as subprocess.run does on a timeout: the child, not what it started
                self.sock.settimeout(None)
                _recv(self.sock)  # the server reaped it
                raise subprocess.TimeoutExpired([module, *args], timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace")) from None
            self.sock.settimeout(None)
            if code is None:
                raise RuntimeError("the warm CLI server died")
            return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code,
                                               out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        self.sock.close()  # the server's read ends: it leaves
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _serve(fd: int) -> None:
    import gc
    import importlib
    import warnings

    from backends.runtime.collector import defer_full_collections

    defer_full_collections()  # before the imports, as in a harness process; the runs forked from here inherit it
    with warnings.catch_warnings():  # what importing warns is a run's to say (once per process: not here)
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the run imports it again and reports the error itself
                pass
    from backends.runtime.forkserver import start_early

    # The imports' objects are left out of every later collection: a forked run shares this process's memory until
    # it writes a page, and a collection writes the header of every object it visits, so without this each run
    # copied the imported heap page by page (a dry run took 2.4 CPU-seconds, 0.9 with it; a pytorch point 5.9, 2.9).
    gc.freeze()
    start_early()  # the ranks' fork server, shared by the runs forked from here (_share_fork_server)
    sock = socket.socket(fileno=fd)
    while (request := _recv(sock)) is not None:
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become(request)  # returns only into the interpreter's exit
            return
        _send(sock, pid)
        _, status = os.waitpid(pid, 0)
        _send(sock, os.waitstatus_to_exitcode(status))


def _share_fork_server() -> None:
    """In the forked child: use the warm server's fork server for ranks, as a child process of the server's would.

    multiprocessing checks that its fork server is alive with ``waitpid``, which only the server's parent may call;
    here the check asks the kernel whether the process exists instead. Should it have died, a fork server of the
    run's own is started, as in any run."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid, own = server._forkserver_pid, server.ensure_running

    def ensure_running():
        if server._forkserver_pid == pid:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "gone"
            if state not in ("Z", "X", "gone"):
                return
            server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
        own()

    if pid is not None:  # the method, and the module's alias of it (bound when multiprocessing was imported)
        server.ensure_running = forkserver.ensure_running = ensure_running


def _become(request: dict) -> None:
    """In the forked child: take the run's folder, environment and streams, and run its module as ``python -m``."""
    import runpy

    _share_fork_server()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [request["module"], *request["args"]]
    sys.path[0] = os.getcwd()  # python -m puts the working folder first
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # not this file's folder (tests/): a run's first entry is its working folder
    _serve(int(sys.argv[1]))
