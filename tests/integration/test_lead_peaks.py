"""mtpm=auto's leading budgets measured again on a real in-process PyTorch backend: the memory one budget left cached
is released before another's extra pairs (harness/auto/lead.py, harness/auto/run.py). In this tier: the two budgets'
passes hold about 0.7 and 1.1 GB and take seconds."""

from __future__ import annotations


def test_more_pairs_of_a_budget_measured_after_a_larger_one_read_its_own_peak(tmp_path):
    """The leaders' extra pairs run after the other budget's passes: its memory, left cached, must be released
    first, or the smaller budget's peak reads the larger's and the tie rule (and the answer) weigh that. A real
    in-process PyTorch backend on six sequences (T 3,193 against 8,766: about 680 MB against 1.1 GB)."""
    from harness.app.config import resolve_config
    from harness.auto.run import AutoRun
    from harness.data.workload import load_workload
    from harness.point.point import Point
    from harness.point.setup import HydraRun
    from tests.conftest import compose_config

    overrides = ["mtpm=auto", "backend=pytorch", "workload=cpu_mixed", "workload.n_examples=6", "bench.paired=false",
                 "bench.warmup=0", "bench.repeat=1", "logger=none"]
    cfg = compose_config(*overrides)
    spec = resolve_config(cfg)
    point = Point(cfg, HydraRun(out_dir=tmp_path / "run", overrides=overrides, folder_key="hydra.run.dir",
                                group=None))
    point.workload = load_workload(spec.workload, spec.model)
    auto = AutoRun(point, spec, point.workload)
    try:
        auto._plan_candidates()
        auto.examples = point.examples(spec)
        small, big = auto.cands[0].mtpm, auto.cands[-1].mtpm
        own, larger = auto._measure(small).peak_bytes, auto._measure(big).peak_bytes
        assert larger - own > 256 * 2**20, (own, larger)  # the two budgets' memory differs plainly
        auto._more_pairs(small, 1)
        again = auto._peak_of(small)
        assert again < own + (larger - own) / 2, (own, again, larger)
    finally:
        if point.backend is not None:
            point.backend.close()
