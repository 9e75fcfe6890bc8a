"""The served backend's supervision: whether it can run a pass, and its workers started again once they died."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from backends.errors import BackendError, first_line

log = logging.getLogger("harness.serve")


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
