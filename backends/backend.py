"""The Backend base class: what every backend offers the harness (a PassCommand in, a PassResult out)."""

from __future__ import annotations

from typing import Optional

import torch

from backends.messages import PassCommand, PassResult
from backends.runtime.devices import device_description
from backends.specs import BackendSpec, ModelSpec


def split_precision(built: Optional[dict]) -> tuple[Optional[dict], Optional[dict]]:
    """Rank 0's start-up record as (what was built, the precision policy): the ranks send both in one dict."""
    if built is None:
        return None, None
    return {k: v for k, v in built.items() if k != "precision"}, built.get("precision")


class Backend:
    """Base class: subclasses implement ``_run_pass`` and ``close``.

    ``run_pass`` is where a live control file (see backends/runtime/control.py) is
    read: its values replace the command's batching knobs, so a change takes
    effect at the next pass on every backend.
    """

    name = "base"
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    control = None  # a backends.runtime.control.ControlFile, or None
    model_info: Optional[dict] = None  # what was built (backends.model.build.describe_model), once started
    # How the weights were loaded and what it cost (backends.model.loading.merge_load_records), once started.
    load_info: Optional[dict] = None
    # The precision policy as it runs (backends.model.build.describe_precision): params, adapters, compute, reduce,
    # grads.
    precision: Optional[dict] = None
    # Compute threads per rank on CPU (backends.runtime.devices.threads_per_rank), as torch reports them; None on GPU.
    threads_per_rank: Optional[int] = None

    def __init__(self, spec: BackendSpec, model: ModelSpec):
        self.spec = spec
        self.model_spec = model

    def attach_control(self, control) -> None:
        self.control = control

    def run_pass(self, command: PassCommand) -> PassResult:
        if self.control is not None:
            command = command.replace(**self.control.read().as_dict())
        result = self._run_pass(command)
        result.plan = {
            **result.plan,
            "max_tokens_per_microbatch": command.max_tokens_per_microbatch,
            "micro_batch_size": command.micro_batch_size,
            "max_seqs_per_microbatch": command.max_seqs_per_microbatch,
        }
        return result

    def _run_pass(self, command: PassCommand) -> PassResult:  # pragma: no cover - interface
        raise NotImplementedError

    def describe_device(self) -> dict:
        return device_description(self.device, self.world_size)

    def device_memory_bytes(self) -> int:
        """Memory of one device (GPU) or of the machine (CPU)."""
        return int(self.describe_device()["memory_bytes"])

    def pids(self) -> list[int]:
        """Processes doing the work (besides this one), for CPU utilisation and memory sampling."""
        return []

    def footprint(self) -> Optional[dict]:
        """What the process running the passes holds once its caches are handed back, as a memory limit counts it
        (backends.runtime.memory.footprint); None where the harness cannot read it (ranks in other processes)."""
        return None

    def failure(self) -> Optional[str]:
        """Why this backend can run no more passes (a dead worker, stopped workers); None while it can."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
