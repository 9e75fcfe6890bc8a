"""python -m harness.serve's checks before it binds its port or loads the model (harness/server/serve.py), run
in-process on the config Hydra composes; the real server is tests/integration/test_serve.py's."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import compose_config


@pytest.fixture
def serve_checks(monkeypatch):
    """``serve(cfg)``'s exit status on ``overrides``; a config that got past the checks would load the model, which
    fails the test at once instead of serving on a port."""
    from harness.server import serve as module

    def loaded(*args, **kwargs):
        raise AssertionError("the checks let this config through: the model would load")

    monkeypatch.setattr(module, "_serve_backend", loaded)
    return lambda *overrides: module.serve(compose_config("backend=pytorch", "server.port=0", *overrides))


@pytest.mark.parametrize("overrides, line", [
    # a search, not a budget: it served with none and answered every pass with a 500
    (["mtpm=auto"], "mtpm: auto searches for the fastest budget"),
    # loaded the model, then a KeyError from uvicorn
    (["server.log_level=bogus"],
     "server.log_level: 'bogus' is not a level (valid: critical, error, warning, info, debug, trace)"),
    # each started a server that refused everything
    (["server.queue_size=-1"], "server.queue_size: must be an integer >= 0"),
    (["server.max_request_tokens=0"], "server.max_request_tokens: must be a positive integer, got 0"),
    (["server.max_request_bytes=0"], "server.max_request_bytes: must be a positive integer, got 0"),
    (["server.mbs_ceiling=0"], "server.mbs_ceiling: must be a positive integer, got 0"),
    (["server.mtpm_ceiling=0"], "server.mtpm_ceiling: must be a positive integer, got 0"),
    (["mtpm=4096", "server.mtpm_ceiling=1000"], "server.mtpm_ceiling: 1000 is below the server's own mtpm=4096"),
    (["mbs=8", "server.mbs_ceiling=4"], "server.mbs_ceiling: 4 is below the server's own mbs=8"),
    (["server.port=70000"], "server.port: must be 0..65535"),
])
def test_what_a_server_cannot_serve_is_one_line_and_exit_2_before_the_model_loads(serve_checks, caplog, overrides,
                                                                                   line):
    with caplog.at_level(logging.ERROR, logger="harness.serve"):
        assert serve_checks(*overrides) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(line) and "\n" not in errors[0], errors


def test_the_values_at_their_edges_are_served():
    from harness.app.config import resolve_config
    from harness.server.serve import check_served

    check_served(resolve_config(compose_config("server.queue_size=0", "mtpm=4096", "server.mtpm_ceiling=4096",
                                               "server.log_level=warning", "server.port=0")))
