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


def test_a_collective_waited_for_on_the_host_raises_a_time_out_in_time():
    """The host wait that loading's broadcasts use on CUDA (backends/runtime/collectives.py): a real gloo work that
    completes returns; one that never completes (a peer that never joins, here a work that never finishes) raises
    a time-out in the rank, which loading names with backend.dist_timeout_s."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed import HashStore

    from backends.runtime.collectives import CollectiveTimeout, wait_until

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        work = dist.broadcast(torch.ones(4), src=0, async_op=True)
        wait_until(work, 5.0, "broadcast")
        assert work.is_completed()
    finally:
        dist.destroy_process_group()

    class NeverCompletes:
        def is_completed(self) -> bool:
            return False

    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="broadcast timed out: not completed after 0 s"):
        wait_until(NeverCompletes(), 0.2, "broadcast")
    assert 0.2 <= time.monotonic() - t0 < 2.0
