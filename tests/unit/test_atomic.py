"""Atomic writes: a reader sees the old content or the new, and the file gets the mode a plain write would give it."""

from __future__ import annotations

import os

from backends.runtime.atomic import write_text_atomic
from harness.point.results import write_json_atomic, write_plan_json


def test_atomic_writes_follow_the_umask_like_every_other_file(tmp_path):
    """results.json and plan.json were once created 0600 (mkstemp's mode) while other files were 0644."""
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "results.json", {"status": "ok"})
        write_plan_json(tmp_path / "plan.json", {"version": 1})
        (tmp_path / "plain.txt").write_text("x")
        os.umask(0o077)
        write_text_atomic(tmp_path / "private.json", "{}")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes["results.json"] == modes["plan.json"] == modes["plain.txt"] == 0o644
    assert modes["private.json"] == 0o600  # a stricter umask is followed too
    write_text_atomic(tmp_path / "secret.ctl", "{}", mode=0o600)  # an explicit mode still wins
    assert (tmp_path / "secret.ctl").stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind
