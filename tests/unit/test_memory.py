"""Peak memory per pass: a process's own high-water mark, reset at the start of each pass."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from backends.runtime.memory import peak_memory_bytes, reset_peak_memory

CPU = torch.device("cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_peak_sees_a_freed_allocation_and_resets():
    reset_peak_memory(CPU)
    before = peak_memory_bytes(CPU)
    block = np.ones(256 * 1024**2 // 8)  # 256 MiB, touched, then freed
    del block
    peak = peak_memory_bytes(CPU)
    assert peak - before >= 250 * 1024**2
    reset_peak_memory(CPU)
    assert peak_memory_bytes(CPU) < peak - 200 * 1024**2


def test_cuda_memory_limit_is_undone_to_the_fraction_before():
    from backends.runtime.memory import plan_memory_limit

    gib = 1024**3
    limit = plan_memory_limit(10, "cuda", 100 * gib, 1.0, device_index=2)
    assert (limit.kind, limit.value, limit.previous, limit.device_index) == ("cuda_fraction", 0.1, 1.0, 2)
    undo = limit.undone()
    assert (undo.kind, undo.value, undo.device_index) == ("cuda_fraction", 1.0, 2)
    # a limit above the device's memory is no limit; one set over an earlier cap restores that cap
    assert plan_memory_limit(500, "cuda", 100 * gib, 0.5).value == 1.0
    assert plan_memory_limit(5, "cuda", 100 * gib, 0.5).undone().value == 0.5
    assert plan_memory_limit(None, "cuda", 100 * gib, 1.0) is None


def test_cpu_memory_limit_is_applied_and_restored():
    import resource

    from backends.runtime.memory import limit_memory, restore_memory_limit

    before = resource.getrlimit(resource.RLIMIT_DATA)
    limit = limit_memory(64, CPU)
    try:
        assert (
            resource.getrlimit(resource.RLIMIT_DATA)[0] == min(64 * 1024**3, before[1])
            if before[1] != resource.RLIM_INFINITY
            else 64 * 1024**3
        )
    finally:
        restore_memory_limit(limit)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_cuda_devices_are_matched_to_nvml_devices_by_uuid_not_index():
    from harness.measuring.samplers import match_nvml_devices

    nvml = ["GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000",
            "MIG-cccc3333-0000-0000-0000-000000000000", "GPU-dddd4444-0000-0000-0000-000000000000"]
    # CUDA_VISIBLE_DEVICES=GPU-dddd4444...,GPU-bbbb2222...: CUDA device 0 is NVML's 3, not 0
    assert match_nvml_devices(["dddd4444-0000-0000-0000-000000000000", "bbbb2222-0000-0000-0000-000000000000"],
                              nvml) == [3, 1]
    # a MIG instance (CUDA reports its UUID without the prefix), upper-case or prefixed spellings too
    assert match_nvml_devices(["CCCC3333-0000-0000-0000-000000000000"], nvml) == [2]
    assert match_nvml_devices(["GPU-aaaa1111-0000-0000-0000-000000000000"], nvml) == [0]
    assert match_nvml_devices(["eeee5555-0000-0000-0000-000000000000"], nvml) == [None]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is how the CPU limit works")
def test_a_refused_allocation_is_classified_as_out_of_memory():
    """The allocator's real refusal under the CPU memory limit is an OOM; another RuntimeError is not."""
    from backends.runtime.memory import is_out_of_memory, limit_memory, restore_memory_limit

    previous = limit_memory(peak_memory_bytes(CPU) / 1024**3 + 1.0, CPU)  # 1 GiB above what this process holds
    try:
        with pytest.raises(RuntimeError) as refused:
            torch.empty(8 * 1024**3, dtype=torch.uint8)  # 8 GiB: far past the limit
    finally:
        restore_memory_limit(previous)
    assert is_out_of_memory(refused.value), str(refused.value)
    assert is_out_of_memory(MemoryError())
    with pytest.raises(RuntimeError) as other:
        torch.ones(2, 3) @ torch.ones(2, 3)
    assert not is_out_of_memory(other.value)


def test_onednns_refusal_is_out_of_memory_only_under_a_limit():
    """bf16 on CPU under bench.memory_limit_gb: oneDNN's matmul says only "could not create a primitive" when it
    cannot map its memory (a bf16 mtpm=auto search once ended on it as an internal error). Under this process's
    RLIMIT_DATA that is the limit; with none it may be anything else, and stays an error. (The limit set here is 1 TiB
    past what the process holds: it refuses nothing.)"""
    import resource

    from backends.runtime.memory import data_segment_bytes, is_out_of_memory

    refused = RuntimeError("could not create a primitive")
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    assert soft == resource.RLIM_INFINITY, "the test process runs with no limit"
    assert not is_out_of_memory(refused)
    resource.setrlimit(resource.RLIMIT_DATA, (data_segment_bytes() + 1024**4, hard))
    try:
        assert is_out_of_memory(refused)
        assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _closed_pytorch_backend(device: str):
    import weakref

    from backends.messages import make_command
    from backends.pytorch import PyTorchBackend
    from backends.specs import BackendSpec, ModelSpec
    from harness.data.workload import make_examples

    backend = PyTorchBackend(BackendSpec(name="pytorch", device=device), ModelSpec())
    backend.run_pass(make_command("forward_backward", make_examples([40, 90, 200], 1024, seed=0), 512, 1))
    model = weakref.ref(backend.model)
    backend.close()
    return model


def test_closing_the_pytorch_backend_releases_its_model():
    """After close nothing holds the model (its gradients and the pass's graph included): a later point starts clean."""
    assert _closed_pytorch_backend("cpu")() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_closing_the_pytorch_backend_empties_the_cuda_cache():
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    assert _closed_pytorch_backend("cuda")() is None
    assert torch.cuda.memory_reserved() <= before  # the model's blocks went back to the driver


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA and VmData are Linux's")
def test_a_pytorch_limit_below_what_the_harness_holds_is_an_out_of_memory_not_a_crash():
    """The pytorch backend runs in the harness's process: bench.memory_limit_gb=0.3 is less than the process holds
    (torch alone), so no model is built: status oom in one line, and the process is left without the limit (before,
    the limit was applied and the next import failed with an empty MemoryError, or the process crashed)."""
    import resource

    from backends.errors import BackendError
    from backends.pytorch import PyTorchBackend
    from backends.specs import BackendSpec, ModelSpec

    before = resource.getrlimit(resource.RLIMIT_DATA)
    with pytest.raises(BackendError) as refused:
        PyTorchBackend(BackendSpec(name="pytorch", device="cpu", memory_limit_gb=0.3), ModelSpec())
    assert refused.value.status == "oom"
    assert str(refused.value).startswith("out of memory in start-up: bench.memory_limit_gb=0.3 is less than this "
                                         "process holds"), str(refused.value)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_the_harness_process_running_out_under_a_pytorch_limit_is_an_oom():
    """The pytorch backend's limit holds the harness's own threads too: a sampler's thread that cannot start (its
    stack does not fit, 0.55 GB) is the limit, status oom; the same failure with no limit, or on a distributed
    backend (whose limit holds only its ranks), stays an internal error."""
    from harness.point.failures import in_process_out_of_memory
    from tests.conftest import compose_config

    try:
        raise RuntimeError("can't start new thread")  # threading's own message for EAGAIN
    except RuntimeError as exc:
        oom = in_process_out_of_memory(compose_config("backend=pytorch", "bench.memory_limit_gb=0.55"), exc)
        assert oom is not None and oom.status == "oom" and "bench.memory_limit_gb=0.55" in str(oom), oom
        assert in_process_out_of_memory(compose_config("backend=pytorch"), exc) is None
        assert in_process_out_of_memory(compose_config("backend=fsdp2", "bench.memory_limit_gb=0.55"), exc) is None
        assert in_process_out_of_memory(compose_config("backend=pytorch", "bench.memory_limit_gb=0.55"),
                                        KeyError("x")) is None


def test_a_sampler_starts_no_thread_without_room_under_the_limit():
    """A thread whose start-up runs out of memory leaves Thread.start() waiting forever, or raises "can't start new
    thread": with 4 MB of room under RLIMIT_DATA the sampler starts none and polls at its start and stop only (in a
    process of its own: the limit must not reach pytest)."""
    import subprocess

    code = """
import os, resource, threading
from backends.runtime.memory import data_segment_bytes, room_for_a_thread
from harness.measuring.samplers import CpuSampler
hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
sampler, before = CpuSampler([os.getpid()]), threading.active_count()
resource.setrlimit(resource.RLIMIT_DATA, (data_segment_bytes() + 4 * 1024**2, hard))
assert not room_for_a_thread()
sampler.start()
util, mem_pct = sampler.stop()
assert threading.active_count() == before and 0 <= util <= 100 and mem_pct > 0, (util, mem_pct)
resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
assert room_for_a_thread()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
