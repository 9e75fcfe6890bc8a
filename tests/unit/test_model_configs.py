"""Which config the planner's cost model reads: the checkpoint's, the shipped one of a named model, or the tiny
model's."""

from __future__ import annotations

from backends.model.configs import QWEN3_5_35B_A3B_TEXT_CONFIG, cost_model_for, model_config
from backends.specs import ModelSpec


def test_a_named_model_without_a_path_plans_with_its_shipped_config(tmp_path):
    """model.path=null once planned the 35B with the tiny model's cost (critical path 1.0369, not 1.0194)."""
    no_path = ModelSpec(name="qwen3_5_35b_a3b", path=None)
    absent = ModelSpec(name="qwen3_5_35b_a3b", path=str(tmp_path / "nonexistent"))
    config, source = model_config(no_path)
    assert config == QWEN3_5_35B_A3B_TEXT_CONFIG and "qwen3_5_35b_a3b (no model.path)" in source
    assert "checkpoint not on disk" in model_config(absent)[1]
    a, b = cost_model_for(no_path), cost_model_for(absent)
    assert (a.a, a.b) == (b.a, b.b)
    tiny = cost_model_for(ModelSpec(name="tiny", path=None))
    assert "TINY_CONFIG" in tiny.source and (tiny.a, tiny.b) != (a.a, a.b)
