"""A lock-step rank's busy time excludes its collective waits: on FSDP2's deliberately uneven plan (rank 0 the two
long sequences, rank 1 the two short; tests/backend_runs.py, bf16, shared with test_balance) the measured idle and
critical path track what the plan's cost model says, and the waits are recorded apart."""

from __future__ import annotations

import pytest

from harness.metrics.balance import measured_balance, timeline_record


def test_fsdp2_measured_idle_tracks_the_modeled_idle_of_an_uneven_plan(backend_runs):
    result = backend_runs["fsdp2", "bfloat16", False]["uneven"]
    modeled = result.plan
    balance = measured_balance(timeline_record([result.timeline]), lockstep=True)
    assert result.timeline["busy_clock"] == "wall less collective waits"
    # modeled: rank 1 idles 96% (128 of 2,900 tokens), the critical path is 1.92
    assert modeled["idle_fraction"][1] > 0.9 and modeled["critical_path"] > 1.8, modeled
    idle = balance["idle_fraction"]
    # measured: the rank with little work is seen waiting for most of the pass (0.95 on a quiet machine; a rank
    # waiting for a core is busy on the wall clock, 0.76 at a load of 9 on 2 cores); the busy rank's idle is its
    # own share of the collectives (on gloo their transfers too), far under the other's
    assert idle[1] > modeled["idle_fraction"][1] - 0.3, (balance, modeled)
    assert idle[0] < 0.4 and idle[0] < idle[1] - 0.3, balance
    assert balance["measured_critical_path"] > 0.7 * modeled["critical_path"], (balance, modeled)
    rank0, rank1 = result.timeline["per_rank"]
    for s in range(2):  # each step: its wait and its busy time make up the step; the short rank waits most of it
        for rank in (rank0, rank1):
            assert rank["busy_s"][s] + rank["wait_s"][s] == pytest.approx(rank["step_s"][s], abs=1e-5)
        assert rank1["wait_s"][s] > 0.5 * rank1["step_s"][s] > rank0["wait_s"][s], (rank0, rank1)
