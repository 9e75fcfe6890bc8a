"""The gradient norm reads the device once per pass: host reads counted around real steps on the tiny model, bf16,
in this process (the plain step, and FSDP2 on a one-rank gloo group; Megatron DDP reads its main_grad through the same
fused sum)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist

from backends.model.build import build_model
from backends.model.step import grad_norm_local_sq, local_grads, run_steps, total_loss_weight
from backends.specs import BackendSpec, ModelSpec
from harness.data.workload import make_examples

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
EXAMPLES = make_examples([40, 17, 33], 2048, seed=5)
SCHEDULE = [[0], [1, 2]]
# Every Tensor method that makes the host wait for the device's queued work
READS = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy", "cpu")


@contextlib.contextmanager
def counted_reads():
    """Counts the host reads of a tensor (what synchronizes on a GPU) while the block runs."""
    calls: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counting(self, *args, _original=original, _name=name, **kwargs):
                calls.append(_name)
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counting)
        yield calls


def _old_norm(grads) -> float:
    """What the norm was before it was fused: one host read per tensor, summed in float64."""
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))


def _steps(model):
    # packed: padded rows add one read per forward in transformers' own mask preparation (whether position ids
    # describe packed sequences), which is the model's, not the step's
    run_steps(model, EXAMPLES, SCHEDULE, "forward_backward", total_loss_weight(EXAMPLES), CPU, layout="packed")


@pytest.fixture
def one_rank_group():
    from torch.distributed import HashStore

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_plain_steps_read_nothing_and_the_norm_reads_once():
    model = build_model(ModelSpec(dtype="bfloat16"), CPU, False)
    with counted_reads() as calls:
        _steps(model)
    steps_reads = list(calls)
    with counted_reads() as calls:
        norm = math.sqrt(grad_norm_local_sq(model))
    assert steps_reads == [] and len(calls) == 1, (steps_reads, calls)
    assert norm > 0 and norm == pytest.approx(_old_norm(local_grads(model)), rel=1e-12)


def test_fsdp2_reads_its_all_reduced_norm_once(one_rank_group):
    from backends.fsdp2 import FSDP2Hooks

    hooks = FSDP2Hooks(BackendSpec(name="fsdp2", device="cpu"), 0, 1, CPU)
    model = hooks.wrap(build_model(ModelSpec(dtype="bfloat16"), CPU, False))
    _steps(model)
    with counted_reads() as calls:
        norm = hooks.grad_norm(model)
    assert len(calls) == 1, calls
    assert norm > 0 and norm == pytest.approx(_old_norm(local_grads(model)), rel=1e-12)
