"""Structured config: the schema Hydra validates conf/ against, and value checks it cannot express."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING
from omegaconf.errors import OmegaConfBaseException

from backends.errors import UserError
from backends.model.configs import check_model_spec
from backends.planning import LAYOUTS, PLANNERS
from backends.registry import backend_entry
from backends.specs import BackendSpec, ModelSpec
from harness.workload import WorkloadSpec


@dataclass
class BenchConfig:
    warmup: int = 1  # untimed runs per pass type
    repeat: int = 3  # timed runs per pass type
    save_outputs: bool = False  # write example_outputs.json (per-example losses, gradient norm)
    progress_every_s: float = 10.0  # how often a long pass logs its progress
    util_sample_s: float = 0.1  # device utilisation / memory sampling interval
    memory_limit_gb: Optional[float] = None  # cap each worker's memory (see README: out of memory is a result)
    pass_timeout_s: Optional[float] = None  # a pass running longer ends the point with status "timeout"


@dataclass
class ServerConfig:
    """``python -m harness.serve``: where it listens and what it accepts."""

    host: str = "127.0.0.1"  # a non-loopback address needs BALANCE_BATCH_ADMIN_TOKEN set
    port: int = 8000
    control_path: Optional[str] = None  # null = a file in /dev/shm unique to this server
    mtpm_ceiling: int = 1_048_576  # largest max_tokens_per_microbatch the admin API accepts
    mbs_ceiling: int = 4096  # largest micro_batch_size the admin API accepts
    max_request_bytes: int = 512 * 1024 * 1024
    max_request_tokens: int = 8_388_608
    queue_size: int = 4  # passes that may wait behind the running one; more get 503
    log_level: str = "info"


@dataclass
class TargetConfig:
    """Client mode: run the benchmark against a running server instead of starting a backend."""

    url: Optional[str] = None  # e.g. http://127.0.0.1:8000
    timeout_s: float = 3600.0  # per request


@dataclass
class HarnessConfig:
    backend: BackendSpec = MISSING
    model: ModelSpec = MISSING
    workload: WorkloadSpec = MISSING
    bench: BenchConfig = field(default_factory=BenchConfig)
    logger: Any = None  # logger/ group (W&B); free-form, read by harness.tracking
    # The knobs a user types; backend.* interpolates them.
    mtpm: Optional[int] = None  # max tokens per micro-batch; null = fixed mbs slices
    mbs: int = 1  # micro-batch size (sequences) when mtpm is null
    layout: str = "padded"  # padded or packed (see backends/planning)
    planner: str = "greedy"  # greedy or balanced
    gc: bool = False  # gradient checkpointing
    seed: int = 0  # token ids of the workload
    world_size: Optional[int] = None  # ranks; null = one per GPU, else 2 CPU ranks (1 for pytorch)
    dry_run: bool = False  # plan only: no model, no processes
    hot: bool = False  # multirun: load the backend once, switch mtpm/mbs through its control file
    resume: bool = False  # skip points whose results.json in this sweep folder already says ok
    server: ServerConfig = field(default_factory=ServerConfig)
    target: TargetConfig = field(default_factory=TargetConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="harness_schema", node=HarnessConfig)


def _positive_int(key: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    valid = "a positive integer" + (" or null" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{key}: must be {valid}, got {value!r}")


def config_error_line(exc: OmegaConfBaseException) -> str:
    """One line for an OmegaConf error: the key, then the first line of the message."""
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{key}: {msg}" if key else msg


def validate(cfg: HarnessConfig) -> None:
    """Checks of values (types are checked by Hydra against the schema)."""
    backend_entry(cfg.backend.name)  # "backend.name: '...' is not a backend (valid: ...)"
    _positive_int("mtpm", cfg.backend.max_tokens_per_microbatch, allow_none=True)
    _positive_int("mbs", cfg.backend.micro_batch_size)
    _positive_int("world_size", cfg.backend.world_size, allow_none=True)
    if cfg.backend.layout not in LAYOUTS:
        raise UserError(f"layout: '{cfg.backend.layout}' is not a layout (valid: {', '.join(LAYOUTS)})")
    if cfg.backend.planner not in PLANNERS:
        raise UserError(f"planner: '{cfg.backend.planner}' is not a planner (valid: {', '.join(PLANNERS)})")
    if cfg.backend.planner == "balanced" and cfg.backend.max_tokens_per_microbatch is None:
        raise UserError("planner: balanced needs a budget (set mtpm=<tokens>; with mtpm=null use planner=greedy: fixed-size slices have nothing to balance)")
    check_model_spec(cfg.model, cfg.backend.layout)  # model.vocab_size with a checkpoint; packed on an unsupported model
    # numpy's generators take no negative seed, and the published length generator (RandomState) none above 2**32-1.
    if cfg.seed < 0:
        raise UserError(f"seed: must be an integer >= 0, got {cfg.seed}")
    if not 0 <= cfg.workload.seed <= 2**32 - 1:
        raise UserError(f"workload.seed: must be an integer in 0..{2**32 - 1}, got {cfg.workload.seed}")
    _positive_int("backend.logprob_chunk_tokens", cfg.backend.logprob_chunk_tokens, allow_none=True)
    if cfg.bench.warmup < 0:
        raise UserError(f"bench.warmup: must be >= 0, got {cfg.bench.warmup}")
    _positive_int("bench.repeat", cfg.bench.repeat)
    for key in ("memory_limit_gb", "pass_timeout_s"):
        value = getattr(cfg.bench, key)
        if value is not None and value <= 0:
            raise UserError(f"bench.{key}: must be a positive number or null, got {value}")
