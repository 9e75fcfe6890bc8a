"""Sharded loading on 2 real FSDP2 ranks: built on meta, sharded, each rank's shards filled from rank 0's read."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from backends.messages import make_command
from backends.model.build import build_model
from backends.specs import BackendSpec, ModelSpec
from backends.start import make_backend
from harness.data.workload import make_examples, mixed_lengths

EXAMPLES = make_examples(mixed_lengths(16, 64, 512, 42), 2048, seed=0)[:6]
PROBE = "tests.probes:FSDP2ChecksShardedLoad"


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


def test_fsdp2_loads_a_local_checkpoint_into_shards_built_on_meta(checkpoint):
    """2 gloo ranks: meta before sharding, each rank only its chunk, weights equal to from_pretrained's, same
    answers."""
    ref, ref_load, ref_built = _run(BackendSpec(name="pytorch", device="cpu"), checkpoint)
    got, load, built = _run(BackendSpec(name="fsdp2", world_size=2, device="cpu", hooks=PROBE), checkpoint)
    np.testing.assert_allclose([o.loss for o in got.outputs], [o.loss for o in ref.outputs], rtol=1e-5)
    assert ref.grad_norm > 0 and math.isclose(got.grad_norm, ref.grad_norm, rel_tol=1e-5)
    assert built == ref_built  # counted on the meta model: the same parameters as the full one
    assert ref_load["method"] == "from_pretrained"
    assert load["method"] == "meta+rank0-from_pretrained-broadcast"
    assert load["elapsed_s"] > 0 and len(load["host_peak_bytes"]) == 2 and all(b > 0 for b in load["host_peak_bytes"])
    assert load["device_peak_bytes"] is None  # CPU ranks


@pytest.mark.parametrize("source", ["tiny", "checkpoint"])
def test_fsdp2_sharded_load_is_bit_identical_to_the_unsharded_build_in_bf16(source, request):
    """Shards, LoRA adapters and non-persistent buffers (rotary inv_freq) equal the unsharded build bit for bit, in
    bf16."""
    model = ModelSpec() if source == "tiny" else request.getfixturevalue("checkpoint")
    _, load, _ = _run(
        BackendSpec(name="fsdp2", world_size=2, device="cpu", hooks=PROBE), replace(model, dtype="bfloat16")
    )
    assert load["method"] == f"meta+rank0-{'from_config' if source == 'tiny' else 'from_pretrained'}-broadcast"


def test_fsdp2_ranks_wait_for_a_rank0_read_longer_than_the_collective_timeout(caplog):
    """Rank 0 reads for longer than backend.dist_timeout_s: the others wait on the store, then load the same values.

    Before the store gate, rank 1 waited inside its first broadcast and gloo
    aborted start-up after dist_timeout_s. Rank 0 also logs its read time and
    its broadcast progress (tensors, GB, GB/s), which reach the controller's log.
    """
    from tests.probes import FSDP2SlowRank0Read

    timeout_s = 5.0
    caplog.set_level(logging.INFO)
    spec = BackendSpec(name="fsdp2", world_size=2, device="cpu", dist_timeout_s=timeout_s,
                       hooks="tests.probes:FSDP2SlowRank0Read")
    got, load, _ = _run(spec, ModelSpec())
    assert len(got.outputs) == len(EXAMPLES) and all(math.isfinite(o.loss) for o in got.outputs)
    assert load["elapsed_s"] > FSDP2SlowRank0Read.read_delay_s(timeout_s) > timeout_s
    messages = [r.getMessage() for r in caplog.records if r.name == "backends.model.loading"]
    assert any(re.fullmatch(r"rank 0: read the tiny model in \d+\.\d s", m) for m in messages), messages[:5]
    progress = [m for m in messages if re.fullmatch(r"rank 0: broadcast \d+/\d+ tensors, [\d.]+/[\d.]+ GB in "
                                                    r"[\d.]+ s \([\d.]+ GB/s\)", m)]
    assert len(progress) >= 2, messages[:5]
    sent, total = map(int, re.search(r"(\d+)/(\d+) tensors", progress[-1]).groups())
    assert sent == total > 1  # the summary line at the end: every tensor sent


@pytest.mark.parametrize("backend", ["fsdp2", "megatron_ddp"])
def test_allowed_missing_weights_are_listed_by_the_distributed_backends_too(checkpoint, backend, tmp_path):
    """FSDP2 reads on rank 0 and broadcasts (the meta build knows nothing of the read), Megatron reads on every rank:
    both report the same missing weights as the single-process load, and run."""
    import json
    import shutil

    path = tmp_path / "six-layers"
    shutil.copytree(checkpoint.path, path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 6, (config["layer_types"] * 2)[:6]
    (path / "config.json").write_text(json.dumps(config))
    spec = replace(checkpoint, path=str(path), allow_missing_weights=True)
    _, _, ref_built = _run(BackendSpec(name="pytorch", device="cpu"), spec)
    got, _, built = _run(BackendSpec(name=backend, world_size=2, device="cpu"), spec)
    assert ref_built["missing_weights"] and built["missing_weights"] == ref_built["missing_weights"]
    assert built["unexpected_weights"] == [] and built["n_layers"] == 6
    assert all(math.isfinite(o.loss) for o in got.outputs)
