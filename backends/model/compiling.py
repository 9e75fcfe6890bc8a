"""``backend.compile=true``: torch.compile on each decoder layer, and what compiling cost (time, recompilations, graph
breaks).

What is compiled: each decoder layer's ``forward``, not the whole model.

- A layer is the unit FSDP2 shards and gradient checkpointing recomputes.
  Compiling its ``forward`` (not the module's ``__call__``) leaves their hooks,
  and the checkpoint around the layer, eager, as torchtitan compiles per block.
- The embedding and the chunked log-prob head stay eager: the head's loop over
  chunks depends on the row's length, and it is one matrix product per chunk.
- Dynamic shapes, marked from the first call. The sizes a plan varies (a
  row's tokens, a padded batch's rows, a packed row's sequence count and its
  longest sequence) are symbolic in the first graph compiled for them: before
  each compiled call they are named in ``torch.compiler.config.dynamic_values``
  (which also reaches the frames after a graph break, whose inputs come from
  eager code and carry no mark) and the boundary tensors are marked
  (``maybe_mark_dynamic``). Torch's automatic dynamic shapes (``dynamic=None``)
  alone compile each graph for its first shape, again with the tokens
  symbolic, and again when a packed row's sequence count changes: 59 graphs
  where marking compiles 22 (pytorch, float32, the tests' first pass; 128 s
  down to 72 s on 2 cores). A size equal to one of the layer's parameter
  sizes is left to automatic dynamic (matching is by value), and parameters
  stay static. Sizes 0 and 1 are specialised, so the one-token dummy step and
  a one-row padded batch get graphs of their own. The warm-up runs the timed
  plan, so it compiles every variant the timed repeats meet. ``dynamic=True``
  (every size symbolic, model sizes too) fails in inductor under FSDP2 on
  torch 2.13: "Exponent must be non-negative" in a shape expression.
  ``dynamic_values`` is newer than torch 2.11 (added in 2026-05); on 2.11 (the GPU
  machine's) only the boundary tensors and the hidden states' sizes are
  marked, and the frames after a graph break compile once more for a new
  size (automatic dynamic): results.json records which (``dynamic``:
  ``plan_sizes`` or ``marked_inputs``).
- What stays eager inside a layer: the three operations whose work depends on
  where sequences start and end in a packed row (attention once per sequence,
  the boundary-aware short convolution, the delta-rule scan over chunks).
  Traced, each new set of boundaries would be a new graph; they are
  ``torch.compiler.disable``d (balance_batch/integrations/transformers/packing.py), one graph break
  each, and compiled code runs what lies between them (projections, norms,
  gating, routing, the experts).

``CompileMeter`` counts, per process, every compilation torch reports (its
callbacks), the seconds they took, and dynamo's graph breaks, so a pass can
record what compiling cost inside it (``passes.<type>.compile``) and a point
whether anything recompiled during its timed repeats.

One compiled model per process at a time: compiling a new one resets dynamo
(``torch._dynamo.reset``), so what its graphs hold is recorded afresh.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import time
from collections import Counter
from typing import Optional

import torch

from backends.model.build import decoder_layers

COMPILED_MARK = "_balance_batch_compiled"  # on each compiled layer
# Whether this torch takes sizes to make symbolic by value (torch.compiler.config.dynamic_values: not in 2.11)
NAMES_SIZES = hasattr(torch.compiler.config, "dynamic_values")
COMPILED_MODEL = "_balance_batch_compiled_model"  # on the model compile_decoder_layers was given
EAGER_FALLBACK = "_balance_batch_eager_fallback"  # on that model: a recompile-limit hit is recorded, not an error
SCOPE = "decoder_layer"
# Graphs dynamo keeps per compiled function before it gives up and runs that function eagerly, for good, without an
# error. Every decoder layer runs one code object (the layer class's forward, and each of its resume functions after
# a graph break), so its cache holds every layer's variants: grad and no grad, the first layer's frozen input, the
# size-1 dummy step, a padded baseline's rows, a guard on the layer's own attributes. Torch's defaults (8 per
# function, 256 in all on one code object) are reached by the 4-layer tiny model's variants or by 40 layers of
# 7 each; so the limits grow with the layers: VARIANTS_PER_LAYER per layer, never under RECOMPILE_LIMIT.
RECOMPILE_LIMIT = 64
VARIANTS_PER_LAYER = 16


def compile_decoder_layers(model: torch.nn.Module, eager_fallback: bool = False) -> int:
    """Compile each decoder layer's forward in place (idempotent); return how many layers are compiled.

    Works on the bare model, under peft, ``fully_shard`` and megatron-core DDP
    (the layers are found through the wrappers). Nothing is compiled until the
    first call: the warm-up pays for it. A pass in which dynamo hits its
    recompile limit (and so runs a layer eagerly) fails, naming the function,
    unless ``eager_fallback`` (``backend.compile_eager_fallback``): then the
    pass records it (``PassMeter``) and goes on.
    """
    checkpointed = [m for m in decoder_layers(model) if getattr(m, "gradient_checkpointing", False)]
    if checkpointed:
        raise ValueError("backend.compile: a layer under gradient checkpointing is not compiled (torch runs the "
                         "checkpointed layer eagerly); build the model without gradient checkpointing")
    if not compiled_layers(model):
        # A new model starts dynamo afresh: its graphs, and what they hold (kernels.traced), are its own, never
        # those of a model compiled earlier in this process (a sweep's earlier point, another dtype).
        from balance_batch.integrations.transformers import kernels

        torch._dynamo.reset()
        kernels.reset_traced()
    METER.install()  # after the reset, which drops compile callbacks
    # No equality guessed between sizes that happen to match (a row's boundaries count and a head count):
    # a guess that later fails is a recompilation in the middle of a timed pass.
    torch.fx.experimental._config.use_duck_shape = False
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"backend.compile: found no decoder layer in {type(model).__name__} to compile")
    size_recompile_limits(len(layers))
    for layer in layers:
        if getattr(layer, COMPILED_MARK, False):
            continue
        layer.forward = _compiled_forward(layer)
        setattr(layer, COMPILED_MARK, True)
        layer.register_forward_pre_hook(_count_compiled_call)
    setattr(model, COMPILED_MODEL, True)  # PassMeter: this model's passes record what compiling cost
    setattr(model, EAGER_FALLBACK, bool(eager_fallback))
    return len(layers)


def recompile_limits(layers: int) -> tuple[int, int]:
    """Dynamo's limits for ``layers`` compiled decoder layers: (per function and guard region, in all per code
    object), each at least what the process already has."""
    config = torch._dynamo.config
    per_function = max(config.recompile_limit, RECOMPILE_LIMIT, VARIANTS_PER_LAYER * layers)
    return per_function, max(config.accumulated_recompile_limit, per_function)


def size_recompile_limits(layers: int) -> None:
    torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit = recompile_limits(layers)


def _compiled_forward(layer: torch.nn.Module):
    """The layer's own forward compiled, with gradient checkpointing (when on) kept eager around it.

    Transformers puts the checkpoint inside ``forward`` (``GradientCheckpointingLayer``
    wraps each layer class's forward in ``forward_with_checkpointing``, so
    FSDP2's hooks stay outside it). Compiling that would trace the checkpoint
    itself, which cannot hold the eager boundary operations. So the function
    under those wrappers is compiled, and the same decision (checkpoint when
    enabled, training and recording gradients) is taken here, eagerly. Torch
    2.13 then runs the checkpointed function eagerly (measured: nothing
    compiles), which is why the harness refuses compile with gradient
    checkpointing; the branch keeps a layer correct if checkpointing is
    switched on after compiling.
    """
    inner = type(layer).forward
    while getattr(inner, "__name__", "") == "forward_with_checkpointing" and hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    compiled = torch.compile(inner.__get__(layer), dynamic=None)  # marked per call: see the module's docstring
    model_sizes = {0, 1} | {int(n) for p in layer.parameters() for n in p.shape}  # global shapes under FSDP2

    def forward(*args, **kwargs):
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            return layer._gradient_checkpointing_func(functools.partial(compiled, **kwargs), *args)
        with _plan_sizes_dynamic(args, kwargs, model_sizes):
            return compiled(*args, **kwargs)

    return forward


@contextlib.contextmanager
def _plan_sizes_dynamic(args, kwargs, model_sizes: set):
    """Around one compiled layer call: the sizes this call's plan chose are symbolic in whatever compiles."""
    hidden = args[0] if args else kwargs["hidden_states"]
    sizes = {int(hidden.shape[0]), int(hidden.shape[1])}  # rows, tokens per row
    for name in BOUNDARIES:
        boundaries = kwargs.get(name)
        if isinstance(boundaries, torch.Tensor):
            sizes.add(int(boundaries.shape[0]))  # sequences in the packed row, plus one
            if boundaries.shape[0] >= 2:
                torch._dynamo.maybe_mark_dynamic(boundaries, 0)
    for name in LONGEST:
        if isinstance(kwargs.get(name), int):
            sizes.add(kwargs[name])
    if not NAMES_SIZES:  # an older torch: the layer's own inputs marked, the frames after a break automatic
        for dim in (0, 1):
            if int(hidden.shape[dim]) not in model_sizes:
                torch._dynamo.maybe_mark_dynamic(hidden, dim)
        yield
        return
    config = torch.compiler.config
    before = config.dynamic_values
    config.dynamic_values = ",".join(str(n) for n in sorted(sizes - model_sizes))
    try:
        yield
    finally:
        config.dynamic_values = before


# The packed row's keyword arguments whose sizes the plan chooses (transformers' flash-attention keywords)
BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k")
LONGEST = ("max_length_q", "max_length_k")


def compiled_layers(model: torch.nn.Module) -> int:
    return sum(1 for m in model.modules() if getattr(m, COMPILED_MARK, False))


def describe(model: torch.nn.Module) -> dict:
    """``model.built.compile`` of results.json: what is compiled, and how."""
    return {
        "scope": SCOPE,
        "layers": compiled_layers(model),
        "dynamic": "plan_sizes" if NAMES_SIZES else "marked_inputs",
        "backend": "inductor",
        "mode": "default",
        "eager_inside": list(EAGER_INSIDE),
        "recompile_limit": torch._dynamo.config.recompile_limit,
        "accumulated_recompile_limit": torch._dynamo.config.accumulated_recompile_limit,
        "eager_fallback": bool(getattr(model, EAGER_FALLBACK, False)),
    }


# The operations each compiled layer runs eagerly (balance_batch/integrations/transformers/packing.py ``_eager``)
EAGER_INSIDE = ("attention", "delta_rule", "short_conv")


class RecompileLimitHit(RuntimeError):
    """Dynamo hit its recompile limit in a pass, so a compiled function ran eagerly (not allowed by the model)."""


class PassMeter:
    """Around one pass of ``model`` on one rank: what compiling cost in it; None for a model that is not compiled
    (also in a process that compiled another model before: an eager point after a compiled one in a sweep).

    A pass in which dynamo hit its recompile limit raises ``RecompileLimitHit`` on leaving, unless the model was
    compiled with ``eager_fallback``; the record counts the hits either way.
    """

    def __init__(self, model: torch.nn.Module):
        self.compiled = bool(getattr(model, COMPILED_MODEL, False))
        self.eager_fallback = bool(getattr(model, EAGER_FALLBACK, False))

    def __enter__(self) -> "PassMeter":
        self.before = measure() if self.compiled else None
        self.record: Optional[dict] = None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.before is None:
            return
        from balance_batch.integrations.transformers import kernels

        self.record = {**delta(self.before, measure()), "traced": kernels.traced()}
        if self.record["recompile_limit_hits"] and not self.eager_fallback and exc_type is None:
            hits = self.record["recompile_limit_hits"]
            raise RecompileLimitHit(
                f"backend.compile: dynamo hit its recompile limit {hits} time(s) in this pass"
                f" ({', '.join(self.record['over_recompile_limit'])}), so those calls ran eagerly and the pass "
                "would time a mix of compiled and eager layers; raise the limit (backends/model/compiling.py "
                "VARIANTS_PER_LAYER) or set backend.compile_eager_fallback=true to record the fallback and go on")


def _count_compiled_call(module, args) -> None:
    from balance_batch.integrations.transformers import kernels

    kernels.note(kernels.COMPILED_LAYER, "inductor")


_ID = re.compile(r"(\d+)/(\d+)")
# A recompilation's first failed guard, when it was about a size: a tensor's, or an int taken from one
SHAPE_GUARD = re.compile(r"size mismatch at index|: [A-Za-z_]\w* == -?\d+\b")


class CompileMeter:
    """Every compilation in this process (torch's compile callbacks) and dynamo's graph breaks, counted."""

    def __init__(self):
        self._lock = threading.Lock()
        self._installed = False
        self._limit_handler: Optional[logging.Handler] = None
        self._open: dict[tuple, float] = {}
        self.compilations = 0  # dynamo compiling a frame: the first time, or again (a recompilation)
        self.recompilations = 0  # a frame compiled again because its guards failed (a new shape, dtype, ...)
        self.backward_compilations = 0  # AOT autograd compiling a backward graph on its first backward
        # recompilations whose failed guard was a size (a shape the first graph took as static)
        self.shape_recompilations = 0
        self.compile_s = 0.0
        self._last_metrics = None  # the newest of dynamo's compilation metrics already read
        # dynamo hitting recompile_limit / accumulated_recompile_limit (its warning, read by a log handler): the
        # function then runs eagerly whenever no graph it holds fits, silently; function -> the limit it hit
        self.recompile_limit_hits = 0
        self.over_limit: dict[str, str] = {}

    def install(self) -> None:
        """Register the callbacks (again after ``torch._dynamo.reset``, which clears them)."""
        from torch._dynamo.callback import callback_handler

        with self._lock:
            if self._start not in callback_handler.start_callbacks:
                callback_handler.register_start_callback(self._start)
            if self._end not in callback_handler.end_callbacks:
                callback_handler.register_end_callback(self._end)
            if self._limit_handler is None:
                self._limit_handler = _LimitHitHandler(self._limit_hit)
                logger = logging.getLogger(LIMIT_LOGGER)
                logger.addHandler(self._limit_handler)
                if not logger.isEnabledFor(logging.WARNING):  # the hit is a warning: it must reach the handler
                    logger.setLevel(logging.WARNING)
            self._installed = True

    def _limit_hit(self, limit_type: str, function: str) -> None:
        with self._lock:
            self.recompile_limit_hits += 1
            self.over_limit[function] = limit_type

    def _read_reasons(self) -> None:
        """Count the shape recompilations among dynamo's metrics of compilations since the last read (its own list
        holds the last 64; a start callback reads it, so at most one is new each time; a ``reset`` empties it)."""
        from torch._dynamo.utils import get_compilation_metrics

        metrics = get_compilation_metrics()
        new = metrics
        for i in range(len(metrics) - 1, -1, -1):
            if metrics[i] is self._last_metrics:
                new = metrics[i + 1:]
                break
        self.shape_recompilations += sum(1 for m in new if m.recompile_reason
                                         and SHAPE_GUARD.search(m.recompile_reason))
        self._last_metrics = metrics[-1] if metrics else None

    def _start(self, args) -> None:
        with self._lock:
            self._read_reasons()
            self._open[(args.callback_trigger, args.compile_id)] = time.perf_counter()

    def _end(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger

        with self._lock:
            started = self._open.pop((args.callback_trigger, args.compile_id), None)
            if started is not None:
                self.compile_s += time.perf_counter() - started
            if args.callback_trigger == CallbackTrigger.LAZY_BACKWARD:
                self.backward_compilations += 1
                return
            self.compilations += 1
            found = _ID.search(str(args.compile_id))
            if found and int(found.group(2)) > 0:
                self.recompilations += 1

    def counters(self) -> dict:
        """The counts so far, for ``delta``."""
        from torch._dynamo.utils import counters

        breaks = dict(counters["graph_break"])
        reasons: Counter = Counter()
        for text, n in breaks.items():  # two texts may shorten to one reason: their counts add up
            reasons[_reason(text)] += int(n)
        with self._lock:
            self._read_reasons()
            return {
                "compilations": self.compilations,
                "recompilations": self.recompilations,
                "shape_recompilations": self.shape_recompilations,
                "backward_compilations": self.backward_compilations,
                "recompile_limit_hits": self.recompile_limit_hits,
                "compile_s": self.compile_s,
                "graph_breaks": sum(breaks.values()),
                "graph_break_reasons": dict(reasons),
                "over_recompile_limit": dict(self.over_limit),
            }


# Where dynamo warns "torch._dynamo hit config.<limit> (<value>)", args (limit, value, function, reason, url)
LIMIT_LOGGER = "torch._dynamo.convert_frame"
_LIMIT_HIT = "torch._dynamo hit config."


class _LimitHitHandler(logging.Handler):
    """Calls ``on_hit(limit type, function)`` for each of dynamo's recompile-limit warnings; lets every record
    through to torch's own handlers."""

    def __init__(self, on_hit):
        super().__init__(logging.WARNING)
        self.on_hit = on_hit

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith(_LIMIT_HIT):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        limit_type = str(args[0]) if args else "recompile_limit"
        function = str(args[2]) if len(args) > 2 else "unknown"
        self.on_hit(limit_type, function)


def _reason(text: str) -> str:
    """A graph break's reason in one line: dynamo's first line, and the function it skipped when it names one."""
    first = str(text).strip().splitlines()[0] if str(text).strip() else "unknown"
    skipped = re.search(r"Skip calling function `<function (\S+)", str(text))
    return f"{first}: {skipped.group(1)}" if skipped else first


# summed wherever records meet
COUNTS = ("compilations", "recompilations", "shape_recompilations", "backward_compilations", "graph_breaks",
          "recompile_limit_hits")


def delta(before: dict, after: dict) -> dict:
    """What happened between two ``counters()``: counts and seconds, graph break reasons that grew."""
    reasons = {k: n - before["graph_break_reasons"].get(k, 0) for k, n in after["graph_break_reasons"].items()}
    out = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTS}
    out["compile_s"] = round(after["compile_s"] - before["compile_s"], 4)
    out["graph_break_reasons"] = {k: n for k, n in reasons.items() if n}
    # every function over its limit so far: each runs eagerly, for good, wherever none of its graphs fits
    out["over_recompile_limit"] = sorted(after.get("over_recompile_limit") or {})
    return out


def _combined(records: list, compile_s: float) -> dict:
    """Records as one: counts and graph break reasons summed, traced implementations united, ``compile_s`` given."""
    reasons: Counter = Counter()
    traced: dict = {}
    over: set = set()
    for r in records:
        reasons.update(r.get("graph_break_reasons") or {})
        over.update(r.get("over_recompile_limit") or [])
        for op, impls in (r.get("traced") or {}).items():
            traced.setdefault(op, [])
            traced[op] += [i for i in impls if i not in traced[op]]
    out = {k: sum(r.get(k, 0) for r in records) for k in COUNTS}
    out.update(compile_s=round(compile_s, 4), graph_break_reasons=dict(reasons), traced=traced,
               over_recompile_limit=sorted(over))
    return out


def merge(records) -> Optional[dict]:
    """Several ranks' deltas (``PassMeter.record``) as one: counts and reasons summed, ``compile_s`` the slowest
    rank's (ranks compile side by side); None when no rank compiled anything."""
    records = [r for r in records if r]
    if not records:
        return None
    return {**_combined(records, max(r["compile_s"] for r in records)), "ranks": len(records)}


def add(first: Optional[dict], more: Optional[dict]) -> Optional[dict]:
    """Two passes' records (each ``merge``d over ranks) as one: counts and seconds summed."""
    if not first or not more:
        return first or more
    return {**_combined([first, more], first["compile_s"] + more["compile_s"]),
            "ranks": max(first["ranks"], more["ranks"])}


METER = CompileMeter()


def measure() -> Optional[dict]:
    """This process's counters, or None when nothing here was ever compiled (the eager path pays nothing)."""
    return METER.counters() if METER._installed else None
