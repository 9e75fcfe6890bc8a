"""bench.profile's breakdown (backends/runtime/profiling.py), exact on a hand-made trace (real passes' traces:
tests/integration/test_profile.py)."""

from __future__ import annotations

import pytest

from backends.runtime.profiling import CATEGORIES, PASS_RANGE, breakdown, category

pytestmark = pytest.mark.unit


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def test_a_hand_made_timeline_is_split_exactly():
    events = [
        _x(PASS_RANGE, 0, 1000, cat="user_annotation"),
        _x("aten::mm", 0, 300), _x("aten::copy_", 100, 50),  # a matmul with a copy inside it
        _x("balance_batch/delta_rule", 300, 300, cat="user_annotation"), _x("aten::bmm", 320, 180),
        _x("autograd::engine::evaluate_function: MmBackward0", 600, 300), _x("aten::mm", 610, 190),
        _x("c10d::allreduce_", 900, 50),
        _x("aten::mm", 10, 500, tid=2),  # another thread (a gloo worker): not the pass's timeline
        _x("aten::mm", 1200, 100),  # after the pass
        {"ph": "i", "name": "marker", "ts": 5},  # not a complete event
    ]
    got = breakdown({"traceEvents": events})
    s = got["seconds"]
    assert got["pass_s"] == pytest.approx(1e-3)
    assert s["other_matmuls"] == pytest.approx(250e-6) and s["other"] == pytest.approx(50e-6)
    assert s["delta_rule"] == pytest.approx(300e-6)  # the range's own 120 µs and its bmm's 180
    assert s["backward"] == pytest.approx(300e-6) and s["collectives"] == pytest.approx(50e-6)
    assert s["idle"] == pytest.approx(50e-6)  # 950..1000 and nothing else: no operator covers it
    assert got["covered_s"] == pytest.approx(got["pass_s"])
    assert sum(got["shares"].values()) == pytest.approx(1.0) and set(got["shares"]) == set(CATEGORIES)
    assert got["top_ops"][0]["name"] == "balance_batch/delta_rule" or got["top_ops"][0]["self_s"] >= 180e-6
    with pytest.raises(ValueError, match="no 'balance_batch/pass' range"):
        breakdown({"traceEvents": events[1:]})


@pytest.mark.parametrize("name, stack, expected", [
    ("aten::_scaled_dot_product_flash_attention_for_cpu", ["aten::scaled_dot_product_attention"], "attention"),
    ("aten::mm", ["balance_batch/logprob_head"], "logprob_head"),
    ("aten::mm", ["autograd::engine::evaluate_function: MmBackward0"], "backward"),
    ("record_param_comms", ["autograd::engine::evaluate_function: X", "nccl:all_reduce"], "collectives"),
    ("aten::copy_", ["autograd::engine::evaluate_function: X", "FSDP::post_backward_reduce (layers.0)"], "collectives"),
    ("aten::_grouped_mm", [], "moe_experts"),
    ("aten::convolution", ["aten::conv1d"], "convolution"),
    ("aten::addmm", ["aten::linear"], "other_matmuls"),
    ("aten::mul", [], "other"),
])
def test_categories(name, stack, expected):
    assert category(name, stack) == expected


def _loop(tmp_path, n_steps: int, **options) -> tuple[dict, set]:
    """``n_steps`` marked iterations of real work under ``profiled``; returns the record and the iterations the
    trace holds."""
    import torch

    from backends.runtime.profiling import profiled, read_trace

    x = torch.randn(64, 64)
    with profiled(str(tmp_path), "forward", 0, torch.device("cpu"), n_steps, **options) as profile:
        for k in range(n_steps):
            with torch.profiler.record_function(f"iteration{k}"):
                for _ in range(5):
                    x = torch.tanh(x @ x)
            profile.step()
    if not profile:
        return profile, set()
    names = {e.get("name") for e in read_trace(profile["trace"])["traceEvents"]}
    return profile, {n for n in names if str(n).startswith("iteration")}


def test_a_profile_holds_only_its_window_of_steps_and_says_how_big_it_is(tmp_path):
    import os

    profile, seen = _loop(tmp_path, 6, steps=2, ranks=(0,))
    assert seen == {"iteration1", "iteration2"}, seen  # the first step is the profiler's warm-up, the rest not kept
    assert profile["steps"] == [1, 2] and profile["memory"] is False
    assert profile["trace_bytes"] == os.path.getsize(profile["trace"]) > 0 and profile["events"] > 10
    got = profile["breakdown"]
    assert got["covered_s"] == pytest.approx(got["pass_s"]) and got["seconds"]["other"] > 0
    # tanh and mm: 5 per step, two steps (by name: on a loaded machine a range's own time, the gaps between its
    # operators, can outweigh either, so neither need come first)
    calls = {op["name"]: op["calls"] for op in got["top_ops"]}
    assert calls.get("aten::tanh") == calls.get("aten::mm") == 10, got["top_ops"]

    whole, seen = _loop(tmp_path, 3, steps=3)  # no more steps than the window: the whole pass
    assert seen == {"iteration0", "iteration1", "iteration2"} and whole["steps"] == [0, 2]

    other_rank, seen = _loop(tmp_path, 6, ranks=(1,))  # rank 0 is not asked: nothing profiled, step() is free
    assert other_rank == {} and seen == set()


@pytest.mark.parametrize("overrides, message", [
    (("bench.profile_steps=5",), "bench.profile_steps: says what a profiled run records, and bench.profile=false"),
    (("bench.profile=true", "bench.profile_steps=-1"), "bench.profile_steps: must be >= 0"),
    (("bench.profile=true", "bench.profile_ranks=[]"), "bench.profile_ranks: a list of rank numbers"),
])
def test_a_profile_setting_the_run_cannot_honour_is_one_line(overrides, message):
    from backends.errors import UserError
    from harness.app.config import resolve_config
    from tests.unit.test_answer import _compose

    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        resolve_config(_compose(*overrides))
    every_rank = resolve_config(_compose("bench.profile=true", "bench.profile_ranks=null", "bench.profile_steps=0"))
    assert every_rank.bench.profile_ranks is None and every_rank.bench.profile_steps == 0
