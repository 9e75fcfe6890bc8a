"""``python -m harness.serve``: one loaded backend behind an HTTP API, its batching changeable while it runs.

    BALANCE_BATCH_ADMIN_TOKEN=secret python -m harness.serve backend=fsdp2 server.port=8000

Routes: POST /forward, POST /forward_backward (examples in, per-example outputs
in request order out); POST /admin/set_max_tokens_per_microbatch and
/admin/set_micro_batch_size ({"value": positive int | null}), GET /admin/config
(all admin routes need ``Authorization: Bearer <token>``); GET /healthz (the passes running
or queued as ``pending``; 503 and the reason while the workers are down: a dead worker's
backend is started again at the next pass).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import signal
import socket
import sys
from typing import Any, Callable, Optional

import hydra
from fastapi import Request  # at module level: FastAPI resolves the route annotations here
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from omegaconf import DictConfig
from starlette.requests import ClientDisconnect

from backends.errors import BackendError, UserError, first_line
from harness.cli import run_hydra_cli
from harness.client import TOKEN_ENV, is_loopback

log = logging.getLogger("harness.serve")


class RequestError(Exception):
    """A request the server refuses: HTTP status and a message naming the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# Losses are weighted sums of log-probabilities in float32 (or bfloat16, same range): weights
# this large would overflow them, so such a request is refused rather than answered with inf.
MAX_WEIGHT = 1e30


def parse_setting(body: Any, name: str, ceiling: int, allow_null: bool = True) -> Optional[int]:
    """The ``value`` of an admin set request: a positive integer up to ``ceiling``, or null."""
    if not isinstance(body, dict) or "value" not in body:
        raise RequestError(422, f'{name}: expected a JSON object {{"value": <positive integer> or null}}')
    value = body["value"]
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RequestError(422, f"{name}: value must be a positive integer{' or null' if allow_null else ''}, got "
                                f"{json.dumps(value)}")
    if value > ceiling:
        raise RequestError(422, f"{name}: value {value} is above the server's ceiling {ceiling}")
    return value


def parse_examples(body: Any, vocab_size: int, max_tokens: int):
    """Examples from a pass request, checked field by field; returns backends.messages.Example objects."""
    import numpy as np

    from backends.messages import Example

    if not isinstance(body, dict) or not isinstance(body.get("examples"), list) or not body["examples"]:
        raise RequestError(422, 'examples: expected {"examples": [{"input_ids": [...], "target_tokens": [...], '
                                '"weights": [...]}, ...]} with at least one example')
    total = 0
    total_weight = 0.0
    out = []
    for i, ex in enumerate(body["examples"]):
        where = f"examples[{i}]"
        if not isinstance(ex, dict):
            raise RequestError(422, f"{where}: expected an object with input_ids, target_tokens and weights")
        arrays = {}
        for key in ("input_ids", "target_tokens", "weights"):
            value = ex.get(key)
            if not isinstance(value, list) or not value:
                raise RequestError(422, f"{where}.{key}: expected a non-empty list")
            if key == "weights":
                if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                           and 0 <= w <= MAX_WEIGHT for w in value):
                    raise RequestError(422, f"{where}.weights: every weight must be a finite number in "
                                            f"0..{MAX_WEIGHT:g}")
                arrays[key] = np.asarray(value, dtype=np.float32)
                total_weight += float(arrays[key].sum(dtype=np.float64))
                if total_weight > MAX_WEIGHT:
                    raise RequestError(422, f"{where}.weights: the request's weights sum to more than {MAX_WEIGHT:g}")
            else:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                    raise RequestError(422, f"{where}.{key}: every token must be an integer")
                arr = np.asarray(value, dtype=np.int64)
                if arr.min() < 0 or arr.max() >= vocab_size:
                    raise RequestError(422, f"{where}.{key}: token ids must lie in 0..{vocab_size - 1} (the model's "
                                            "vocabulary)")
                arrays[key] = arr
        n = {k: len(v) for k, v in arrays.items()}
        if len(set(n.values())) != 1:
            raise RequestError(
                422, f"{where}: input_ids, target_tokens and weights must have the same length, got {n['input_ids']}, "
                     f"{n['target_tokens']}, {n['weights']}"
            )
        total += n["input_ids"]
        if total > max_tokens:
            raise RequestError(413, f"examples: more than {max_tokens} tokens in one request "
                                    "(server.max_request_tokens)")
        out.append(Example(arrays["input_ids"], arrays["target_tokens"], arrays["weights"]))
    return out


class ServedBackend:
    """The server's backend: says whether it can run a pass, and starts it again at the next pass once its workers died.

    A worker killed (by the OOM killer, a signal, a crash) stops every rank of a
    distributed backend. Until the next pass /healthz answers 503 with the
    reason; the next pass starts the workers again (the port, the token, the
    control file and clients' URLs stay) and then runs.
    """

    def __init__(self, start: Callable[[], Any]):
        self._start = start
        self.backend = start()
        self.restarts = 0
        self.down_reason: Optional[str] = None  # set while restarting or after a failed restart
        self._cause = ""  # why the workers went down, for the messages of the restart

    def failure(self) -> Optional[str]:
        if self.down_reason is not None:
            return self.down_reason
        return self.backend.failure() if self.backend is not None else "not started"

    def run_pass(self, command: dict):
        """One pass (the server runs one at a time): restart first when the workers are gone."""
        why = self.failure()
        if why is not None:
            self._restart(why)
        return self.backend.run_pass(command)

    def _restart(self, why: str) -> None:
        if self.backend is not None:  # else a restart failed before: keep its first cause
            self._cause = why
            self.backend.close()
            self.backend = None
        log.warning("workers down (%s); starting them again", self._cause)
        self.down_reason = f"restarting the workers (they were down: {self._cause})"
        try:
            self.backend = self._start()
        except Exception as exc:  # noqa: BLE001 - reported to the client and on /healthz
            self.down_reason = (f"the workers were down ({self._cause}) and did not start again: "
                                f"{first_line(str(exc), 300)}")
            log.error("%s", self.down_reason)
            raise BackendError(self.down_reason) from None
        self.down_reason = None
        self.restarts += 1
        log.info("workers started again (restart %d)", self.restarts)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


def _error(status: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
    """A refusal as the server answers every one: ``{"detail": message}`` with its HTTP status."""
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


class ServerState:
    """What the routes share: the served backend, its control file, its description, and the passes in flight.

    Each route of ``build_app`` is one call of a method here: request bodies are
    read and checked, admin requests authorised, and passes run one at a time
    (``queue_size`` more may wait; beyond that a pass is refused with 503).
    """

    def __init__(self, served: ServedBackend, control, vocab_size: int, server, admin_token: Optional[str],
                 default_mbs: int, plan_options: Optional[dict] = None):
        self.served = served
        self.control = control
        self.vocab_size = vocab_size
        self.server = server  # harness.config.ServerConfig: the ceilings, request limits and queue size
        self.admin_token = admin_token
        self.default_mbs = default_mbs  # what micro_batch_size null puts back
        self.plan_options = dict(plan_options or {})
        self.passes = asyncio.Semaphore(1)  # one pass at a time
        self.pending = 0  # passes running or queued
        first = served.backend
        self.info = {
            "backend": first.name,
            "world_size": first.world_size,
            "device": first.describe_device(),
            "vocab_size": vocab_size,
            # how every pass is planned, fixed for the server's life: a client records these, not its own
            "layout": self.plan_options.get("layout", "padded"),
            "planner": self.plan_options.get("planner", "greedy"),
            "max_seqs_per_microbatch": self.plan_options.get("max_seqs_per_microbatch"),  # null: no cap
            "cost_model": self.plan_options.get("cost_model"),
        }

    # -- requests ---------------------------------------------------------------------------------
    async def json_body(self, request: Request) -> Any:
        """The request's JSON body, within server.max_request_bytes; a RequestError otherwise."""
        length = request.headers.get("content-length")
        if length is None:
            raise RequestError(411, "a Content-Length header is required")
        if int(length) > self.server.max_request_bytes:
            raise RequestError(413, f"request body of {int(length)} bytes is above server.max_request_bytes "
                                    f"({self.server.max_request_bytes})")
        try:
            raw = await request.body()
        except ClientDisconnect:
            # Nobody is left to answer; one line instead of an ASGI traceback.
            log.info("%s %s: the client left before sending its whole request", request.method, request.url.path)
            raise RequestError(400, "the client disconnected before the request was complete") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RequestError(422, "the body is not valid JSON") from None

    def check_admin(self, request: Request) -> Optional[JSONResponse]:
        """None when the request carries the admin token; else the refusal to answer with."""
        if not self.admin_token:
            return _error(403, f"admin API disabled: start the server with {TOKEN_ENV} set")
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer "):
            return _error(401, "missing 'Authorization: Bearer <token>' header", {"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(header[len("Bearer ") :].encode(), self.admin_token.encode()):
            return _error(403, "wrong admin token")
        return None

    # -- what the routes answer -----------------------------------------------------------------
    def current(self) -> dict:
        """The batching in force and where it is set: GET /admin/config and every admin set's answer."""
        return {**self.control.read().as_dict(), "backend": self.info["backend"], "world_size": self.info["world_size"],
                "control_path": str(self.control.path)}

    def health(self):
        """GET /healthz: the backend and its batching; 503 and the reason while its workers are down."""
        served = self.served
        why = served.failure()
        if why is not None:
            return JSONResponse({"status": "down", "reason": why, "restarts": served.restarts,
                                 "recovery": "the workers are started again at the next pass"}, status_code=503)
        backend = served.backend
        return {"status": "ok", **self.info, **self.control.read().as_dict(), "model": backend.model_info,
                "precision": backend.precision, "load": backend.load_info, "pids": [os.getpid(), *backend.pids()],
                "restarts": served.restarts, "pending": self.pending}  # pending: passes running or queued

    async def admin_set(self, request: Request, name: str, ceiling: int, apply: Callable[[Optional[int]], Any]) -> Any:
        """An admin set request: authorised, its value checked against ``ceiling``, applied through the control file."""
        refused = self.check_admin(request)
        if refused:
            return refused
        value = parse_setting(await self.json_body(request), name, ceiling)
        apply(value)
        log.info("%s set to %s", name, value)
        return self.current()

    def set_budget(self, value: Optional[int]):
        if value is None and self.plan_options.get("planner") == "balanced":
            raise RequestError(422, "max_tokens_per_microbatch: null is not allowed with planner=balanced "
                                    "(fixed-size slices have no budget to balance)")
        return self.control.set_max_tokens_per_microbatch(value)

    def set_micro_batch_size(self, value: Optional[int]):
        # null puts back the size the server was started with
        return self.control.set_micro_batch_size(self.default_mbs if value is None else value)

    async def run_pass(self, pass_type: str, request: Request):
        """POST /forward and /forward_backward: the examples checked, queued behind the running pass, run."""
        from backends.messages import make_command

        body = await self.json_body(request)
        examples = parse_examples(body, self.vocab_size, self.server.max_request_tokens)
        if self.pending > self.server.queue_size:
            raise RequestError(503, f"busy: {self.pending} passes running or queued "
                                    f"(server.queue_size={self.server.queue_size}); retry later")
        self.pending += 1
        try:
            async with self.passes:
                # The backend fills in the budget from the control file before the pass.
                command = make_command(pass_type, examples, None, 1, **self.plan_options)
                result = await run_in_threadpool(self.served.run_pass, command)
        except BackendError as exc:
            log.error("%s failed: %s", pass_type, exc)
            return _error(500, str(exc))
        finally:
            self.pending -= 1
        return result.as_dict()


def build_app(
    served: ServedBackend, control, vocab_size: int, server, admin_token: Optional[str], default_mbs: int,
    plan_options: Optional[dict] = None,
):
    """The FastAPI app around a started backend and its control file: the routes, each one call of ServerState.

    ``plan_options`` (layout, planner, max_seqs_per_microbatch, cost_model; see backends.messages.make_command)
    are fixed for the server's life; only the budget and mbs change live.
    """
    from fastapi import FastAPI

    state = ServerState(served, control, vocab_size, server, admin_token, default_mbs, plan_options)
    app = FastAPI(title="balance-batch", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return _error(exc.status, str(exc))

    @app.get("/healthz")
    async def healthz():
        return state.health()

    @app.get("/admin/config")
    async def admin_config(request: Request):
        return state.check_admin(request) or state.current()

    @app.post("/admin/set_max_tokens_per_microbatch")
    async def set_mtpm(request: Request):
        return await state.admin_set(request, "max_tokens_per_microbatch", server.mtpm_ceiling, state.set_budget)

    @app.post("/admin/set_micro_batch_size")
    async def set_mbs(request: Request):
        return await state.admin_set(request, "micro_batch_size", server.mbs_ceiling, state.set_micro_batch_size)

    @app.post("/forward")
    async def forward(request: Request):
        return await state.run_pass("forward", request)

    @app.post("/forward_backward")
    async def forward_backward(request: Request):
        return await state.run_pass("forward_backward", request)

    return app


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
    from harness.config import resolve_config

    spec = resolve_config(cfg)
    server = spec.server
    b = spec.backend
    token = os.environ.get(TOKEN_ENV) or None
    if not is_loopback(server.host) and not token:
        raise UserError(
            f"server.host: {server.host} is not a loopback address and {TOKEN_ENV} is unset; "
            "set a token (or keep server.host=127.0.0.1)"
        )
    if not 0 <= server.port <= 65535:
        raise UserError(f"server.port: must be 0..65535, got {server.port}")
    sock = bind_port(server.host, server.port)
    try:
        # a balanced server needs a budget: "unset" written into its file is bad content, not fixed slices
        control = ControlFile(server.control_path, BatchingSettings(b.max_tokens_per_microbatch, b.micro_batch_size),
                              budget_required=b.planner == "balanced")
    except OSError as exc:
        sock.close()
        raise UserError(
            f"server.control_path: cannot write {server.control_path or exc.filename} ({exc.strerror or exc}); "
            "choose a writable path, or null for one in /dev/shm"
        ) from None
    return spec, token, sock, control


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
    from harness.calibration import CALIBRATED, calibrated_cost_model, identity, spread_longest

    if spec.cost_model != CALIBRATED:
        return cost_model_for(spec.model)
    b = spec.backend
    longest = spread_longest(spec.calibration.max_len or b.max_tokens_per_microbatch or 4096)
    ident = identity(backend.name, backend.world_size, backend.describe_device(), spec.model, b.layout,
                     b.gradient_checkpointing, b.compile, b.logprob_chunk_tokens, longest)
    return calibrated_cost_model(spec.calibration, ident, backend, vocab_size, label="[serve] ")


def main() -> int:
    """``python -m harness.serve``: the server as a Hydra app; its exit status (2: a config mistake)."""
    exit_code = 0

    # Hydra drops a task function's return value, so the status comes back through this closure.
    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _hydra_main(cfg: DictConfig) -> None:
        nonlocal exit_code
        exit_code = serve(cfg)

    return run_hydra_cli(_hydra_main, lambda: exit_code)


if __name__ == "__main__":
    sys.exit(main())
