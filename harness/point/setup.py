"""What a point runs on: Hydra's view of the run (its folder, overrides, sweep), the backend's setup (name, ranks,
device, batching, what it built), the workload planned for it, and results.json's record of all that."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from backends.model.configs import cost_model_for
from backends.registry import LOCKSTEP_BACKENDS
from backends.runtime.job import resolve_world_size
from balance_batch import CostModel, plan_step
from harness.app.batching import KEYS
from harness.app.config import AUTO, HarnessConfig
from harness.data.workload import Workload
from harness.point.results import model_record, workload_record
from harness.point.tracking import sweep_group

log = logging.getLogger("harness")


@dataclass(frozen=True)
class HydraRun:
    """What Hydra says of the point it is running: its folder, its overrides, and the sweep it belongs to."""

    out_dir: Path
    overrides: list[str]
    folder_key: str  # the config key that names the folder: hydra.run.dir, or hydra.sweep.dir in a multirun
    group: Optional[str]  # the sweep's W&B group (None for a single run)
    sweep_dir: Optional[Path] = None  # a multirun's folder (None for a single run)

    @classmethod
    def current(cls) -> "HydraRun":
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        return cls(
            out_dir=Path(hc.runtime.output_dir),
            overrides=list(hc.overrides.task),
            folder_key="hydra.sweep.dir" if multirun else "hydra.run.dir",
            group=sweep_group(hc.sweep.dir) if multirun else None,
            sweep_dir=Path(hc.sweep.dir) if multirun else None,
        )


@dataclass
class Setup:
    """What a point runs on: the backend's name, ranks, device, batching, and what it built (None in a dry run)."""

    name: str
    world_size: int
    device: Any
    mtpm: Optional[int]
    mbs: int
    layout: str
    planner: str
    cost_model: CostModel  # the planner's cost model, from the model's config (a server's: the one it plans with)
    max_seqs_per_microbatch: Optional[int] = None  # the cap on sequences per micro-batch (a server's: its own)
    built: Optional[dict] = None
    precision: Optional[dict] = None
    load: Optional[dict] = None
    threads_per_rank: Optional[int] = None  # compute threads each rank ran with on CPU (None: a GPU, a dry run)

    @classmethod
    def dry_run(cls, spec: HarnessConfig) -> "Setup":
        """A dry run builds no model: the device and the ranks the backend would run."""
        b = spec.backend
        # torch is imported here, not at start-up, so a config error is reported at once.
        from backends.runtime.devices import device_description, resolve_device

        device = resolve_device(b.device)
        world_size = resolve_world_size(b.name, b.world_size, device.type)
        return cls(b.name, world_size, device_description(device, world_size),
                   b.max_tokens_per_microbatch, b.micro_batch_size, b.layout, b.planner, cost_model_for(spec.model),
                   max_seqs_per_microbatch=b.max_seqs_per_microbatch)

    @classmethod
    def of_backend(cls, spec: HarnessConfig, backend) -> "Setup":
        """What a started backend reports; a server's batching and planning are authoritative (its plan is what
        runs)."""
        b = spec.backend
        mtpm, mbs, layout, planner = b.max_tokens_per_microbatch, b.micro_batch_size, b.layout, b.planner
        cap = b.max_seqs_per_microbatch
        served_cost = None
        if spec.target.url:
            mtpm, mbs = backend.batching
            layout, planner = backend.layout or layout, backend.planner or planner
            # None is a cap of its own ("none"): a server too old to report one plans without it.
            cap = backend.max_seqs_per_microbatch
            if (layout, planner, cap) != (b.layout, b.planner, b.max_seqs_per_microbatch):
                log.warning("the server at %s plans with planner=%s layout=%s max_seqs_per_microbatch=%s (fixed for "
                            "its life): this run records those, not planner=%s layout=%s max_seqs_per_microbatch=%s",
                            spec.target.url, planner, layout, _null(cap), b.planner, b.layout,
                            _null(b.max_seqs_per_microbatch))
            served_cost = backend.cost_model
            served = "calibrated" if (served_cost or {}).get("coefficients") else "flops"
            if served != spec.cost_model:
                log.warning("the server at %s plans with cost_model=%s (fixed for its life): this run records that, "
                            "not cost_model=%s", spec.target.url, served, spec.cost_model)
        cost_model = CostModel.from_dict(served_cost) if served_cost else cost_model_for(spec.model)
        return cls(backend.name, backend.world_size, backend.describe_device(), mtpm, mbs, layout, planner,
                   cost_model, max_seqs_per_microbatch=cap, built=backend.model_info, precision=backend.precision,
                   load=backend.load_info, threads_per_rank=getattr(backend, "threads_per_rank", None))


def plan_for(lengths: Sequence[int], setup: Setup, mtpm: Any = "setup"):
    """The workload planned as ``setup``'s backend runs it (``mtpm``: another budget than the setup's), by the library's
    entry point, as the backend's ranks plan it (backends/messages.py)."""
    budget = setup.mtpm if mtpm == "setup" else mtpm
    return plan_step(lengths, world_size=setup.world_size, max_tokens_per_microbatch=budget,
                     micro_batch_size=setup.mbs, lockstep=setup.name in LOCKSTEP_BACKENDS, layout=setup.layout,
                     planner=setup.planner, cost_model=setup.cost_model,
                     max_seqs_per_microbatch=setup.max_seqs_per_microbatch)


def slow_compile_warning(spec: HarnessConfig) -> Optional[str]:
    """One line when ``backend.compile=true`` will run in float32 on a CPU: of every form of this run the slowest
    (minutes of compiling in the warm-up, for the precision a GPU run does not use); None otherwise."""
    b = spec.backend
    if not b.compile or spec.dry_run or spec.target.url:
        return None
    import torch

    from backends.model.build import resolve_dtype
    from backends.runtime.devices import resolve_device

    device = resolve_device(b.device)
    if device.type != "cpu" or resolve_dtype(spec.model.dtype, device) != torch.float32:
        return None
    return ("backend.compile=true in float32 on CPU: the slowest form of this run (the warm-up compiles for minutes, "
            "in a precision GPU runs do not use); model.dtype=bfloat16 measures the published precision, "
            "backend.compile=false skips compiling")


def _null(value: Optional[int]) -> str:
    """A knob's value as the command line spells it (None is null)."""
    return "null" if value is None else str(value)


def label(name: str, mtpm: Optional[int], mbs: int) -> str:
    """The prefix of a point's log lines."""
    return f"[{name} mtpm={mtpm} mbs={mbs}] "


def setup_fields(spec: HarnessConfig, workload: Workload, setup: Setup, plan) -> dict[str, Any]:
    """results.json's record of what the point runs: the backend, its ranks and device, the model, workload and plan."""
    from backends.runtime.job import launch_record

    return dict(
        backend=setup.name,
        world_size=setup.world_size,
        launch=launch_record(setup.world_size),  # who started the ranks: spawn (the harness), torchrun, slurm
        # how the batch was cut (a client's: the server's, what ran); cost_model: the plan's, whose numbers are in
        # plan.cost_model
        **{key: getattr(setup, key) for key in KEYS if key != "cost_model"},
        cost_model="calibrated" if setup.cost_model.fit is not None else "flops",
        device=setup.device,
        model=model_record(spec.model, setup.built),
        workload=workload_record(spec.workload, workload.lengths, workload.file, workload.dataset),
        plan=plan.record(),  # the statistics, and a peer planner's record (harness/peers/)
        # what the backend built runs in (params, adapters, compute, reduce); a dry run builds nothing
        precision=setup.precision,
        load=setup.load,  # how the backend loaded the weights: time and host/device peaks per rank
        threads_per_rank=setup.threads_per_rank,  # what ran (backends.runtime.devices.threads_per_rank's rule)
        hot=spec.hot and not spec.target.url and spec.mtpm != AUTO,  # mtpm=auto runs on a backend of its own
        target={"url": spec.target.url} if spec.target.url else None,
    )
