"""``python -m harness.serve``: one loaded backend behind an HTTP API, its batching changeable while it runs.

    BALANCE_BATCH_ADMIN_TOKEN=secret python -m harness.serve backend=fsdp2 server.port=8000

Routes: POST /forward, POST /forward_backward (examples in, per-example outputs
in request order out); POST /admin/set_max_tokens_per_microbatch and
/admin/set_micro_batch_size ({"value": positive int | null}), GET /admin/config
(all admin routes need ``Authorization: Bearer <token>``); GET /healthz (the passes running
or queued as ``pending``; 503 and the reason while the workers are down: a dead worker's
backend is started again at the next pass). Here: the checks before the model loads, the socket, and serving until
stopped; the routes are harness/server/app.py's, what a request may hold harness/server/requests.py's, the restarts
harness/server/supervisor.py's.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from typing import Optional

import hydra
from omegaconf import DictConfig

from backends.errors import BackendError, UserError
from backends.runtime.collector import defer_full_collections, exit_with
from harness.app.batching import AUTO, needs_budget
from harness.app.cli import reaped, run_hydra_cli
from harness.server.app import build_app
from harness.server.client import TOKEN_ENV, is_loopback
from harness.server.supervisor import ServedBackend

log = logging.getLogger("harness.serve")


def bind_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is one line at once, not after minutes."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UserError(f"server.host: cannot resolve '{host}' ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait for TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"server.port: cannot listen on {host}:{port} ({exc.strerror}); "
                        "choose another server.port") from None
    return sock


class _Stop(Exception):
    """SIGTERM after uvicorn's graceful shutdown."""


def _raise_stop(signum, frame):
    raise _Stop()


def serve(cfg: DictConfig) -> int:
    """Check what a user can get wrong, load the backend, serve until SIGINT/SIGTERM; the exit status."""
    try:
        spec, token, sock, control = _prepare(cfg)
    except UserError as exc:
        log.error("%s", exc)
        return 2
    return _serve_backend(spec, token, sock, control)


def _prepare(cfg: DictConfig):
    """Everything a user can get wrong, checked before the model loads (minutes for a large one).

    Returns (config, admin token, bound socket, control file); a UserError names the key.
    """
    from backends.runtime.control import BatchingSettings, ControlFile
    from harness.app.config import resolve_config

    spec = resolve_config(cfg)
    check_served(spec)
    server = spec.server
    b = spec.backend
    token = os.environ.get(TOKEN_ENV) or None
    if not is_loopback(server.host) and not token:
        raise UserError(
            f"server.host: {server.host} is not a loopback address and {TOKEN_ENV} is unset; "
            "set a token (or keep server.host=127.0.0.1)"
        )
    sock = bind_port(server.host, server.port)
    try:
        # a planner that plans by a budget (balanced, most peers): "unset" written into its file is bad content
        control = ControlFile(server.control_path, BatchingSettings(b.max_tokens_per_microbatch, b.micro_batch_size),
                              budget_required=needs_budget(b.planner), planner=b.planner)
    except OSError as exc:
        sock.close()
        raise UserError(
            f"server.control_path: cannot write {server.control_path or exc.filename} ({exc.strerror or exc}); "
            "choose a writable path, or null for one in /dev/shm"
        ) from None
    return spec, token, sock, control


def check_served(spec) -> None:
    """What a server cannot serve, refused in one line before it binds its port or loads the model: mtpm=auto (a
    search, not a budget) and server.* values out of range (a server that would start only to refuse everything, or
    stop at its first log line)."""
    from uvicorn.config import LOG_LEVELS

    server, b = spec.server, spec.backend
    if spec.mtpm == AUTO:
        raise UserError("mtpm: auto searches for the fastest budget by measuring it (python -m harness mtpm=auto), and "
                        "a server runs the budget it is given: start it with mtpm=<tokens> (the one that search "
                        "answers), or mtpm=null with planner=greedy")
    if not 0 <= server.port <= 65535:
        raise UserError(f"server.port: must be 0..65535 (0: any free port), got {server.port}")
    for key, least in (("queue_size", 0), ("max_request_tokens", 1), ("max_request_bytes", 1), ("mtpm_ceiling", 1),
                       ("mbs_ceiling", 1)):
        value = getattr(server, key)
        if value < least:
            what = "an integer >= 0 (passes that may wait behind the running one)" if least == 0 else \
                "a positive integer"
            raise UserError(f"server.{key}: must be {what}, got {value}")
    for key, ceiling, knob, own in (("mtpm_ceiling", server.mtpm_ceiling, "mtpm", b.max_tokens_per_microbatch),
                                    ("mbs_ceiling", server.mbs_ceiling, "mbs", b.micro_batch_size)):
        if own is not None and own > ceiling:
            raise UserError(f"server.{key}: {ceiling} is below the server's own {knob}={own}; the admin API could not "
                            f"set back the value it starts with: raise server.{key} to at least {own}, or lower {knob}")
    if server.log_level not in LOG_LEVELS:
        raise UserError(f"server.log_level: '{server.log_level}' is not a level (valid: {', '.join(LOG_LEVELS)})")


def _serve_backend(spec, token: Optional[str], sock: socket.socket, control) -> int:
    """Start the backend and serve it on ``sock`` until stopped; the workers, socket and control file go at the end."""
    import uvicorn

    from backends.model.build import model_vocab_size
    from backends.start import make_backend

    server = spec.server
    b = spec.backend

    def start_backend():
        backend = make_backend(b, spec.model)
        backend.attach_control(control)
        return backend

    served = None
    try:
        vocab = model_vocab_size(spec.model)
        served = ServedBackend(start_backend)
        plan_options = {"layout": b.layout, "planner": b.planner, "max_seqs_per_microbatch": b.max_seqs_per_microbatch,
                        "cost_model": _served_cost_model(spec, served.backend, vocab).as_dict()}
        app = build_app(served, control, vocab, server, token, b.micro_batch_size, plan_options)
        backend = served.backend
        log.info(
            "serving %s (%d x %s) on http://%s:%d; control file %s; admin API %s",
            backend.name, backend.world_size, backend.device.type, server.host, sock.getsockname()[1], control.path,
            "enabled" if token else f"disabled ({TOKEN_ENV} unset)",
        )
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal;
        # turning it into an exception lets the finally below stop the workers.
        signal.signal(signal.SIGTERM, _raise_stop)
        config = uvicorn.Config(app, log_config=None, log_level=server.log_level, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    except (KeyboardInterrupt, _Stop):
        pass
    except UserError as exc:
        log.error("%s", exc)
        return 2
    except BackendError as exc:
        log.error("%s", exc)
        return 1
    finally:
        sock.close()
        if served is not None:
            served.close()
        control.remove()
        log.info("server stopped; workers stopped")
    return 0


def _served_cost_model(spec, backend, vocab_size: int):
    """What the server's balanced planner balances: FLOPs, or with cost_model=calibrated a fit for its backend (cached,
    or measured once it has loaded) over a spread up to calibration.max_len, else its budget, else 4096 tokens."""
    from backends.model.configs import cost_model_for
    from harness.metrics.calibration import CALIBRATED, calibrated_cost_model, calibration_identity

    if spec.cost_model != CALIBRATED:
        return cost_model_for(spec.model)
    ident = calibration_identity(spec, backend.name, backend.world_size, backend.describe_device(),
                                 spec.backend.max_tokens_per_microbatch or 4096)
    return calibrated_cost_model(spec.calibration, ident, backend, vocab_size, label="[serve] ")


def main() -> int:
    """``python -m harness.serve``: the server as a Hydra app; its exit status (2: a config mistake). Returns once
    every process it started has exited and been reaped."""
    defer_full_collections()  # before the imports the server makes (backends/runtime/collector.py)
    return reaped(_main)


def _main() -> int:
    exit_code = 0

    # Hydra drops a task function's return value, so the status comes back through this closure.
    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _hydra_main(cfg: DictConfig) -> None:
        nonlocal exit_code
        exit_code = serve(cfg)

    return run_hydra_cli(_hydra_main, lambda: exit_code)


if __name__ == "__main__":
    exit_with(main())
