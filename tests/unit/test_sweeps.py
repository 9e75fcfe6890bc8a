"""The W&B sweep files: both backends and the baselines are there (Hydra's view of them:
tests/integration/test_sweeps.py)."""

from __future__ import annotations

import itertools

import yaml

from tests.conftest import REPO

SWEEP_FILES = sorted((REPO / "sweeps").glob("*.yaml"))


def grid_points(spec: dict) -> list[dict]:
    names, choices = [], []
    for name, p in spec["parameters"].items():
        names.append(name)
        choices.append(p["values"] if "values" in p else [p["value"]])
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def test_there_are_sweeps_for_both_backends_and_the_baselines():
    specs = {f.stem: yaml.safe_load(f.read_text()) for f in SWEEP_FILES}
    assert {"fsdp2_mtpm", "megatron_ddp_mtpm", "seed_b200"} <= set(specs)
    for name in ("fsdp2_mtpm", "megatron_ddp_mtpm"):
        assert specs[name]["method"] == "grid"
        assert sorted(p["mtpm"] for p in grid_points(specs[name])) == [16384, 32768, 65536, 131072]
    seed = grid_points(specs["seed_b200"])
    assert len(seed) == 12 and {p["batching"] for p in seed} >= {"fixed_mbs1", "fixed_mbs2", "greedy_padded131072"}
