"""The server's routes: a FastAPI app around a started backend, each route one call of ServerState (the passes run
one at a time behind a bounded queue; the admin routes need the token)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from typing import Any, Callable, Optional

from fastapi import Request  # at module level: FastAPI resolves the route annotations here
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from backends.errors import BackendError, UserError
from harness.app.batching import needs_budget
from harness.server.client import TOKEN_ENV
from harness.server.requests import RequestError, json_body, parse_examples, parse_setting
from harness.server.supervisor import ServedBackend

log = logging.getLogger("harness.serve")


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
        self.server = server  # harness.app.config.ServerConfig: the ceilings, request limits and queue size
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

    # -- who may ask ------------------------------------------------------------------------------
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
        value = parse_setting(await json_body(request, self.server.max_request_bytes), name, ceiling)
        apply(value)
        log.info("%s set to %s", name, value)
        return self.current()

    def set_budget(self, value: Optional[int]):
        planner = self.plan_options.get("planner")
        if value is None and needs_budget(planner):
            raise RequestError(422, f"max_tokens_per_microbatch: null is not allowed with planner={planner}, which "
                                    "plans by a token budget (this server's planner, fixed for its life)")
        return self.control.set_max_tokens_per_microbatch(value)

    def set_micro_batch_size(self, value: Optional[int]):
        # null puts back the size the server was started with
        return self.control.set_micro_batch_size(self.default_mbs if value is None else value)

    async def run_pass(self, pass_type: str, request: Request):
        """POST /forward and /forward_backward: the examples checked, queued behind the running pass, run."""
        from backends.messages import make_command

        body = await json_body(request, self.server.max_request_bytes)
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
        except UserError as exc:  # the planner refuses these examples at this budget (a peer, as its own code does)
            budget = self.control.read().max_tokens_per_microbatch
            log.info("%s refused: %s", pass_type, exc)
            return _error(422, f"{exc} (this server: max_tokens_per_microbatch={'null' if budget is None else budget},"
                               " set by POST /admin/set_max_tokens_per_microbatch)")
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
