"""The control file a hot sweep and the server read, in-process (hot sweeps themselves:
tests/integration/test_hot.py)."""

from __future__ import annotations

import pytest

from backends.runtime.control import BatchingSettings, ControlFile


def test_control_file_round_trip_and_corruption(tmp_path, caplog):
    ctl = ControlFile(tmp_path / "c.ctl", BatchingSettings(None, 1))
    assert (ctl.path.stat().st_mode & 0o777) == 0o600
    assert ctl.read() == BatchingSettings(None, 1)
    ctl.set_max_tokens_per_microbatch(4096)
    ctl.set_micro_batch_size(3)
    assert ctl.read() == BatchingSettings(4096, 3)
    other = ControlFile(ctl.path)  # another reader of the same file sees the same values
    assert other.read() == BatchingSettings(4096, 3)
    ctl.path.write_text('{"max_tokens_per_microbatch": -5, "micro_batch_size": 1}')
    with caplog.at_level("WARNING"):
        assert other.read() == BatchingSettings(4096, 3)
        assert other.read() == BatchingSettings(4096, 3)
    assert sum("corrupt" in r.message for r in caplog.records) == 1
    ctl.path.unlink()
    assert other.read() == BatchingSettings(4096, 3)  # a missing file keeps the last good value too
    with pytest.raises(ValueError):
        ctl.set_max_tokens_per_microbatch(0)
    assert not list(tmp_path.glob(".c.ctl.*"))  # no temporary files left behind


def test_a_budget_required_file_never_takes_unset_as_good(tmp_path, caplog):
    """A balanced server's file given "unset" keeps the last budget, never becomes the good one."""
    ctl = ControlFile(tmp_path / "c.ctl", BatchingSettings(4096, 1), budget_required=True)
    ctl.path.write_text('{"max_tokens_per_microbatch": "unset", "micro_batch_size": 1}')
    with caplog.at_level("WARNING"):
        assert ctl.read() == BatchingSettings(4096, 1)
    assert any("not allowed with planner=balanced" in r.message for r in caplog.records)
    ctl.path.write_text("not json")  # a later corrupt file still keeps the budget, not "unset"
    assert ctl.read() == BatchingSettings(4096, 1)
    ctl.path.write_text('{"max_tokens_per_microbatch": 2048, "micro_batch_size": 1}')
    assert ctl.read() == BatchingSettings(2048, 1)
    # Without the requirement (a greedy server), "unset" means fixed-size slices, as before.
    plain = ControlFile(tmp_path / "d.ctl", BatchingSettings(4096, 1))
    plain.path.write_text('{"max_tokens_per_microbatch": "unset", "micro_batch_size": 2}')
    assert plain.read() == BatchingSettings(None, 2)
