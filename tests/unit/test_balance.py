"""Balance measured from the ranks' step times: the rank clock, the timeline record, measured critical path and idle,
and how well a cost model predicts micro-batch times (backends/runtime/timeline.py, harness/metrics/balance.py)."""

from __future__ import annotations

import time

import pytest
import torch

from backends.runtime.timeline import CollectiveWaits, StepClock, busy_clock
from balance_batch import CostModel, plan_step
from balance_batch.stats import plan_stats
from harness.metrics.balance import (
    balance_fields,
    measured_balance,
    merge_timelines,
    microbatch_times,
    prediction_quality,
    timeline_record,
)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Peer:
    """A stand-in for a backend's collective: ``wait`` blocks as a rank whose peer is slower does."""

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)


def test_a_cpu_rank_clock_counts_the_time_in_its_collective_waits_apart_from_its_busy_time():
    peer = _Peer()
    with CollectiveWaits([(peer, "wait")], torch.device("cpu")) as waits:
        clock = StepClock(torch.device("cpu"), lockstep=True, waits=waits)
        assert clock.busy == "wall less collective waits"
        clock.start()
        peer.wait(0.02)  # before the first step: not any step's
        clock.mark()
        peer.wait(0.08)  # blocked, as a rank waiting in a collective
        _spin(0.01)
        clock.mark()
        _spin(0.05)  # computing
        clock.mark()
        rank = clock.finish()
    assert "wait" not in vars(peer)  # the wait point is put back after the block
    assert rank["step_s"][0] >= 0.09 and rank["step_s"][1] >= 0.05
    assert rank["wait_s"][0] >= 0.08 and rank["wait_s"][1] == 0
    # busy is the step less its wait (the spin's wall time: more than its 10 ms of CPU on a loaded machine)
    assert rank["busy_s"][0] == pytest.approx(rank["step_s"][0] - rank["wait_s"][0], abs=2e-6)
    assert rank["busy_s"][0] >= 0.005 and rank["busy_s"][1] == rank["step_s"][1]
    # the pieces are the whole region: before the first step, the steps, after the last one
    assert rank["start_s"] + sum(rank["step_s"]) + rank["sync_s"] == pytest.approx(rank["elapsed_s"], abs=1e-5)
    independent = StepClock(torch.device("cpu"), lockstep=False)  # no collective inside a step: busy is the step
    independent.start()
    independent.mark()
    time.sleep(0.03)
    independent.mark()
    rank = independent.finish()
    assert independent.busy == "wall" and rank["busy_s"] == rank["step_s"] and rank["step_s"][0] >= 0.03
    assert "wait_s" not in rank


def test_a_lockstep_ranks_busy_clock_says_its_waits_are_taken_out_on_either_device():
    assert busy_clock(torch.device("cpu"), lockstep=True) == "wall less collective waits"
    assert busy_clock(torch.device("cuda"), lockstep=True) == "cuda-events less collective waits"
    assert busy_clock(torch.device("cuda"), lockstep=False) == "cuda-events"


def _timeline(busy: list[list[list[float]]], elapsed: list[list[float]]) -> dict:
    """A recorded timeline: busy [repeat][rank][step], each rank's region [repeat][rank]; steps as long as busy."""
    return {"step_clock": "perf_counter", "busy_clock": "wall", "repeats": len(busy), "step_s": busy, "busy_s": busy,
            "start_s": [[0.0] * len(r) for r in busy], "sync_s": [[0.0] * len(r) for r in busy], "elapsed_s": elapsed}


def test_lockstep_ranks_wait_for_the_slowest_at_every_step_independent_ones_once():
    # rank 0 is slow in step 1, rank 1 in step 2: lock-step waits twice, independent ranks end even
    tl = _timeline([[[3.0, 1.0], [1.0, 3.0]]], [[6.0, 6.0]])
    lock = measured_balance(tl, lockstep=True)
    assert lock["measured_critical_path"] == pytest.approx((3 + 3) / 4, abs=1e-4)
    indep = measured_balance(_timeline([[[3.0, 1.0], [1.0, 3.0]]], [[4.0, 4.0]]), lockstep=False)
    assert indep["measured_critical_path"] == pytest.approx(1.0)
    # idle: the share of the slowest rank's region the rank was not busy
    assert lock["idle_fraction"] == [pytest.approx(1 - 4 / 6, abs=1e-4)] * 2
    uneven = measured_balance(_timeline([[[4.0], [1.0]]], [[4.0, 4.0]]), lockstep=False)
    assert uneven["measured_critical_path"] == pytest.approx(4 / 2.5, abs=1e-4)
    assert uneven["idle_fraction"] == [0.0, pytest.approx(0.75)] and uneven["busy_s"] == [4.0, 1.0]


def test_busy_times_are_averaged_over_repeats_before_the_step_maxima_are_taken():
    # two repeats whose noise puts the slow rank on either side: the mean is level, so the critical path is 1
    tl = _timeline([[[1.2], [1.0]], [[1.0], [1.2]]], [[1.2, 1.2], [1.2, 1.2]])
    assert measured_balance(tl, lockstep=True)["measured_critical_path"] == pytest.approx(1.0)


def test_the_timeline_record_keeps_every_repeat_and_merges_later_ones():
    def result(t: float) -> dict:
        rank = {"start_s": 0.1, "step_s": [t, t], "busy_s": [t, t], "sync_s": 0.2, "elapsed_s": 0.3 + 2 * t}
        return {"step_clock": "perf_counter", "busy_clock": "wall", "per_rank": [rank, rank]}

    rec = timeline_record([result(1.0), result(2.0)])
    assert rec["repeats"] == 2 and rec["step_s"] == [[[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2]
    assert rec["elapsed_s"] == [[2.3, 2.3], [4.3, 4.3]] and rec["busy_clock"] == "wall"
    merged = merge_timelines(rec, timeline_record([result(3.0)]))
    assert merged["repeats"] == 3 and merged["busy_s"][-1] == [[3.0, 3.0]] * 2
    assert timeline_record([result(1.0), None]) is None  # a repeat with no times: no timeline, not a partial one


def test_a_cost_model_that_is_proportional_to_the_times_predicts_them_exactly():
    costs = [1.0, 2.0, 5.0, 9.0]
    q = prediction_quality([0.5 * c for c in costs], costs)
    assert (
        q["r2"] == pytest.approx(1.0) and q["worst_rel_err"] == pytest.approx(0.0) and q["scale"] == pytest.approx(0.5)
    )
    off = prediction_quality([1.0, 1.0, 1.0, 4.0], [1.0, 2.0, 3.0, 4.0])
    assert off["r2"] < 0.9 and off["worst_rel_err"] > 0.3
    # a balanced plan's micro-batches cost about the same: the times differ by noise, which R² would call unexplained
    level = prediction_quality([1.0, 1.1, 0.95], [1.0, 1.02, 0.99])
    assert level["r2"] is None and level["worst_rel_err"] < 0.15


def test_measured_steps_pair_with_the_micro_batches_each_rank_ran():
    lengths = [100, 50, 400, 30]
    schedules = [[[2], [0]], [[1, 3], None]]  # rank 1's second step is a dummy
    busy = [[[4.0, 1.0], [0.8, 0.1]]]
    lock = _timeline(busy, [[5.0, 5.0]])
    pairs = microbatch_times(lock, schedules, lockstep=True)
    assert pairs == [([2], 4.0), ([0], 1.0), ([1, 3], 0.8), (None, 0.1)]
    assert microbatch_times(_timeline([[[4.0, 1.0], [0.8]]], [[5.0, 5.0]]), schedules, lockstep=False) == \
        [([2], 4.0), ([0], 1.0), ([1, 3], 0.8)]  # an independent rank skips its dummy
    assert microbatch_times(lock, [[[2]], [[1, 3]]], lockstep=True) is None  # not the plan that ran: nothing paired
    tokens = CostModel(1.0, 0.0, "tokens")
    fields = balance_fields(lock, schedules, lengths, "packed", True, {"flops": tokens})
    assert fields["cost_prediction"]["flops"]["micro_batches"] == 3  # the dummy has no modeled cost: left out
    assert fields["measured_critical_path"] == pytest.approx((4.0 + 1.0) / ((5.0 + 0.9) / 2), abs=1e-4)
    assert balance_fields(None, schedules, lengths, "packed", True, {"flops": tokens}) == {}


def test_modeled_idle_per_rank_is_the_share_of_the_pass_it_waits():
    kw = dict(world_size=2, max_tokens_per_microbatch=None, layout="padded", planner="greedy",
              cost_model=CostModel(1.0, 0.0, "tokens"))
    plan = plan_step([400, 100, 100, 100], **kw)
    # greedy dealt like cards: rank 0 runs 400 and 100, rank 1 100 and 100; lock-step steps cost 400 and 100
    assert plan.stats.idle_fraction == [0.0, pytest.approx(1 - 200 / 500)]
    indep = plan_step([400, 100, 100, 100], lockstep=False, **kw)
    assert indep.stats.idle_fraction == [0.0, pytest.approx(1 - 200 / 500)]


def test_a_fixed_cost_per_micro_batch_is_counted_once_per_micro_batch_and_never_for_a_dummy():
    cm = CostModel(1.0, 0.0, "test", c=10.0, fixed=100.0)
    st = plan_stats([[[0, 1], [2]], [[3], None]], [5, 5, 5, 5], layout="packed", cost_model=cm, lockstep=True)
    assert st.cost_per_rank == [pytest.approx(100 + 2 * 15 + 100 + 15), pytest.approx(100 + 15)]
    padded = plan_stats([[[0, 1]]], [5, 3], layout="padded", cost_model=cm)
    assert padded.cost_per_rank == [pytest.approx(100 + 2 * (10 + 5))]  # padded: every row as long as the longest


def test_a_flop_cost_models_dict_is_what_it_was_and_a_calibrated_one_round_trips():
    flops = CostModel(2.0, 3.0, "config")
    assert flops.as_dict() == {"a": 2.0, "b": 3.0, "source": "config"}
    assert flops.sequence(10) == 2.0 * 10 + 3.0 * 100
    fit = {"coefficients": {"c0": 1.0}, "r2": 0.99}
    calibrated = CostModel(2.0, 3.0, "calibrated", c=4.0, fixed=5.0, fit=fit)
    back = CostModel.from_dict(calibrated.as_dict())
    assert back == calibrated and back.fit == fit and back.sequence(10) == 2.0 * 10 + 3.0 * 100 + 4.0
