"""The planning modules import without torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_planning_modules_do_not_import_torch():
    code = (
        "import sys, backends.planning, backends.planning, backends.model.configs; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
