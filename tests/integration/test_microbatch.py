"""The planner imports without torch (checked in a fresh interpreter)."""

from __future__ import annotations

import sys


def test_planner_does_not_import_torch():
    import subprocess

    code = "import sys, balance_batch; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
