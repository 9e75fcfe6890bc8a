"""Model FLOPs, achieved FLOP/s and MFU of a pass, from the planner's cost model and a device peak.

Model FLOPs count the useful work only: the forward cost a·L + b·L² of every
real sequence (backends/planning/cost.py), three times that for forward +
backward (the usual convention: backward costs twice the forward). Hardware
FLOPs are what the device actually computed: the plan's modeled cost
(padding included, for the padded layout) and, with gradient checkpointing,
one more forward for the recomputation. MFU = model FLOP/s per device ÷ the
device's dense peak.
"""

from __future__ import annotations

import functools
import time
from typing import Optional, Sequence

from backends.microbatch import CostModel

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s per device, from the vendors' data sheets.
# The first key found in torch.cuda.get_device_name wins, so a variant comes before its family's
# bare name: "NVIDIA H200 NVL" must not match "H200" (the SXM part, e.g. "NVIDIA H200").
GPU_PEAK_BF16 = (
    ("B200", 2.25e15),
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # SXM
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312e12),
)
BACKWARD_FACTOR = 3.0  # forward + backward = 3 forwards (model FLOPs)


def gpu_peak_flops(name: str) -> Optional[float]:
    """The dense bf16 peak of a GPU by its name, None for a device not in the table."""
    upper = name.upper()
    for key, peak in GPU_PEAK_BF16:
        if key.upper() in upper:
            return peak
    return None


@functools.lru_cache(maxsize=None)
def measured_cpu_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """This machine's float32 matrix-multiply rate with all its threads (best of ``repeats``), measured once per process."""
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)  # warm-up: thread pool and caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def device_peak(device: dict, world_size: int) -> dict:
    """{"flops_per_device": peak or None, "source": where it came from} for the devices a run uses."""
    if device.get("type") == "cuda":
        peak = gpu_peak_flops(str(device.get("name", "")))
        source = "dense bf16 data-sheet peak" if peak else f"unknown device {device.get('name')!r}: no peak, no MFU"
        return {"flops_per_device": peak, "source": source}
    machine = measured_cpu_matmul_flops()
    # CPU ranks split the machine's cores between them (backends/workers.py), so each gets its share.
    return {
        "flops_per_device": machine / max(1, world_size),
        "source": f"measured: float32 1024³ matmul on all cores = {machine / 1e9:.1f} GFLOP/s, split over {world_size} rank(s)",
    }


def pass_flops(
    pass_type: str,
    lengths: Sequence[int],
    cost_model: CostModel,
    plan_cost_per_rank: Sequence[float],
    gradient_checkpointing: bool,
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one pass."""
    forward_model = sum(cost_model.sequence(n) for n in lengths)
    forward_hardware = float(sum(plan_cost_per_rank)) or forward_model
    if pass_type == "forward":
        return forward_model, forward_hardware
    recompute = forward_hardware if gradient_checkpointing else 0.0
    return BACKWARD_FACTOR * forward_model, BACKWARD_FACTOR * forward_hardware + recompute


def flops_record(
    pass_type: str,
    lengths: Sequence[int],
    cost_model: CostModel,
    plan: dict,
    gradient_checkpointing: bool,
    elapsed_s: Sequence[float],
    world_size: int,
    peak: dict,
) -> dict:
    """The FLOPs fields of a pass in results.json (``passes.<type>``)."""
    model, hardware = pass_flops(pass_type, lengths, cost_model, plan.get("cost_per_rank") or [], gradient_checkpointing)
    mean_s = sum(elapsed_s) / len(elapsed_s)
    per_device = model / mean_s / max(1, world_size)
    peak_flops = peak.get("flops_per_device")
    return {
        "model_flops": model,
        "hardware_flops": hardware,
        "model_flops_per_s_per_device": per_device,
        "hardware_flops_per_s_per_device": hardware / mean_s / max(1, world_size),
        "mfu_pct": 100.0 * per_device / peak_flops if peak_flops else None,
    }
