"""``cost_model=calibrated``: the planner's cost model fitted to micro-batch times measured on the hardware that runs
it.

The FLOP model (a·L + b·L² per sequence, balance_batch/cost.py) leaves out
what the hardware adds: a cost per micro-batch (launches, FSDP2's per-layer
all-gathers), a cost per sequence (attention and the delta-rule scan run once
per sequence of a packed row on the CPU paths), memory-bound layers. So once
per backend, model, precision, device and layout a short calibration pass
runs a spread of micro-batch shapes (one to many sequences, 64 tokens to the
workload's longest) through the backend's own forward + backward, every rank
running every shape at the same step (so lock-step ranks wait for nobody),
reads each micro-batch's busy time from the ranks' timeline
(backends/runtime/timeline.py), and fits

    time = c0 + c_seq · sequences + c_tok · tokens + c_sq · Σ L²

(padded rows on their padded shape: every row as long as the longest) by
non-negative least squares weighted to relative error: a short micro-batch's
time counts as much as a long one's. The fit becomes a ``CostModel`` in
seconds (a = c_tok, b = c_sq, c = c_seq, fixed = c0) that the balanced
planner uses in place of FLOPs; ``plan.cost_model.fit`` in results.json holds
the coefficients, R², the worst relative error and every shape's residual.

A fit is reused: within a process (a sweep's points, a hot sweep) and across
runs through a small JSON cache (``calibration.cache_dir``) keyed by
everything it depends on — backend, ranks, device, model and its precision,
layout, gradient checkpointing, compilation, the log-prob chunk, the spread's
longest sequence, torch and transformers versions, this module's version — so
changing any of them calibrates again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from backends.errors import UserError
from balance_batch.cost import CostModel

log = logging.getLogger("harness.calibration")  # the log channel's name, kept when the module moved

CALIBRATION_VERSION = 2  # what the spread and the fit are; a change calibrates again
CALIBRATED, FLOPS = "calibrated", "flops"
COST_MODELS = (FLOPS, CALIBRATED)
COEFFICIENTS = ("c0", "c_seq", "c_tok", "c_sq")  # seconds per micro-batch, per sequence, per token, per token²
SHORTEST = 64  # the spread's shortest sequence
SMALLEST_SPREAD = 512  # the spread's longest sequence is never below this
_SEED = 1234  # token ids and the order of the shapes


@dataclass(frozen=True)
class Shape:
    """One micro-batch of the spread: the lengths of its sequences."""

    lengths: tuple[int, ...]

    def features(self, layout: str) -> tuple[int, int, int, int]:
        """(1, sequences, tokens, Σ L²): packed as the sequences are, padded on the padded shape."""
        n = len(self.lengths)
        if layout == "packed":
            return 1, n, sum(self.lengths), sum(x * x for x in self.lengths)
        longest = max(self.lengths)
        return 1, n, n * longest, n * longest * longest


def spread_longest(max_len: int) -> int:
    """The spread's longest sequence: ``max_len`` rounded up to a power of two, at least ``SMALLEST_SPREAD``."""
    return max(SMALLEST_SPREAD, 1 << max(0, math.ceil(math.log2(max(1, max_len)))))


def spread(longest: int, layout: str) -> list[Shape]:
    """The calibration's micro-batches: for each scale L = 64, 128, ... up to ``longest``, one sequence alone, a few,
    and as many as fill ``longest`` tokens; packed rows also mix one long sequence with many short ones.

    Each sequence is 3/4 L to L long, drawn with a fixed seed: real lengths are rarely a multiple of a kernel's
    chunk (the delta rule's 64), and what a sequence wastes in its last chunk is a cost per sequence the fit should
    see. Sequences, tokens and Σ L² vary apart from each other, so the four coefficients are told apart.
    """
    rng = np.random.default_rng(_SEED)

    def drawn(scale: int, k: int) -> tuple[int, ...]:
        return tuple(int(n) for n in scale - rng.integers(0, scale // 4 + 1, size=k))

    scales = (
        [SHORTEST << i for i in range(int(math.log2(longest // SHORTEST)) + 1)] if longest >= SHORTEST else [longest]
    )
    shapes = []
    for scale in scales:
        full = longest // scale
        for k in sorted({1, max(1, round(math.sqrt(full))), full}):
            shapes.append(Shape((scale,) if k == 1 and scale == longest else drawn(scale, k)))
    if layout == "packed" and longest >= 4 * SHORTEST:
        half = longest // 2
        shapes.append(Shape(drawn(half, 1) + drawn(SHORTEST, half // SHORTEST)))
        shapes.append(Shape(drawn(longest // 4, 2) + drawn(2 * SHORTEST, half // (2 * SHORTEST))))
    order = rng.permutation(len(shapes))  # no drift of the machine lines up with size
    return [shapes[i] for i in order]


# -- the fit ---------------------------------------------------------------------------------------------------
def fit_times(rows: Sequence[Sequence[float]], times: Sequence[float]) -> dict:
    """Non-negative least squares of ``times`` on ``rows`` (1, sequences, tokens, Σ L²), weighted by 1 / time.

    Returns the coefficients (seconds), R² (unweighted, of the times), the worst relative error and the
    predictions. Four coefficients: every subset of them is solved and the best one with no negative coefficient
    kept (the exact non-negative solution, 16 small solves).
    """
    X = np.asarray(rows, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if len(y) < len(COEFFICIENTS) or (y <= 0).any():
        raise ValueError(f"a calibration needs at least {len(COEFFICIENTS)} micro-batches with positive times, "
                         f"got {len(y)}")
    w = 1.0 / y
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    best, best_err = np.zeros(X.shape[1]), math.inf
    for mask in range(1, 1 << X.shape[1]):
        cols = [j for j in range(X.shape[1]) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(Xs[:, cols] * w[:, None], y * w, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(X.shape[1])
        full[cols] = coef
        err = float(((((Xs @ full) - y) * w) ** 2).sum())
        if err < best_err - 1e-15:
            best, best_err = full, err
    coef = best / scale
    predicted = X @ coef
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else None
    return {"coefficients": dict(zip(COEFFICIENTS, (float(c) for c in coef))),
            "r2": None if r2 is None else round(r2, 5),
            "worst_rel_err": round(float(np.max(np.abs(y - predicted) / y)), 4),
            "predicted": predicted.tolist()}


def cost_model_of(fit: dict, source: str) -> CostModel:
    """The planner's CostModel of a fit: a = c_tok, b = c_sq, c = c_seq, fixed = c0 (seconds of forward + backward)."""
    k = fit["coefficients"]
    return CostModel(a=k["c_tok"], b=k["c_sq"], source=source, c=k["c_seq"], fixed=k["c0"], fit=fit)


# -- what a fit depends on, and its cache ----------------------------------------------------------------------
def identity(backend: str, world_size: int, device: dict, model, layout: str, gc: bool, compile: bool,
             logprob_chunk_tokens: Optional[int], longest: int) -> dict:
    """Everything a calibration depends on (the cache key is its hash): ``model`` is a ModelSpec."""
    from importlib import metadata

    import torch

    from backends.model.build import resolve_dtype
    from backends.model.configs import model_config

    config, _ = model_config(model)
    dtype = resolve_dtype(model.dtype, torch.device(device.get("type") or "cpu"))
    versions = {}
    for dist in ("torch", "transformers", "megatron-core"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {
        "version": CALIBRATION_VERSION,
        "backend": backend,
        "world_size": world_size,
        "device": {k: device.get(k) for k in ("type", "name", "count", "cores")},
        "model": {
            "name": model.name,
            "path": model.path,
            "lora_rank": model.lora_rank,
            "dtype": str(dtype).split(".")[-1],
            "attn_implementation": model.attn_implementation,
            "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16],
        },
        "layout": layout,
        "gc": bool(gc),
        "compile": bool(compile),
        "logprob_chunk_tokens": logprob_chunk_tokens,
        "longest": longest,
        "versions": versions,
    }


def calibration_identity(spec, backend: str, world_size: int, device: Optional[dict], longest: int) -> dict:
    """The calibration a resolved config uses on this backend, ranks and device: the one identity a point and the
    server both look their fit up by. ``longest``: the spread's longest sequence when calibration.max_len is unset
    (rounded by spread_longest)."""
    b = spec.backend
    return identity(backend, world_size, device or {}, spec.model, b.layout, b.gradient_checkpointing, b.compile,
                    b.logprob_chunk_tokens, spread_longest(spec.calibration.max_len or longest))


def cache_key(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    """$BALANCE_BATCH_CALIBRATION_CACHE, else the user's cache folder (~/.cache/balance_batch/calibration)."""
    if os.environ.get("BALANCE_BATCH_CALIBRATION_CACHE"):
        return Path(os.environ["BALANCE_BATCH_CALIBRATION_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "balance_batch" / "calibration"


def cache_folder(cfg) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def read_cached(folder: Path, key: str, ident: dict) -> Optional[dict]:
    """The cached fit for ``key``, or None (absent, unreadable, or made for something else: then it is measured
    again)."""
    path = folder / f"{key}.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("calibration cache %s unreadable (%s); calibrating again", path, exc)
        return None
    if not isinstance(doc, dict) or doc.get("identity") != ident or not isinstance(doc.get("fit"), dict):
        log.warning("calibration cache %s is not a fit of this setting; calibrating again", path)
        return None
    problem = _fit_problem(doc["fit"])
    if problem:
        log.warning("calibration cache %s holds no usable fit (%s); calibrating again", path, problem)
        return None
    return doc["fit"]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fit_problem(fit: dict) -> str:
    """What makes a cached fit unusable (a file edited or written by another tool), or "" for a usable one: the
    planner needs the four coefficients as finite numbers >= 0, and the log line its R² and worst error."""
    k = fit.get("coefficients")
    if not isinstance(k, dict):
        return "no coefficients"
    bad = [name for name in COEFFICIENTS if not (_number(k.get(name)) and k[name] >= 0)]
    if bad:
        return f"coefficient {bad[0]} is {k.get(bad[0])!r}, not a number >= 0"
    if not (fit.get("r2") is None or _number(fit["r2"])) or not _number(fit.get("worst_rel_err")):
        return "no r2 or worst_rel_err"
    return ""


def write_cached(folder: Path, key: str, ident: dict, fit: dict) -> Optional[Path]:
    """Write the fit (atomically); a cache folder that cannot be written is a warning, not a failure."""
    from backends.runtime.atomic import write_text_atomic

    path = folder / f"{key}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"identity": ident, "fit": fit}, indent=1) + "\n")
    except OSError as exc:
        log.warning("calibration.cache_dir: cannot write %s (%s); the fit is used but not kept", path,
                    exc.strerror or exc)
        return None
    return path


_MEMO: dict[str, dict] = {}  # key -> fit, this process's calibrations (a sweep's points reuse them without the disk)


# -- running a calibration ----------------------------------------------------------------------------------
def calibration_command(shapes: Sequence[Shape], world_size: int, layout: str, vocab_size: int, **options):
    """One forward + backward pass in which every rank runs every shape, shape s at step s (a PassCommand)."""
    from backends.messages import Example, PassCommand

    rng = np.random.default_rng(_SEED)
    examples: list = []
    schedules: list[list[list[int]]] = [[] for _ in range(world_size)]
    for shape in shapes:
        for r in range(world_size):
            batch = []
            for n in shape.lengths:
                ids = rng.integers(0, vocab_size, n, dtype=np.int64)
                examples.append(Example(ids, np.roll(ids, -1), np.ones(n, dtype=np.float32)))
                batch.append(len(examples) - 1)
            schedules[r].append(batch)
    return PassCommand("forward_backward", examples, None, 1, layout=layout, schedules=schedules, **options)


def measure_shapes(backend, shapes: Sequence[Shape], layout: str, vocab_size: int, warmup: int, repeat: int,
                   label: str = "", **options) -> tuple[list[tuple[int, ...]], list[float], list[float]]:
    """Run the calibration pass ``warmup`` + ``repeat`` times; each (rank, shape)'s features and mean busy seconds,
    and the pass's wall seconds per timed repeat."""
    command = calibration_command(shapes, backend.world_size, layout, vocab_size, **options)
    busy: list[list[list[float]]] = []  # [repeat][rank][shape]
    walls = []
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        result = backend.run_pass(command.replace(release_memory=i == 0))
        if result.timeline is None:
            raise UserError(f"cost_model: calibrated needs the backend's step times, and {backend.name} sent none "
                            "(a server older than this harness?); use cost_model=flops")
        wall = time.perf_counter() - t0
        log.info("%scalibration %s %d/%d: %d shapes, %.1f s", label, "warm-up" if i < warmup else "repeat",
                 i + 1 if i < warmup else i + 1 - warmup, warmup if i < warmup else repeat, len(shapes), wall)
        if i >= warmup:
            busy.append([rank["busy_s"] for rank in result.timeline["per_rank"]])
            walls.append(wall)
    mean = np.mean(np.asarray(busy, dtype=np.float64), axis=0)  # [rank][shape]
    rows, times = [], []
    for per_rank in mean:
        for shape, t in zip(shapes, per_rank):
            rows.append(shape.features(layout))
            times.append(float(t))
    return rows, times, walls


def calibrate(backend, shapes: Sequence[Shape], layout: str, vocab_size: int, warmup: int, repeat: int,
              label: str = "", **options) -> dict:
    """Measure the shapes on ``backend`` and fit them: the fit record (``plan.cost_model.fit`` in results.json)."""
    t0 = time.perf_counter()
    rows, times, walls = measure_shapes(backend, shapes, layout, vocab_size, warmup, repeat, label, **options)
    fit = fit_times(rows, times)
    predicted = fit.pop("predicted")
    world = backend.world_size
    residuals = []  # per shape: its features, the ranks' mean measured time and the fit's
    for s, shape in enumerate(shapes):
        measured = [times[r * len(shapes) + s] for r in range(world)]
        _, n, tokens, sq = shape.features(layout)
        residuals.append(
            {
                "sequences": n,
                "tokens": tokens,
                "sum_sq": sq,
                "measured_s": round(float(np.mean(measured)), 6),
                "predicted_s": round(float(predicted[s]), 6),
            }
        )
    residuals.sort(key=lambda r: (r["tokens"], r["sequences"]))
    fit.update(pass_type="forward_backward", layout=layout, shapes=len(shapes), ranks=world, repeats=repeat,
               micro_batches=len(times), seconds=round(time.perf_counter() - t0, 2),
               pass_wall_s=[round(w, 3) for w in walls], residuals=residuals,
               calibrated_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return fit


def calibrated_cost_model(cfg, ident: dict, backend=None, vocab_size: Optional[int] = None, label: str = "",
                          **options) -> CostModel:
    """The calibrated CostModel for ``ident`` (see ``identity``): this process's, the cache's, or measured on
    ``backend`` now; without a backend (a dry run) a fit must be cached, else a one-line UserError.

    ``cfg`` is the ``calibration`` config (cache, cache_dir, repeat, warmup); ``options`` go to the pass commands.
    """
    key = cache_key(ident)
    folder = cache_folder(cfg)
    fit = _MEMO.get(key)
    where = "this run"
    if fit is None and cfg.cache:
        fit = read_cached(folder, key, ident)
        where = f"cache {folder / (key + '.json')}"
    if fit is None:
        if backend is None:
            raise UserError("cost_model: calibrated needs a fit measured on this backend, model, precision, device "
                            f"and layout, and none is cached in {folder} (key {key}); a run without dry_run=true "
                            "calibrates and caches one")
        shapes = spread(ident["longest"], ident["layout"])
        log.info("%scalibrating the cost model: %d micro-batch shapes up to %s tokens, %d warm-up + %d timed passes "
                 "on %s (once per setting: cached by key %s)", label, len(shapes), f"{ident['longest']:,}",
                 cfg.warmup, cfg.repeat, ident["backend"], key)
        fit = calibrate(backend, shapes, ident["layout"], vocab_size, cfg.warmup, cfg.repeat, label, **options)
        fit["key"] = key
        where = "measured now"
        if cfg.cache:
            written = write_cached(folder, key, ident, fit)
            if written is not None:
                where += f", cached in {written}"
    _MEMO[key] = fit
    k = fit["coefficients"]
    (log.debug if where == "this run" else log.info)("%scalibrated cost model (%s): %.3g s per micro-batch + %.3g s "
                                                     "per sequence + %.3g s per token + "
             "%.3g s per token², R² %s, worst relative error %.1f%%", label, where, k["c0"], k["c_seq"], k["c_tok"],
             k["c_sq"], "—" if fit["r2"] is None else f"{fit['r2']:.4f}", 100 * fit["worst_rel_err"])
    source = (f"calibrated: {ident['backend']} on {ident['world_size']} × "
              f"{ident['device'].get('name') or ident['device'].get('type')}, "
              f"{ident['model']['name']} {ident['model']['dtype']}, {ident['layout']}, seconds of forward + backward")
    return cost_model_of(fit, source)


def check_cost_model(value: Any) -> None:
    if value not in COST_MODELS:
        raise UserError(f"cost_model: '{value}' is not a cost model (valid: {', '.join(COST_MODELS)})")
