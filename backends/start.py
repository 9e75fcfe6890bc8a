"""Starting a backend: the controller the registry names for it, or rank 0 of a launched job.

Imports no torch until a backend starts (harness/app.py imports it at the top).
"""

from __future__ import annotations

from backends.errors import UserError
from backends.registry import backend_entry, import_path


def check_kernels(spec) -> None:
    """On CUDA, a warning per kernel package that does not import; with ``require_kernels`` an error, before loading."""
    import logging

    from backends.runtime.devices import resolve_device
    from balance_batch.integrations.transformers.kernels import MissingKernels, check_cuda_kernels

    try:
        check_cuda_kernels(resolve_device(spec.device).type, spec.require_kernels, logging.getLogger("backends"))
    except MissingKernels as exc:
        raise UserError(str(exc)) from None  # "backend.require_kernels=true: <package> does not import: ..."


def make_backend(spec, model):
    """Start the backend named by ``spec.name`` (imports only that backend's dependencies)."""
    check_kernels(spec)
    entry = backend_entry(spec.name)
    if entry.distributed:
        from backends.runtime.job import launched_job

        if launched_job() is not None:  # rank 0 of a torchrun / Slurm job: the ranks already exist
            from backends.runtime.launched import LaunchedBackend

            return LaunchedBackend(spec, model, spec.hooks or entry.rank_hooks)
    return import_path(entry.controller)(spec, model)
