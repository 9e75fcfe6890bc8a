"""backends/runtime/liveness.py: the window after which a silent rank is declared dead."""

from __future__ import annotations

import pytest


def test_the_liveness_window_is_read_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    from backends.runtime.liveness import _seconds_from_env

    monkeypatch.delenv("BALANCE_BATCH_STALE_AFTER_S", raising=False)
    assert _seconds_from_env("BALANCE_BATCH_STALE_AFTER_S", 15.0) == 15.0
    monkeypatch.setenv("BALANCE_BATCH_STALE_AFTER_S", "2.5")
    assert _seconds_from_env("BALANCE_BATCH_STALE_AFTER_S", 15.0) == 2.5
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv("BALANCE_BATCH_STALE_AFTER_S", bad)
        with pytest.raises(ValueError, match="BALANCE_BATCH_STALE_AFTER_S: must be a positive number of seconds, got "
                                             f"'{bad}'"):
            _seconds_from_env("BALANCE_BATCH_STALE_AFTER_S", 15.0)
