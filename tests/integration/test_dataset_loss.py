"""A dataset's real ids and trainer-style weights through a backend give the loss oracle's per-example losses and
gradient (tests/loss_oracle.py: a plain transformers forward per example), in float32, and within bf16's precision."""

from __future__ import annotations

import numpy as np
import pytest

from backends.messages import make_command
from backends.pytorch import PyTorchBackend
from backends.specs import BackendSpec, ModelSpec
from harness.data.dataset import example_weights
from harness.data.workload import WorkloadSpec, load_workload
from tests.loss_oracle import oracle, plain_model

pytestmark = pytest.mark.unit

BF16_RTOL = 3e-2  # as tests/integration/test_precision.py


@pytest.fixture(scope="module")
def workload(demo_data, tmp_path_factory):
    spec = WorkloadSpec(
        name="dataset",
        kind="dataset",
        path=str(demo_data["chats"]),
        tokenizer=str(demo_data["tokenizer"]),
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        n_examples=6,
        truncate_to=96,
        seed=1,
    )
    return load_workload(spec, ModelSpec())


@pytest.fixture(scope="module")
def expected(workload):
    return oracle(workload.examples(2048, 0), plain_model())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dataset_examples_give_the_oracles_losses(workload, expected, dtype):
    examples = workload.examples(2048, 0)
    assert [len(e) for e in examples] == workload.lengths and max(workload.lengths) == 96  # truncated rows among them
    for e, ids, trained in zip(examples, workload.dataset.ids, workload.dataset.trained):  # the dataset's own tokens
        assert np.array_equal(e.input_ids, ids) and np.array_equal(e.weights, example_weights(trained, "completion"))
    weights = np.concatenate([e.weights for e in examples])
    assert 0 < (weights > 0).mean() < 1  # prompts masked, replies trained: not the generated half-and-half
    backend = PyTorchBackend(BackendSpec(device="cpu"), ModelSpec(dtype=dtype))
    try:
        for options in ({"mtpm": None, "mbs": 1}, {"mtpm": 200, "mbs": 1, "layout": "packed", "planner": "balanced"},
                        {"mtpm": 200, "mbs": 1, "layout": "padded", "planner": "greedy"}):
            result = backend.run_pass(
                make_command("forward_backward", examples, options.pop("mtpm"), options.pop("mbs"), **options)
            )
            losses = np.array([o.loss for o in result.outputs])
            rtol = 1e-4 if dtype == "float32" else BF16_RTOL
            np.testing.assert_allclose(losses, expected["losses"], rtol=rtol, err_msg=str(options))
            assert result.grad_norm == pytest.approx(expected["grad_norm"], rel=rtol if dtype == "float32" else 0.1)
    finally:
        backend.close()
