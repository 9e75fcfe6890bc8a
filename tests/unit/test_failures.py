"""The failure rule, written once (backends/runtime/failures.py blame): out of memory first, else a peer, else the
rank."""

from __future__ import annotations

import time

from backends.runtime.failures import Failure, blame


def test_a_dead_peer_is_blamed_over_the_error_it_caused():
    """A rank's collective failing after a peer died names the peer first, with the rank's own line after it."""
    asked = []

    def find_peer():
        asked.append(1)
        return Failure("rank 1 was killed by SIGKILL") if len(asked) >= 3 else None  # the death trails the error

    got = blame("error", 0, "RuntimeError: Connection reset by peer", "tb", "forward", find_peer, wait_s=5.0, poll_s=0)
    assert (
        got.message
        == "rank 1 was killed by SIGKILL during forward (rank 0 then failed: RuntimeError: Connection reset by peer)"
    )
    assert (got.details, got.status) == ("tb", "error")  # the peer has no traceback: the rank's own is kept


def test_out_of_memory_is_reported_at_once_and_a_peers_oom_as_it_is():
    never = lambda: (_ for _ in ()).throw(AssertionError("an OOM needs no peer"))  # noqa: E731
    assert blame("oom", 1, "out of memory in forward_backward", None, "forward_backward", never, 5.0) == \
        Failure("out of memory in forward_backward", None, "oom")
    peer_oom = Failure("out of memory in forward on rank 1", "tb1", "oom")
    assert blame("error", 0, "gloo: connection closed", "tb0", "forward", lambda: peer_oom, 5.0) == peer_oom


def test_with_no_peer_to_blame_the_rank_names_itself_after_the_wait():
    t0 = time.monotonic()
    got = blame("error", 2, "ValueError: bad\nsecond line", "tb", "forward", lambda: None, wait_s=0.2, poll_s=0.05)
    assert time.monotonic() - t0 >= 0.2
    assert got == Failure("rank 2 failed during forward: ValueError: bad", "tb", "error")
