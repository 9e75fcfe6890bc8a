"""A rank NCCL's watchdog ended is named in one line from what it wrote to stderr (backends/runtime/failures.py)."""

from __future__ import annotations

import pytest

from backends.runtime.failures import collective_timeout

pytestmark = pytest.mark.unit

# torch's ProcessGroupNCCL watchdog line, as a rank writes it before the process is aborted
WATCHDOG = ("[rank1]:[E1203 18:00:00.000000 7 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=4096, NumelOut=4096, Timeout(ms)=600000) ran for "
            "600042 milliseconds before timing out.")


def test_a_collective_the_watchdog_timed_out_names_the_time_out_key_in_one_line():
    line = collective_timeout(f"some warning\n{WATCHDOG}\nterminate called", 1, "start-up", 600)
    assert line is not None and "\n" not in line
    assert line.startswith("rank 1: a broadcast (collective 7) timed out after 600 s during start-up")
    assert "backend.dist_timeout_s=600" in line
    assert collective_timeout("a rank's ordinary warning", 1, "start-up", 600) is None
    assert collective_timeout(None, 0, "start-up", 600) is None
