"""MFU: model FLOPs from the cost model, hardware FLOPs from the plan, peaks by device."""

from __future__ import annotations

import math
import re

import pytest

from balance_batch import CostModel, plan_step
from harness.metrics.flops import checked_mfu, device_peak, flops_record, gpu_peak_flops, pass_flops

COST = CostModel(a=100.0, b=2.0, source="test")
LENGTHS = [10, 3, 7]


def greedy(world_size, layout="padded", lockstep=False):
    """The original greedy plan of LENGTHS at a budget of 20 tokens."""
    return plan_step(LENGTHS, world_size=world_size, max_tokens_per_microbatch=20, layout=layout, planner="greedy",
                     lockstep=lockstep, cost_model=COST)


def test_model_flops_count_real_sequences_and_three_forwards_for_backward():
    plan = greedy(1, layout="padded")
    fwd = sum(100 * n + 2 * n * n for n in LENGTHS)  # 1000+200, 300+18, 700+98
    padded = sum(plan.stats.cost_per_rank)
    assert padded > fwd  # padding is computed but is not model work
    assert pass_flops("forward", LENGTHS, COST, plan.stats.cost_per_rank, False) == (fwd, padded)
    assert pass_flops("forward_backward", LENGTHS, COST, plan.stats.cost_per_rank, False) == (3 * fwd, 3 * padded)
    # gradient checkpointing recomputes one forward: hardware work, not model work
    assert pass_flops("forward_backward", LENGTHS, COST, plan.stats.cost_per_rank, True) == (3 * fwd, 4 * padded)


def test_packed_hardware_flops_are_the_model_flops():
    plan = greedy(1, layout="packed")
    model, hardware = pass_flops("forward", LENGTHS, COST, plan.stats.cost_per_rank, False)
    assert math.isclose(model, hardware)


def test_mfu_is_model_flops_per_second_per_device_over_the_peak():
    plan = greedy(2, lockstep=True).stats.as_dict()
    rec = flops_record("forward", LENGTHS, COST, plan, False, [2.0, 4.0], 2, {"flops_per_device": 1000.0})
    fwd = sum(100 * n + 2 * n * n for n in LENGTHS)
    assert math.isclose(rec["model_flops_per_s_per_device"], fwd / 3.0 / 2)
    assert math.isclose(rec["mfu_pct"], 100 * fwd / 3.0 / 2 / 1000.0)
    assert flops_record("forward", LENGTHS, COST, plan, False, [1.0], 2, {"flops_per_device": None})["mfu_pct"] is None


def test_an_mfu_over_100_percent_measures_the_cpu_peak_again_or_is_recorded_null_with_why():
    """A CPU peak measured on a busy machine reads low (an MFU of 684% was recorded): measured again, the MFU is
    against the new peak; still over 100% (or against a data sheet), null with the reason, never a number."""
    plan = greedy(1).stats.as_dict()
    real = {"flops_per_device": 65e9, "source": "measured: float32 1024³ matmul on all cores = 65.0 GFLOP/s"}
    busy = {"flops_per_device": real["flops_per_device"] / 50, "source": "measured: on a busy machine"}
    seconds = fwd_flops() / (1.2 * busy["flops_per_device"])  # 120% of the busy peak, 2.4% of the real one
    rec = flops_record("forward", LENGTHS, COST, plan, False, [seconds], 1, busy)
    assert rec["mfu_pct"] > 100
    settled, peak, warning = checked_mfu(rec, busy, lambda: real)
    assert warning is None and peak is real and 0 < settled["mfu_pct"] < 100
    impossible = {**rec, "model_flops_per_s_per_device": 2 * real["flops_per_device"], "mfu_pct": 1e4}
    settled, peak, warning = checked_mfu(impossible, busy, lambda: real)
    assert settled["mfu_pct"] is None and settled["mfu_out_of_range"] == warning and warning.startswith("MFU 200% ")
    sheet = {"flops_per_device": 1.0, "source": "dense bfloat16 data-sheet peak"}
    settled, peak, warning = checked_mfu(rec, sheet, lambda: pytest.fail("a data sheet is not measured again"))
    assert settled["mfu_pct"] is None and peak is sheet and "data-sheet" in warning
    assert checked_mfu({**rec, "mfu_pct": 55.0}, busy, lambda: real) == ({**rec, "mfu_pct": 55.0}, busy, None)


def fwd_flops() -> float:
    return float(sum(100 * n + 2 * n * n for n in LENGTHS))


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA B200", 2.25e15), ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12),
     ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12),
     ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", None)],
)
def test_gpu_peaks_come_from_the_table(name, peak):
    assert gpu_peak_flops(name) == peak
    got = device_peak({"type": "cuda", "name": name}, 4, "bfloat16")
    assert got["flops_per_device"] == peak and (peak is not None or "no MFU" in got["source"])
    fp32 = device_peak({"type": "cuda", "name": name}, 4, "float32")  # a float32 run: no tensor-core peak
    assert (fp32["flops_per_device"] is None) == (peak is None)
    if peak is not None:
        assert fp32["flops_per_device"] < peak / 10 and "float32" in fp32["source"]


def test_a_cpu_peak_is_measured_and_split_over_ranks():
    one, two = device_peak({"type": "cpu"}, 1), device_peak({"type": "cpu"}, 2)
    assert one["flops_per_device"] > 1e8 and "measured" in one["source"]
    assert math.isclose(two["flops_per_device"], one["flops_per_device"] / 2)
    bf16 = device_peak({"type": "cpu"}, 1, "bfloat16")  # a bf16 run is measured against bf16 matmuls
    assert bf16["flops_per_device"] > 1e7 and re.search(r"bfloat16 (256|512|1024)³ matmul", bf16["source"])


def test_lora_backward_is_not_two_forwards_more():
    """With LoRA the frozen base gets input gradients only: fwd+bwd is about 2x forward plus attention and adapters."""
    from backends.model.configs import SHIPPED_CONFIGS
    from harness.metrics.flops import training_flops_from_config

    lengths = [4096, 1000]
    for name in SHIPPED_CONFIGS:
        full = training_flops_from_config(SHIPPED_CONFIGS[name], 0)
        lora = training_flops_from_config(SHIPPED_CONFIGS[name], 32)
        f_full, fb_full = (pass_flops(p, lengths, full, [], False)[0] for p in ("forward", "forward_backward"))
        f_lora, fb_lora = (pass_flops(p, lengths, lora, [], False)[0] for p in ("forward", "forward_backward"))
        assert fb_full == pytest.approx(3 * f_full, rel=1e-12)
        assert 2.0 < fb_lora / f_lora < 2.7, name
        assert f_lora > f_full  # the adapters' own matmuls


def test_hardware_flops_from_the_micro_batches_as_run():
    from backends.model.configs import SHIPPED_CONFIGS
    from harness.metrics.flops import training_flops_from_config

    flops = training_flops_from_config(SHIPPED_CONFIGS["tiny"], 0)
    schedules = [[[0, 1], None], [[2]]]  # a dummy step computes nothing
    fwd = flops.forward
    _, padded = pass_flops("forward", LENGTHS, flops, [], False, schedules=schedules, layout="padded")
    assert padded == pytest.approx(2 * fwd(10) + fwd(7))
    _, packed = pass_flops("forward", LENGTHS, flops, [], False, schedules=schedules, layout="packed")
    assert packed == pytest.approx(sum(fwd(n) for n in LENGTHS))
    model, fb = pass_flops("forward_backward", LENGTHS, flops, [], True, schedules=schedules, layout="packed")
    # full fine-tuning with the chunked head: backward recomputes the head's logits; checkpointing one forward
    assert fb == pytest.approx(model + packed + flops.head_recompute * sum(LENGTHS))
