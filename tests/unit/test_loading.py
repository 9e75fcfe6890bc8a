"""Loading, in-process: CPU ranks stay on the CPU on any host, and rank 0's read gate on a real TCPStore (sharded FSDP2
loads: tests/integration/test_loading.py)."""

from __future__ import annotations

import pytest

from backends.megatron_ddp import needs_cpu_device_shim


def test_cpu_ranks_take_the_megatron_shim_whether_or_not_the_host_has_cuda():
    assert needs_cpu_device_shim("cpu", cuda_available=True)
    assert needs_cpu_device_shim("cpu", cuda_available=False)
    assert not needs_cpu_device_shim("cuda", cuda_available=True)


def _store(timeout_s: float):
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def test_the_read_gate_waits_past_the_store_timeout_until_rank0_opens_it():
    """A real TCPStore whose own time-out is 0.2 s: rank 1 waits 1 s for rank 0's key, on its own client."""
    import threading

    import torch.distributed as dist

    from backends.model.loading import ReadGate

    store = _store(0.2)
    client = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, timeout=store.timeout)
    rank0, rank1 = ReadGate(store, 0, serial=7), ReadGate(client, 1, serial=7)
    threading.Timer(1.0, rank0.open).start()
    assert rank1.wait(poll_s=0.05) >= 0.9
    assert ReadGate(client, 1, serial=8).key != rank1.key  # a later load (a launched job's next point) has its own key


def test_a_failed_rank0_read_stops_the_waiting_ranks_with_its_error():
    from backends.model.loading import Rank0ReadFailed, ReadGate

    store = _store(5.0)
    ReadGate(store, 0, serial=0).fail("FileNotFoundError: /models/x/model.safetensors")
    with pytest.raises(Rank0ReadFailed, match=r"rank 0 could not read the weights \(FileNotFoundError: /models/x"):
        ReadGate(store, 1, serial=0).wait(poll_s=0.01)


def test_the_load_clock_stops_after_the_device_finished_its_copies(monkeypatch):
    """On a GPU a load's copies are queued, not done, when the Python returns: LoadMeter synchronizes the device
    before it reads the clock. No GPU here: the device calls are recorded in the order they come."""
    import torch

    from backends.model import loading

    events: list[str] = []
    monkeypatch.setattr(loading, "reset_peak_memory", lambda device: None)
    monkeypatch.setattr(loading, "peak_memory_bytes", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"synchronize {device}"))
    clock = iter(range(10))
    monkeypatch.setattr(loading.time, "perf_counter", lambda: events.append("clock") or float(next(clock)))
    with loading.LoadMeter(torch.device("cuda", 0)):
        events.append("load")
    assert events == ["clock", "load", "synchronize cuda:0", "clock"]
    events.clear()
    with loading.LoadMeter(torch.device("cpu")):
        events.append("load")
    assert events == ["clock", "load", "clock"]  # nothing to wait for on CPU
