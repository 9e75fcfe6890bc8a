"""Peak memory per point of a real hot sweep: a small budget after a large one reports its own peak."""

from __future__ import annotations

import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_hot_sweep_small_budget_after_a_large_one_reports_its_own_peak(tmp_path):
    """One process, a large micro-batch then small ones: each pass's peak is the pass's own, not what the last one left
    cached."""
    from tests.conftest import run_harness, sweep_results

    sweep = tmp_path / "hot"
    proc = run_harness("-m", "backend=pytorch", "hot=true", "workload=smoke", "mbs=16,1", "bench.warmup=0",
                       "bench.repeat=1", "logger=none", f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    big, small = sweep_results(sweep)
    assert (big["mbs"], small["mbs"]) == (16, 1) and small["hot"] is True
    for pass_type in ("forward", "forward_backward"):
        big_peak = big["passes"][pass_type]["mem_peak_bytes"][0]
        small_peak = small["passes"][pass_type]["mem_peak_bytes"][0]
        assert small_peak < big_peak, (pass_type, small_peak, big_peak)
        assert small["passes"][pass_type]["mem_peak_allocated_bytes"] is None  # CPU: no allocator figures
    # fwd+bwd of 16 sequences at once holds far more activations than one at a time
    assert (
        small["passes"]["forward_backward"]["mem_peak_bytes"][0]
        < 0.75 * big["passes"]["forward_backward"]["mem_peak_bytes"][0]
    )
