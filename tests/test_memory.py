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
