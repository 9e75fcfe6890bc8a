"""Client mode: the benchmark protocol against a running ``python -m harness.serve`` (the published procedure)."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

import torch

from backends.backend import Backend
from backends.errors import BackendError, UserError
from backends.messages import PassResult

log = logging.getLogger("harness.client")  # the log channel's name, kept when the module moved

TOKEN_ENV = "BALANCE_BATCH_ADMIN_TOKEN"


class RemoteBackend(Backend):
    """A Backend whose passes run on a server; its processes are sampled when the server is on this machine."""

    def __init__(self, url: str, timeout_s: float = 3600.0):
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise UserError(f"target.url: '{url}' is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.local = is_loopback(parsed.hostname)
        try:
            self.info = self._request("GET", "/healthz", timeout=10)
        except BackendError as exc:
            raise UserError(f"target.url: no ready server at {self.url} ({exc})") from None
        self.name = self.info["backend"]
        self.world_size = int(self.info["world_size"])
        self.device = torch.device(self.info["device"]["type"])
        self.vocab_size = int(self.info["vocab_size"])
        self.model_info = self.info.get("model")
        self.precision = self.info.get("precision")  # the server's policy, as it reported it
        self.load_info = self.info.get("load")  # how the server loaded its (current) workers
        # How the server plans every pass (fixed for its life); None from a server that does not say.
        self.layout: Optional[str] = self.info.get("layout")
        self.planner: Optional[str] = self.info.get("planner")
        # None is "no cap" (also from a server that does not say: it predates the cap and plans without one).
        self.max_seqs_per_microbatch: Optional[int] = self.info.get("max_seqs_per_microbatch")
        self.cost_model: Optional[dict] = self.info.get("cost_model")
        # (max_tokens_per_microbatch, micro_batch_size) every pass of this run must report in its plan
        self.batching: Optional[tuple[Optional[int], int]] = None
        self._to_set: Optional[str] = None  # the admin token, while configure's values wait for apply

    def _request(
        self, method: str, path: str, body: Any = None, timeout: Optional[float] = None, token: Optional[str] = None
    ):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("detail")
            except Exception:  # noqa: BLE001 - a body that is not our JSON: the status's reason says enough
                detail = exc.reason
            raise BackendError(f"server {self.url}{path} answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise BackendError(f"server {self.url}{path} unreachable: {getattr(exc, 'reason', exc)}") from None

    def configure(self, max_tokens_per_microbatch: Optional[int], micro_batch_size: int) -> tuple[Optional[int], int]:
        """The budget and micro-batch size this run will have the server run; returns them, to be recorded and
        planned with. Nothing is set on the server yet: ``apply`` sets them once the plan is known to be valid, so
        a run refused before it measures leaves the server's batching as it found it.

        With the admin token the values will be set. Without it they cannot be, so a
        request the server does not already run is refused: recording it would
        label the server's numbers with a budget that never ran.
        """
        token = os.environ.get(TOKEN_ENV)
        if token:
            self.batching = (max_tokens_per_microbatch, micro_batch_size)
            self._to_set = token
            return self.batching
        info = self._request("GET", "/healthz", timeout=10)
        server_mtpm, server_mbs = info["max_tokens_per_microbatch"], int(info["micro_batch_size"])
        unset = f"without {TOKEN_ENV} this run cannot change it"
        if server_mtpm != max_tokens_per_microbatch:
            raise UserError(
                f"mtpm: the server at {self.url} runs max_tokens_per_microbatch={_show(server_mtpm)}, not "
                f"{_show(max_tokens_per_microbatch)}; {unset}: rerun with mtpm={_show(server_mtpm)}, or set {TOKEN_ENV}"
            )
        if server_mtpm is None and server_mbs != micro_batch_size:
            raise UserError(
                f"mbs: the server at {self.url} runs micro_batch_size={server_mbs}, not {micro_batch_size}; "
                f"{unset}: rerun with mbs={server_mbs}, or set {TOKEN_ENV}"
            )
        # With a budget set, micro_batch_size is not used by the planner: record the server's.
        self.batching = (server_mtpm, server_mbs)
        return self.batching

    def apply(self) -> None:
        """Set what ``configure`` decided on the server (with the admin token; without it the server runs it
        already)."""
        token, self._to_set = self._to_set, None
        if token and self.batching is not None:
            mtpm, mbs = self.batching
            self._request("POST", "/admin/set_max_tokens_per_microbatch", {"value": mtpm}, 30, token)
            self._request("POST", "/admin/set_micro_batch_size", {"value": mbs}, 30, token)

    def describe_device(self) -> dict:
        return dict(self.info["device"])

    def pids(self) -> list[int]:
        return [int(p) for p in self.info.get("pids", [])] if self.local else []

    def run_pass(self, command: dict[str, Any]) -> PassResult:
        body = {
            "examples": [
                {
                    "input_ids": e.input_ids.tolist(),
                    "target_tokens": e.target_tokens.tolist(),
                    "weights": e.weights.tolist(),
                }
                for e in command.examples
            ]
        }
        reply = self._request("POST", f"/{command.pass_type}", body)
        plan = reply["plan"]
        used = (plan.get("max_tokens_per_microbatch"), plan.get("micro_batch_size"))
        if self.batching is not None and used != self.batching:
            # The server's plan is authoritative: someone changed its batching during this run.
            raise BackendError(
                f"the server ran this {command.pass_type} pass with max_tokens_per_microbatch={_show(used[0])}, "
                f"micro_batch_size={used[1]}, but this run records {_show(self.batching[0])}, {self.batching[1]}: "
                "its batching was changed during the run (another client's admin call?); "
                "the point is not recorded as ok"
            )
        return PassResult.from_dict(reply)


def _show(value: Optional[int]) -> str:
    return "null" if value is None else str(value)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
