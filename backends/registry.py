"""The backends, in one table: every other place (config checks, start-up, ranks, reports) reads it.

Importing this module imports no torch: harness/config.py and reports/ read it too.
Adding a backend is one row here, its module, and its harness/conf/backend/<name>.yaml.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

from backends.errors import UserError


@dataclass(frozen=True)
class BackendEntry:
    name: str  # backend.name= on the command line, and results.json's "backend"
    label: str  # how reports and plots write it
    controller: str  # "module:Class" of the Backend the harness talks to
    rank_hooks: Optional[str]  # "module:Class" of the RankHooks each rank runs; None for a one-process backend
    distributed: bool  # runs world_size ranks (spawned, or started by torchrun / Slurm)
    lockstep: bool  # every rank must call the model the same number of times per pass (FSDP2's collectives)
    # The module the ranks' fork server imports for this backend's ranks after every backend's
    # (backends/runtime/forkserver.py): its own heavy libraries, so a controller of another backend's ranks skips them.
    rank_preload: Optional[str] = None


# In the order the config error lists them.
BACKENDS = (
    BackendEntry("pytorch", "PyTorch", "backends.pytorch:PyTorchBackend", None, distributed=False, lockstep=False),
    BackendEntry("fsdp2", "FSDP2", "backends.fsdp2:FSDP2Backend", "backends.fsdp2:FSDP2Hooks",
                 distributed=True, lockstep=True),
    BackendEntry("megatron_ddp", "Megatron DDP", "backends.megatron_ddp:MegatronDDPBackend",
                 "backends.megatron_ddp:MegatronDDPHooks", distributed=True, lockstep=False,
                 rank_preload="backends.runtime.preload_megatron"),
)

BY_NAME = {b.name: b for b in BACKENDS}
NAMES = tuple(BY_NAME)
DISTRIBUTED_BACKENDS = frozenset(b.name for b in BACKENDS if b.distributed)
LOCKSTEP_BACKENDS = frozenset(b.name for b in BACKENDS if b.lockstep)


def valid_names(distributed_only: bool = False) -> str:
    """``"pytorch, fsdp2, megatron_ddp"``, for the "(valid: ...)" of an error message."""
    return ", ".join(b.name for b in BACKENDS if b.distributed or not distributed_only)


def backend_entry(name: str) -> BackendEntry:
    """The row for ``name``; a name that is not a backend is a user error naming the valid ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise UserError(f"backend.name: '{name}' is not a backend (valid: {valid_names()})") from None


def is_distributed(name: str) -> bool:
    """Whether backend ``name`` runs world_size ranks (False for a name that is not a backend)."""
    return name in DISTRIBUTED_BACKENDS


def is_lockstep(name: str) -> bool:
    """Whether backend ``name``'s ranks must call the model the same number of times per pass."""
    return name in LOCKSTEP_BACKENDS


def import_path(path: str):
    """The object a ``"module:Name"`` path names (the registry's controllers and rank hooks, ``backend.hooks``)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
