"""The training side: planner, model, the shared step, and one module per backend."""

from __future__ import annotations

from typing import Optional

from backends.errors import UserError

# Backends whose ranks must call the model the same number of times per pass.
LOCKSTEP_BACKENDS = frozenset({"fsdp2"})
DISTRIBUTED_BACKENDS = frozenset({"fsdp2", "megatron_ddp"})


def resolve_world_size(backend: str, world_size: Optional[int], device_type: str) -> int:
    """Ranks a backend runs: pytorch 1; otherwise ``world_size``, else one per visible GPU, else 2 CPU ranks.

    Under torchrun or Slurm the launcher's world size, and a ``world_size`` that disagrees is a user error.
    """
    from backends.launch import check_world_size, launch_env

    launched = launch_env()
    if launched is not None:
        return check_world_size(backend, world_size, launched)
    if backend not in DISTRIBUTED_BACKENDS:
        if world_size not in (None, 1):
            raise UserError(f"world_size: backend={backend} runs one process, got {world_size} (valid: 1 or null)")
        return 1
    if world_size is not None:
        return world_size
    if device_type == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return 2


def check_kernels(spec) -> None:
    """On CUDA, a warning per kernel package that does not import; with ``require_kernels`` an error, before loading."""
    import logging

    from backends.base import resolve_device
    from backends.kernels import MissingKernels, check_cuda_kernels

    try:
        check_cuda_kernels(resolve_device(spec.device).type, spec.require_kernels, logging.getLogger("backends"))
    except MissingKernels as exc:
        raise UserError(str(exc)) from None  # "backend.require_kernels=true: <package> does not import: ..."


def make_backend(spec, model):
    """Start the backend named by ``spec.name`` (imports only that backend's dependencies)."""
    check_kernels(spec)
    if spec.name in DISTRIBUTED_BACKENDS:
        from backends.launch import launched_job

        if launched_job() is not None:  # rank 0 of a torchrun / Slurm job: the ranks already exist
            from backends.launched import LaunchedBackend

            hooks = {"fsdp2": "backends.fsdp2:FSDP2Hooks", "megatron_ddp": "backends.megatron_ddp:MegatronDDPHooks"}
            return LaunchedBackend(spec, model, spec.hooks or hooks[spec.name])
    if spec.name == "pytorch":
        from backends.pytorch import PyTorchBackend

        return PyTorchBackend(spec, model)
    if spec.name == "fsdp2":
        from backends.fsdp2 import FSDP2Backend

        return FSDP2Backend(spec, model)
    if spec.name == "megatron_ddp":
        from backends.megatron_ddp import MegatronDDPBackend

        return MegatronDDPBackend(spec, model)
    raise UserError(f"backend.name: '{spec.name}' is not a backend (valid: pytorch, fsdp2, megatron_ddp)")
