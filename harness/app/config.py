"""The config: the schema Hydra validates harness/conf/ against, the checks it cannot express, resolution, and one-line
config errors.

``resolve_config`` turns Hydra's DictConfig into a checked HarnessConfig (a
UserError naming the key when it cannot); ``config_error_line`` and
``composition_error_line`` say an OmegaConf or Hydra error in one line.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException, MissingConfigException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from backends.errors import UserError
from backends.model.configs import check_model_spec
from backends.registry import backend_entry
from backends.runtime.profiling import PROFILE_RANKS, PROFILE_STEPS
from backends.specs import BackendSpec, ModelSpec
from balance_batch import LAYOUTS
from balance_batch.planners import planner_names
from harness.app.batching import AUTO, Batching, batching_by_budget, check_spellings, interpolations
from harness.data.workload import WorkloadSpec
from harness.metrics.calibration import CALIBRATED, check_cost_model
from harness.peers import PEERS, peer_layout


@dataclass
class BenchConfig:
    warmup: int = 1  # untimed runs per pass type
    repeat: int = 3  # timed runs per pass type
    save_outputs: bool = False  # write example_outputs.json (per-example losses, gradient norm)
    progress_every_s: float = 10.0  # how often a long pass logs its progress
    util_sample_s: float = 0.1  # device utilisation / memory sampling interval
    memory_limit_gb: Optional[float] = None  # cap each worker's memory (docs/failures.md: out of memory is a result)
    pass_timeout_s: Optional[float] = None  # a pass running longer ends the point with status "timeout"
    # A multirun with no mbs=1 point for a backend (and setting) measures one, the speedup column's reference.
    baseline: bool = True
    # A multirun point whose plan is one an earlier point of the sweep measured (same micro-batches, same
    # setting) shares that measurement instead of repeating it; its results.json says whose.
    share_plans: bool = True
    # mtpm=auto: the budget must fit in the device's memory less this fraction (or in bench.memory_limit_gb).
    memory_headroom: float = 0.1
    # One more run of each pass type after the timed ones, not counted in tok/s, under torch.profiler: a trace per
    # rank (profile/<pass>-rank<r>.json.gz) and where the time went (passes.<type>.profile).
    profile: bool = False
    # What a profiled run records (backends/runtime/profiling.py): this many micro-batches after the first (0: the
    # whole pass), on these ranks (null: every rank), with the allocator's events or not
    profile_steps: int = PROFILE_STEPS
    profile_ranks: Optional[list] = field(default_factory=lambda: list(PROFILE_RANKS))
    profile_memory: bool = False
    # On CUDA: the allocator's history recorded during each pass type's warm-up; a pass that runs out of memory
    # dumps memory/<pass>-rank<r>.pickle (https://pytorch.org/memory_viz) and results.json names it.
    memory_snapshot: bool = False
    # A point with a budget measures its fwd+bwd speedup in pairs: each timed repeat beside an mbs=1 pass on the
    # same backend, in alternating order, so a machine drifting between points does not enter the ratio.
    paired: bool = True
    # More timed repeats, up to max_repeats, until the 95% interval of each pass's tok/s (and of a paired
    # speedup) is within this many percent of it; null: bench.repeat repeats exactly.
    target_ci_pct: Optional[float] = None
    max_repeats: int = 20


@dataclass
class CalibrationConfig:
    """``cost_model=calibrated``: how its fit is measured and kept (harness/metrics/calibration.py)."""

    # The spread's longest sequence: null = the workload's longest (a server: its budget, else 4096), rounded up to a
    # power of two; micro-batches longer than it are extrapolated by the fit.
    max_len: Optional[int] = None
    warmup: int = 1  # untimed calibration passes
    repeat: int = 3  # timed calibration passes (each micro-batch's busy time is their mean)
    cache: bool = True  # keep fits on disk, keyed by what they depend on; false: calibrate in every run
    cache_dir: Optional[str] = None  # null: $BALANCE_BATCH_CALIBRATION_CACHE, else ~/.cache/balance_batch/calibration


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
class HarnessConfig(Batching):
    """The whole config; the batching knobs a user types at the top level are Batching's (harness/app/batching.py)."""

    backend: BackendSpec = MISSING
    model: ModelSpec = MISSING
    workload: WorkloadSpec = MISSING
    bench: BenchConfig = field(default_factory=BenchConfig)
    logger: Any = None  # logger/ group (W&B); free-form, read by harness.point.tracking
    # What a batching=<name> preset sets (harness/conf/batching/<name>.yaml): its name and the knobs it fixes.
    batching: Dict[str, Any] = field(default_factory=dict)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    gc: bool = False  # gradient checkpointing
    token_seed: int = 0  # the generated token ids' (a dataset's ids are its text's: refused there)
    world_size: Optional[int] = None  # ranks; null = one per GPU, else 2 CPU ranks (1 for pytorch)
    dry_run: bool = False  # plan only: no model, no processes
    hot: bool = False  # multirun: load the backend once, switch mtpm/mbs through its control file
    resume: bool = False  # skip points whose results.json in this sweep folder already says ok
    server: ServerConfig = field(default_factory=ServerConfig)
    target: TargetConfig = field(default_factory=TargetConfig)


def schema() -> DictConfig:
    """HarnessConfig as conf/ composes onto it: the knobs follow a preset unless typed (harness/app/batching.py), and
    the backend's batching fields, gradient checkpointing, ranks and memory limit follow the top-level knobs, so that a
    backend's file (conf/backend/) says only what differs: its name."""
    node = OmegaConf.structured(HarnessConfig)
    node.backend = OmegaConf.structured(BackendSpec)
    node.backend.name = MISSING
    knobs, backend = interpolations()
    for key, value in knobs.items():
        node[key] = value
    for key, value in {**backend, "gradient_checkpointing": "${gc}", "world_size": "${world_size}",
                       "memory_limit_gb": "${bench.memory_limit_gb}"}.items():
        node.backend[key] = value
    return node


def register_configs() -> None:
    ConfigStore.instance().store(name="harness_schema", node=schema())


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


def composition_error_line(exc: BaseException) -> str:
    """One line for a Hydra composition error, naming the key (or the group and its valid options)."""
    if isinstance(exc, MissingConfigException) and exc.options:
        group = os.path.dirname(exc.missing_cfg_file or "") or "config"
        name = os.path.basename(exc.missing_cfg_file or "")
        return f"{group}: '{name}' is not an option (valid: {', '.join(sorted(exc.options))})"
    cause = exc.__cause__ or exc.__context__
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    first = str(exc).splitlines()[0].strip() if str(exc).strip() else type(exc).__name__
    ambiguous = _AMBIGUOUS.fullmatch(first)
    if ambiguous:  # Hydra's advice follows on lines of its own, which the one-line policy would cut
        key, value = ambiguous.group(1), ambiguous.group(2)
        return (f"{key}: the value {value} has a comma, which Hydra reads as a list or a sweep; for one string quote "
                f"it, \"{key}='{value}'\" (the double quotes keep the single ones from the shell); for a list "
                f"write {key}=[{value}]; to sweep over it add -m")
    override = getattr(exc, "override", None) or _override_in(first)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = getattr(cause, "full_key", None) or "?"
        if key in RENAMED:
            return f"{key}: renamed {RENAMED[key]}"
        where = f" (from {override})" if override else ""
        return f"{key}: not a config key{where}; `python -m harness --cfg job` lists them"
    if isinstance(cause, OmegaConfBaseException):
        return config_error_line(cause) + (f" (from {override})" if override else "")
    if isinstance(exc, InstantiationException) and isinstance(exc.__cause__, (ValueError, TypeError)):
        return str(exc.__cause__)  # a callback refused its settings (hydra.callbacks.*): its own line
    return first


# Keys that were renamed: the old spelling is refused with the new one (a key still in the schema under its old name,
# a dataset's workload.max_len, is refused by harness.data.workload.check_unused).
RENAMED = {"seed": "token_seed (it seeds the generated token ids; workload.seed draws lengths or examples, "
                   "model.init_seed the weights)"}

# Hydra's first line for a value with a comma outside a sweep: "Ambiguous value for argument 'key=a,b'".
_AMBIGUOUS = re.compile(r"Ambiguous value for argument '([^=']+)=(.*)'")


def check_known_keys(cfg: DictConfig, path: str = "") -> None:
    """A key the schema does not have (added with ``+key=value``, or by a preset) is refused in one line naming it and
    what is valid there (a renamed one: its new name): to_object would drop it, so it would do nothing."""
    kind = OmegaConf.get_type(cfg)
    if not (isinstance(kind, type) and is_dataclass(kind)):
        return  # a free-form node (logger, a preset's batching): its reader checks it
    known = [f.name for f in fields(kind)]
    for key in cfg.keys():
        full = f"{path}{key}"
        if key not in known:
            if full in RENAMED:
                raise UserError(f"{full}: renamed {RENAMED[full]}")
            where = f"under {path[:-1]}" if path else "at the top level"
            raise UserError(f"{full}: not a config key, so it would do nothing (valid {where}: {', '.join(known)})")
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            check_known_keys(child, f"{full}.")


def _override_in(message: str) -> str:
    for prefix in ("Error merging override ", "Could not override "):
        if message.startswith(prefix):
            return message[len(prefix) :].strip(" .'")
    return ""


def check_mtpm(value: Any) -> None:
    """mtpm is a positive integer, null or auto (the schema takes any value so that "auto" composes)."""
    if value is None or value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"mtpm: must be a positive integer, null (fixed mbs slices) or auto (search), got {value!r}")


def fill_batching_defaults(spec: HarnessConfig) -> None:
    """planner / layout left null take their value by budget (mtpm=auto has one); what is set stays."""
    b = spec.backend
    has_budget = b.max_tokens_per_microbatch is not None or spec.mtpm == AUTO
    planner, layout = batching_by_budget(has_budget)
    if b.planner is None:
        b.planner = planner
    if b.layout is None and peer_layout(b.planner):
        b.layout = peer_layout(b.planner)  # a peer runs its own layout (packed on a model that cannot is refused)
    if b.layout is None:
        b.layout = layout
        if layout == "packed" and not _packs(spec.model):
            b.layout = "padded"  # an architecture packing would mix up (a Llama checkpoint): its rows are padded
    spec.planner, spec.layout = b.planner, b.layout


def _packs(model: ModelSpec) -> bool:
    """Whether ``layout=packed`` runs on ``model`` (what check_model_spec says of it)."""
    try:
        check_model_spec(model, "packed")
    except UserError as exc:
        return "layout: packed" not in str(exc)  # refused for another reason: that one is reported by validate
    return True


# W&B's modes a user means (wandb.init also takes its aliases "dryrun" and "run", which no page here names).
LOGGER_MODES = ("online", "offline", "disabled")


def validate(cfg: HarnessConfig) -> None:
    """Checks of values (types are checked by Hydra against the schema)."""
    from backends.runtime.devices import omp_num_threads

    backend_entry(cfg.backend.name)  # "backend.name: '...' is not a backend (valid: ...)"
    omp_num_threads()  # the environment's thread count: refused here, before anything runs, not in a rank
    logger = cfg.logger if isinstance(cfg.logger, dict) else {}
    if logger.get("name") not in (None, "none") and logger.get("mode") not in LOGGER_MODES:
        raise UserError(f"logger.mode: {logger.get('mode')!r} is not a W&B mode (valid: {', '.join(LOGGER_MODES)}; "
                        "its default follows WANDB_MODE)")
    check_mtpm(cfg.mtpm)
    _positive_int("mtpm", cfg.backend.max_tokens_per_microbatch, allow_none=True)
    _positive_int("mbs", cfg.backend.micro_batch_size)
    _positive_int("world_size", cfg.backend.world_size, allow_none=True)
    if cfg.backend.layout not in LAYOUTS:
        raise UserError(f"layout: '{cfg.backend.layout}' is not a layout (valid: {', '.join(LAYOUTS)})")
    _check_planner(cfg)
    # Named as the user types it: backend.max_seqs_per_microbatch interpolates the top-level knob.
    _positive_int("max_seqs_per_microbatch", cfg.backend.max_seqs_per_microbatch, allow_none=True)
    # model.vocab_size with a checkpoint; packed on an unsupported model
    check_model_spec(cfg.model, cfg.backend.layout)
    # numpy's generators take no negative seed, and the published length generator (RandomState) none above 2**32-1.
    if cfg.token_seed < 0:
        raise UserError(f"token_seed: must be an integer >= 0, got {cfg.token_seed}")
    if cfg.token_seed != 0 and cfg.workload.kind == "dataset":  # 0, the default, is the unset value
        raise UserError(f"token_seed: {cfg.token_seed} seeds generated token ids, and workload {cfg.workload.name}'s "
                        "are its text's, so it would be ignored; drop it (workload.seed draws the dataset's rows)")
    if not 0 <= cfg.workload.seed <= 2**32 - 1:
        raise UserError(f"workload.seed: must be an integer in 0..{2**32 - 1}, got {cfg.workload.seed}")
    _positive_int("backend.logprob_chunk_tokens", cfg.backend.logprob_chunk_tokens, allow_none=True)
    if cfg.bench.warmup < 0:
        raise UserError(f"bench.warmup: must be >= 0, got {cfg.bench.warmup}")
    _positive_int("bench.repeat", cfg.bench.repeat)
    if cfg.bench.target_ci_pct is not None and not cfg.bench.target_ci_pct > 0:
        raise UserError(f"bench.target_ci_pct: must be a positive percentage or null, got {cfg.bench.target_ci_pct}")
    _positive_int("bench.max_repeats", cfg.bench.max_repeats)
    if cfg.bench.target_ci_pct is not None and cfg.bench.max_repeats < max(2, cfg.bench.repeat):
        raise UserError(f"bench.max_repeats: must be at least bench.repeat ({cfg.bench.repeat}) and 2 for an interval "
                        f"to narrow to bench.target_ci_pct, got {cfg.bench.max_repeats}")
    for key in ("memory_limit_gb", "pass_timeout_s"):
        value = getattr(cfg.bench, key)
        if value is not None and value <= 0:
            raise UserError(f"bench.{key}: must be a positive number or null, got {value}")
    timeout = cfg.backend.startup_timeout_s
    if timeout is not None and not timeout > 0:
        raise UserError(f"backend.startup_timeout_s: must be a positive number of seconds or null (no deadline), "
                        f"got {timeout}")
    if not 0 <= cfg.bench.memory_headroom < 1:
        raise UserError(f"bench.memory_headroom: must be a fraction in [0, 1), got {cfg.bench.memory_headroom}")
    if cfg.backend.compile and cfg.backend.gradient_checkpointing:
        raise UserError("backend.compile: a layer under gradient checkpointing is not compiled (torch runs the "
                        "checkpointed layer eagerly), so nothing would be; use gc=false, or backend.compile=false")
    if cfg.backend.compile and cfg.bench.warmup < 1:
        raise UserError("backend.compile: needs bench.warmup >= 1 (the warm-up pays for compiling, minutes on a CPU; "
                        f"with bench.warmup={cfg.bench.warmup} the first timed repeat would time the compiler)")
    if cfg.bench.memory_snapshot:
        _check_memory_snapshot(cfg)
    check_cost_model(cfg.cost_model)
    _positive_int("calibration.max_len", cfg.calibration.max_len, allow_none=True)
    _positive_int("calibration.repeat", cfg.calibration.repeat)
    if cfg.calibration.warmup < 0:
        raise UserError(f"calibration.warmup: must be >= 0, got {cfg.calibration.warmup}")
    if cfg.bench.profile and cfg.target.url:
        raise UserError("bench.profile: profiles the ranks of a backend this run starts; a server (target.url) runs "
                        "its ranks elsewhere: drop target.url, or bench.profile")
    _check_profile(cfg)
    if cfg.backend.compile_eager_fallback and not cfg.backend.compile:
        raise UserError("backend.compile_eager_fallback=true: says what a compiled layer may do, and "
                        "backend.compile=false compiles none; set backend.compile=true, or drop the fallback")


def _check_planner(cfg: HarnessConfig) -> None:
    """The planner: one there is, and with the budget it needs (or, for a fixed count, not mtpm=auto)."""
    if cfg.backend.planner not in planner_names():  # the library's and the peers' (harness/peers registers them)
        raise UserError(f"planner: '{cfg.backend.planner}' is not a planner (valid: {', '.join(planner_names())})")
    if cfg.backend.planner == "balanced" and cfg.backend.max_tokens_per_microbatch is None and cfg.mtpm != AUTO:
        raise UserError("planner: balanced needs a budget (set mtpm=<tokens>; with mtpm=null use planner=greedy: "
                        "fixed-size slices have nothing to balance)")
    peer = PEERS.get(cfg.backend.planner)
    if peer and peer.needs_budget and cfg.backend.max_tokens_per_microbatch is None and cfg.mtpm != AUTO:
        raise UserError(f"planner: {peer.name} needs a budget (set mtpm=<tokens>; of the peers only trl_fixed plans "
                        "without one)")
    if peer and not peer.needs_budget and cfg.mtpm == AUTO:
        raise UserError(f"mtpm: auto searches the token budget, and planner={peer.name} takes none (a fixed count of "
                        "sequences per rank each step), so every budget would plan alike; run it with mtpm=null, or "
                        "search with a planner that takes a budget")


def _check_profile(cfg: HarnessConfig) -> None:
    """bench.profile_steps / profile_ranks / profile_memory: valid, and only beside bench.profile=true."""
    bench = cfg.bench
    if bench.profile_steps < 0:
        raise UserError(f"bench.profile_steps: must be >= 0 (0: the whole pass), got {bench.profile_steps}")
    ranks = None if bench.profile_ranks is None else list(bench.profile_ranks)
    if ranks is not None and (not ranks or any(not isinstance(r, int) or r < 0 for r in ranks)):
        raise UserError(f"bench.profile_ranks: a list of rank numbers (>= 0) or null for every rank, got {ranks}")
    changed = [k for k, v, default in (("profile_steps", bench.profile_steps, PROFILE_STEPS),
                                       ("profile_ranks", ranks, list(PROFILE_RANKS)),
                                       ("profile_memory", bench.profile_memory, False)) if v != default]
    if changed and not bench.profile:
        raise UserError(f"bench.{changed[0]}: says what a profiled run records, and bench.profile=false profiles "
                        "nothing; set bench.profile=true, or drop it")


def _check_memory_snapshot(cfg: HarnessConfig) -> None:
    """bench.memory_snapshot records the CUDA allocator during the warm-up, in ranks this run starts."""
    import torch

    if cfg.target.url:
        raise UserError("bench.memory_snapshot: records the allocator of ranks this run starts; a server (target.url) "
                        "runs its ranks elsewhere: drop target.url, or bench.memory_snapshot")
    if cfg.bench.warmup < 1:
        raise UserError("bench.memory_snapshot: records during the warm-up (never the timed repeats), so it needs "
                        f"bench.warmup >= 1, got {cfg.bench.warmup}")
    if cfg.backend.device == "cpu" or (cfg.backend.device == "auto" and not torch.cuda.is_available()):
        no_gpu = ", no GPU here" if cfg.backend.device == "auto" else ""
        raise UserError(f"bench.memory_snapshot: records the CUDA allocator's history, and this run's device is cpu "
                        f"(backend.device={cfg.backend.device}{no_gpu}); on a CPU a run out of memory is the OS limit "
                        "(bench.memory_limit_gb), with no allocator to record")


def without_auto(cfg: DictConfig) -> DictConfig:
    """``cfg`` as it resolves: with mtpm=auto, backend.max_tokens_per_microbatch (which interpolates it) is null,
    the search setting it per candidate (harness/auto/model.py); any other config is returned as is."""
    if OmegaConf.select(cfg, "mtpm", throw_on_resolution_failure=False) != AUTO:
        return cfg
    cfg = copy.deepcopy(cfg)
    OmegaConf.update(cfg, "backend.max_tokens_per_microbatch", None, force_add=False)
    return cfg


def check_calibration_keys(cfg: DictConfig) -> None:
    """``calibration.*`` set while cost_model=flops is refused in one line naming both: nothing is calibrated, so the
    settings would be ignored silently. In a multirun they are the sweep's: its flops points carry them for its
    calibrated ones (cost_model=flops,calibrated), so a multirun's points are not refused here; the sweep as a whole
    is (``check_sweep_calibration``)."""
    if OmegaConf.select(cfg, "cost_model", throw_on_resolution_failure=False) == CALIBRATED or _in_multirun():
        return
    _refuse_calibration_keys(cfg, "this run has")


def check_sweep_calibration(configs: Sequence[Any]) -> None:
    """A multirun's ``calibration.*`` with no point of cost_model=calibrated is refused as a single run's is: no
    point would read them. ``configs``: the points' composed configs (None: one that does not compose)."""
    composed = [c for c in configs if c is not None]
    if not composed or any(OmegaConf.select(c, "cost_model", throw_on_resolution_failure=False) == CALIBRATED
                           for c in composed):
        return
    _refuse_calibration_keys(composed[0], "no point of this sweep has cost_model=calibrated; they have")


def _refuse_calibration_keys(cfg: Any, which: str) -> None:
    given = OmegaConf.select(cfg, "calibration", throw_on_resolution_failure=False) or {}
    defaults = CalibrationConfig()
    shown = lambda v: "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    typed = [f"calibration.{k}={shown(given[k])}" for k in given
             if hasattr(defaults, k) and given[k] != getattr(defaults, k)]
    if typed:
        cost_model = OmegaConf.select(cfg, "cost_model", throw_on_resolution_failure=False)
        raise UserError(f"{', '.join(typed)}: calibration.* sets up cost_model=calibrated, and {which} "
                        f"cost_model={cost_model}, which calibrates nothing; set cost_model=calibrated, or drop "
                        f"{'it' if len(typed) == 1 else 'them'}")


def _in_multirun() -> bool:
    """Whether Hydra runs this config as one job of a multirun (-m)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def resolve_config(cfg: DictConfig) -> HarnessConfig:
    """Hydra's composed config as a checked HarnessConfig; a UserError with one line when it is not valid."""
    try:
        check_mtpm(OmegaConf.select(cfg, "mtpm", throw_on_resolution_failure=False))
        check_known_keys(cfg)
        check_spellings(cfg)
        check_calibration_keys(cfg)
        spec = OmegaConf.to_object(without_auto(cfg))
    except OmegaConfBaseException as exc:
        raise UserError(config_error_line(exc)) from None
    assert isinstance(spec, HarnessConfig)
    fill_batching_defaults(spec)
    validate(spec)
    return spec


def launcher_sets_world_size(backend_spec: BackendSpec, overrides: Sequence[str]) -> None:
    """Under torchrun/Slurm a preset's world_size (experiment=seed_b200: 4) gives way to the launcher's;
    only one typed on the command line is checked against it (backends.runtime.job.check_world_size)."""
    from backends.runtime.job import launch_env
    from harness.sweep.points import override_key

    if launch_env() is None:
        return
    if not any(override_key(o) in ("world_size", "backend.world_size") for o in overrides):
        backend_spec.world_size = None
