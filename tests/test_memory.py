"""Peak memory per pass: a process's own high-water mark, reset at the start of each pass."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from backends.memory import peak_memory_bytes, reset_peak_memory

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is how the CPU limit works")
def test_a_refused_allocation_is_classified_as_out_of_memory():
    """The allocator's real refusal under the CPU memory limit is an OOM; another RuntimeError is not."""
    from backends.memory import is_out_of_memory, limit_memory, restore_memory_limit

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
