"""How a batch is cut, described once: the batching knobs, their backend spelling, their presets and their checks.

Every part of the harness that must know which keys are batching reads them here: the config's schema and its
resolution (harness/app/config.py), a sweep's settings and baselines (harness/sweep/points.py), hot switching
(harness/sweep/hot.py), plan sharing (harness/point/sharing.py) and results.json's first record
(harness/point/results.py). A leaf module: no harness imports, so results.json's first write can use it on a config that
does not resolve.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from backends.errors import UserError
from harness.peers import PEERS, peer_layout

AUTO = "auto"  # mtpm=auto: search the budget (harness/auto/model.py)


@dataclass
class Batching:
    """How a batch is cut: the knobs a user types at the top level, by the names results.json records them under.

    A field's ``backend`` metadata names the BackendSpec field (backends/specs.py) it fills; the harness writes
    those, a user never does (a value set there is a second spelling, refused by ``check_spellings``).
    """

    # max tokens per micro-batch; null = fixed mbs slices; "auto" = search the fastest that fits (harness/auto/model.py)
    mtpm: Any = field(default=None, metadata={"backend": "max_tokens_per_microbatch"})
    mbs: int = field(default=1, metadata={"backend": "micro_batch_size"})  # sequences per slice when mtpm is null
    # packed (sum of lengths <= mtpm, sequences end to end) or padded (count x longest <= mtpm); null: by budget
    layout: Optional[str] = field(default=None, metadata={"backend": "layout"})
    # balanced (fewest steps, even modeled cost; needs a budget) or greedy (the original), or a peer's way
    # (harness/peers/: verl, nemo_rl_packing, ...; in its own layout unless one is set); null: by budget
    planner: Optional[str] = field(default=None, metadata={"backend": "planner"})
    # at most this many sequences in a micro-batch; null = no cap
    max_seqs_per_microbatch: Optional[int] = field(default=None, metadata={"backend": "max_seqs_per_microbatch"})
    # What the balanced planner balances: flops (a·L + b·L² from the model's config) or calibrated (seconds, fitted
    # to micro-batch times measured on this backend and device: harness/metrics/calibration.py, set up by calibration.*)
    cost_model: str = "flops"


KEYS: tuple[str, ...] = tuple(f.name for f in fields(Batching))  # the top-level knobs, in results.json's order
BACKEND_FIELDS: dict[str, str] = {f.name: f.metadata["backend"] for f in fields(Batching) if "backend" in f.metadata}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Batching)}
PRESETS = "batching"  # the config group of presets (harness/conf/batching/) and the node a preset's settings land in
COST_MODEL_SETTINGS = "calibration"  # how cost_model=calibrated measures its fit: part of how a point batches


def batching_by_budget(has_budget: bool) -> tuple[str, str]:
    """The planner and layout a null knob means: the balanced planner's packed rows with a token budget, the
    original greedy padded slices without one (mbs=1 rows read as they always did)."""
    return ("balanced", "packed") if has_budget else ("greedy", "padded")


def needs_budget(planner: Optional[str]) -> bool:
    """Whether ``planner`` plans by a token budget, so that mtpm=null leaves it nothing to plan with: balanced and
    every peer but TRL's fixed count."""
    peer = PEERS.get(planner or "")
    return planner == "balanced" or (peer is not None and peer.needs_budget)


def is_batching_key(key: str) -> bool:
    """Whether an override's key says how a point batches: a knob, its backend spelling, a preset or the calibration
    of its cost model. A sweep's points that differ only in these share a setting (and a baseline)."""
    head, _, rest = key.partition(".")
    if head in KEYS or head in (PRESETS, COST_MODEL_SETTINGS):
        return True
    return head == "backend" and rest in BACKEND_FIELDS.values()


def unloaded() -> dict[str, None]:
    """The backend fields that do not change what a backend loads (``dataclasses.replace(spec, **unloaded())``):
    mtpm and mbs go through a hot backend's control file, the rest ride in every pass's command."""
    return dict.fromkeys(BACKEND_FIELDS.values())


def without_batching(conf: dict[str, Any]) -> dict[str, Any]:
    """A resolved config (a plain dict) less how it batches: what a plan's measurement depends on besides the plan."""
    out = {k: v for k, v in conf.items() if k not in KEYS and k not in (PRESETS, COST_MODEL_SETTINGS)}
    if isinstance(out.get("backend"), dict):
        out["backend"] = {k: v for k, v in out["backend"].items() if k not in BACKEND_FIELDS.values()}
    return out


def asked(get: Callable[[str], Any]) -> dict[str, Any]:
    """What a point is asked to run, read leniently (``get`` returns None for what does not resolve), so that
    results.json says it even for a config that fails: the backend's value, else the knob's; a budget's balanced
    packed default; mtpm None for mtpm=auto until a budget is chosen."""
    values = {}
    for key in KEYS:
        value = get(f"backend.{BACKEND_FIELDS[key]}") if key in BACKEND_FIELDS else None
        values[key] = value if value is not None else get(key)
    auto = get("mtpm") == AUTO
    if auto:
        values["mtpm"] = None
    planner, layout = batching_by_budget(values["mtpm"] is not None or auto)
    values["planner"] = values["planner"] or planner
    values["layout"] = values["layout"] or peer_layout(values["planner"]) or layout  # a peer's own layout
    return values


def interpolations() -> tuple[dict[str, str], dict[str, str]]:
    """How the composed config fills the knobs: each knob from the preset's node when the preset sets it (else its
    default), each backend field from its knob. A value typed over either replaces the interpolation, which is how
    ``check_spellings`` tells what was set from what follows."""
    knobs = {key: f"${{oc.select:{PRESETS}.{key},{_shown(DEFAULTS[key])}}}" for key in KEYS}
    backend = {name: f"${{{key}}}" for key, name in BACKEND_FIELDS.items()}
    return knobs, backend


def _shown(value: Any) -> str:
    return "null" if value is None else str(value)


def check_spellings(cfg: Any) -> None:
    """Knobs never override each other silently (a UserError of one line naming both sides):

    - a value set under ``backend.`` is a second spelling of a knob that results.json and the report read;
    - a knob set beside a preset (``batching=<name>``) that sets it to another value contradicts it;
    - ``mbs`` beside a token budget would be ignored (a budget cuts micro-batches by tokens).
    """
    from omegaconf import OmegaConf

    def value(key: str) -> Any:
        return OmegaConf.select(cfg, key, throw_on_resolution_failure=False)

    backend = OmegaConf.select(cfg, "backend")
    for key, field_name in BACKEND_FIELDS.items():
        if backend is not None and field_name in backend and not OmegaConf.is_interpolation(backend, field_name):
            typed, knob = _shown(backend[field_name]), _shown(value(key))
            if typed == knob:  # the same value twice: the second spelling only has to go
                raise UserError(f"backend.{field_name}: a second spelling of {key}, which is {knob} here already; "
                                f"drop backend.{field_name}={typed}")
            raise UserError(f"backend.{field_name}: {typed} is a second spelling of {key} ({key}={knob} here), the "
                            f"knob results.json and the report read; set {key}={typed} instead")
    preset = OmegaConf.select(cfg, PRESETS) or {}
    name = preset.get("name", "?")
    for key in preset:
        if key == "name":
            continue
        if key not in KEYS:
            raise UserError(f"{PRESETS}.{key}: a batching preset ({name}) sets only {', '.join(KEYS)}")
        if not OmegaConf.is_interpolation(cfg, key) and value(key) != preset[key]:
            raise UserError(f"{key}: {_shown(value(key))} contradicts {PRESETS}={name}, which sets {key}="
                            f"{_shown(preset[key])}; drop one of the two")
    budget, mbs = value("mtpm"), value("mbs")
    if budget is not None and mbs != DEFAULTS["mbs"]:
        raise UserError(f"mbs: {mbs} beside mtpm={budget} would be ignored (a token budget cuts micro-batches by "
                        f"tokens); for at most {mbs} sequences per micro-batch under the budget set "
                        f"max_seqs_per_microbatch={mbs}, for fixed slices of {mbs} set mtpm=null")
