"""Sharded loading: FSDP2 builds on meta, shards, and fills each rank's shards; CPU ranks stay on the CPU on any host."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from backends import make_backend
from backends.base import BackendSpec, make_command
from backends.megatron_ddp import needs_cpu_device_shim
from backends.model import ModelSpec, build_model
from harness.workload import make_examples, mixed_lengths

EXAMPLES = make_examples(mixed_lengths(16, 64, 512, 42), 2048, seed=0)[:6]
PROBE = "tests.probes:FSDP2ChecksShardedLoad"


def test_cpu_ranks_take_the_megatron_shim_whether_or_not_the_host_has_cuda():
    assert needs_cpu_device_shim("cpu", cuda_available=True)
    assert needs_cpu_device_shim("cpu", cuda_available=False)
    assert not needs_cpu_device_shim("cuda", cuda_available=True)


def _run(backend_spec: BackendSpec, model_spec: ModelSpec):
    with make_backend(backend_spec, model_spec) as backend:
        result = backend.run_pass(make_command("forward_backward", EXAMPLES, 700, 1))
        return result, backend.load_info, backend.model_info


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_model(ModelSpec(lora_rank=0), torch.device("cpu"), False).save_pretrained(path)
    assert list(path.glob("*.safetensors"))
    return ModelSpec(name="local", path=str(path))


@pytest.mark.slow
def test_fsdp2_loads_a_local_checkpoint_into_shards_built_on_meta(checkpoint):
    """2 gloo ranks: meta before sharding, each rank only its chunk, weights equal to from_pretrained's, same answers."""
    ref, ref_load, ref_built = _run(BackendSpec(name="pytorch", device="cpu"), checkpoint)
    got, load, built = _run(BackendSpec(name="fsdp2", world_size=2, device="cpu", hooks=PROBE), checkpoint)
    np.testing.assert_allclose([o.loss for o in got.outputs], [o.loss for o in ref.outputs], rtol=1e-5)
    assert ref.grad_norm > 0 and math.isclose(got.grad_norm, ref.grad_norm, rel_tol=1e-5)
    assert built == ref_built  # counted on the meta model: the same parameters as the full one
    assert ref_load["method"] == "from_pretrained"
    assert load["method"] == "meta+rank0-from_pretrained-broadcast"
    assert load["elapsed_s"] > 0 and len(load["host_peak_bytes"]) == 2 and all(b > 0 for b in load["host_peak_bytes"])
    assert load["device_peak_bytes"] is None  # CPU ranks


@pytest.mark.slow
@pytest.mark.parametrize("source", ["tiny", "checkpoint"])
def test_fsdp2_sharded_load_is_bit_identical_to_the_unsharded_build_in_bf16(source, request):
    """Shards, LoRA adapters and non-persistent buffers (rotary inv_freq) equal the unsharded build bit for bit, in bf16."""
    model = ModelSpec() if source == "tiny" else request.getfixturevalue("checkpoint")
    _, load, _ = _run(BackendSpec(name="fsdp2", world_size=2, device="cpu", hooks=PROBE), replace(model, dtype="bfloat16"))
    assert load["method"] == f"meta+rank0-{'from_config' if source == 'tiny' else 'from_pretrained'}-broadcast"
