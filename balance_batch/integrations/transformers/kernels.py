"""Which implementation ran for each kernel-backed operation, counted as the model runs, and which kernels a device
lacks.

Five operations of the benchmark model have a fast CUDA kernel and a torch
fallback: full attention, the gated delta rule, the short causal convolution,
the MoE experts and the log-prob head. The functions that dispatch them
(packing.py and segments.py beside this module, the harness's backends/model/logprobs.py) call
``note(op, implementation)`` each time they run, and what the model dispatches itself
(the MoE experts, flash attention) is recorded by hooks installed here
(``record_dispatched_kernels``), so a pass records what actually ran, not what imported.
``reset`` before a pass and ``snapshot`` after it give ``{op: {implementation:
calls}}`` for results.json (``passes.<type>.kernels``); a call is one forward
call of one layer (recomputation under gradient checkpointing counts again).

Under the harness's ``backend.compile=true`` (backends/model/compiling.py) an operation
inside a compiled graph is not called from Python when the graph runs, so it
cannot be counted per call: what dynamo traced into a graph is recorded once,
at trace time (``traced()``: ``{op: [implementations]}``), and each call of a
compiled layer counts as ``compiled_layer: {inductor: calls}``. The operations
kept eager inside a layer (attention, the delta rule, the short convolution)
are counted per call as before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import threading
from collections import Counter
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

OPS = ("attention", "delta_rule", "short_conv", "moe_experts", "logprob_head")
COMPILED_LAYER = "compiled_layer"  # one call of a compiled decoder layer (backend.compile=true)

# Implementation names, as results.json spells them.
FLASH_ATTN = "flash-attn"  # Hugging Face's flash_attention_2 (padded rows; packed rows through its varlen path)
SDPA = "sdpa"  # torch scaled_dot_product_attention over a padded batch with its mask
PER_SEQUENCE = "-per-sequence"  # after the implementation: a packed row, the layer's own attention once per sequence
SDPA_PER_SEQUENCE = "sdpa" + PER_SEQUENCE  # a packed row: SDPA once per sequence, no (row length)² mask
EAGER = "eager"
FLA_CHUNK = "fla-chunk"  # flash-linear-attention's chunked gated delta rule (Triton)
SEGMENT_SCAN = "segment-scan"  # this project's batched torch scan (segments.py beside this), padded and packed alike
TRANSFORMERS_TORCH_CHUNK = "transformers-torch-chunk"  # transformers' own torch fallback (only with a recurrent state)
CAUSAL_CONV1D = "causal-conv1d"
TORCH_CONV1D = "torch-conv1d"
GROUPED_MM = "grouped_mm"  # torch's grouped GEMM over all experts at once
# transformers' fallback when torch's grouped_mm cannot run: one mm per expert
GROUPED_MM_LOOP = "grouped_mm-fallback-loop"

# Set on each function this project swaps into a transformers module (packing.py beside this module, and the
# grouped GEMM below); its value is the function replaced, which is how tests/loss_oracle.py puts the stock ones back.
SWAPPED_MARK = "_balance_batch_packed"

_lock = threading.Lock()
_calls: Counter = Counter()
_traced: set = set()  # (op, implementation) dynamo traced into a compiled graph, in this process


def note(op: str, implementation: str) -> None:
    """Count one call of ``op`` run by ``implementation`` in this process (traced into a graph: recorded once)."""
    if torch.compiler.is_compiling():
        # Runs while dynamo traces, not when the graph runs, and adds nothing to the graph (no guard, no break).
        from torch._dynamo.comptime import comptime

        comptime(lambda ctx: _note_traced(ctx.get_local("op").as_python_constant(),
                                          ctx.get_local("implementation").as_python_constant()))
        return
    with _lock:
        _calls[(op, implementation)] += 1


def _note_traced(op: str, implementation: str) -> None:
    with _lock:
        _traced.add((op, implementation))


def reset_traced() -> None:
    """Forget what was traced (backends/model/compiling.py: a new model starts dynamo afresh)."""
    with _lock:
        _traced.clear()


def traced() -> dict[str, list[str]]:
    """What dynamo traced into compiled graphs so far in this process: ``{op: [implementations]}``."""
    with _lock:
        pairs = sorted(_traced)
    return {op: [impl for o, impl in pairs if o == op] for op in dict.fromkeys(o for o, _ in pairs)}


def span(op: str):
    """A profiler range ``balance_batch/<op>`` around an operation (a no-op unless torch.profiler is recording):
    a profiled pass's breakdown counts what runs inside it as ``op`` (backends/runtime/profiling.py)."""
    if not torch.autograd._profiler_enabled():  # no range to open: the timed passes pay nothing
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"balance_batch/{op}")


def reset() -> None:
    with _lock:
        _calls.clear()


def _by_op(calls: Mapping) -> dict[str, dict[str, int]]:
    """``{(op, implementation): calls}`` as ``{op: {implementation: calls}}``, ops in ``OPS`` order, then any others."""
    out: dict[str, dict[str, int]] = {}
    for op in (*OPS, COMPILED_LAYER, *sorted({o for o, _ in calls} - {*OPS, COMPILED_LAYER})):
        impls = {impl: int(n) for (o, impl), n in sorted(calls.items()) if o == op}
        if impls:
            out[op] = impls
    return out


def snapshot() -> dict[str, dict[str, int]]:
    """What ran since the last ``reset``: ``{op: {implementation: calls}}``."""
    with _lock:
        return _by_op(dict(_calls))


def merge(records: Iterable[Optional[Mapping[str, Mapping[str, int]]]]) -> dict[str, dict[str, int]]:
    """Several ranks' snapshots as one: calls summed per op and implementation."""
    total: Counter = Counter()
    for record in records:
        for op, impls in (record or {}).items():
            for impl, n in impls.items():
                total[(op, impl)] += int(n)
    return _by_op(total)


def summary(record: Optional[Mapping[str, Mapping[str, int]]]) -> str:
    """One line for the log: ``attention=sdpa-per-sequence, delta_rule=segment-scan, ...``."""
    if not record:
        return "none recorded"
    return ", ".join(f"{op}={'+'.join(impls)}" for op, impls in record.items())


# ---------------------------------------------------------------------------- what the model dispatches itself

_HOOKED = "_balance_batch_kernel_hook"


def _record_flash_attention(module, args, kwargs) -> None:
    varlen = kwargs.get("cu_seq_lens_q") is not None
    note("attention", FLASH_ATTN + ("-varlen" if varlen else ""))


def _record_experts(module, args) -> None:
    implementation = getattr(module.config, "_experts_implementation", None) or "eager"
    if implementation != "grouped_mm":  # grouped_mm is recorded per call by _grouped_mm (it may fall back)
        note("moe_experts", implementation + ("-loop" if implementation == "eager" else ""))


def _patch_grouped_mm() -> None:
    """Record each grouped GEMM of the MoE experts as torch's grouped_mm or transformers' per-expert fallback."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return
    current = getattr(moe, "_grouped_mm", None)
    check = getattr(moe, "_can_use_grouped_mm", None)
    if current is None or check is None or hasattr(current, SWAPPED_MARK):
        return

    @functools.wraps(current)
    def _grouped_mm(input, weight, offs, *args, **kwargs):
        note("moe_experts", GROUPED_MM if check(input, weight, offs) else GROUPED_MM_LOOP)
        return current(input, weight, offs, *args, **kwargs)

    setattr(_grouped_mm, SWAPPED_MARK, current)
    moe._grouped_mm = _grouped_mm


def record_dispatched_kernels(modules: Sequence[torch.nn.Module]) -> None:
    """Record the MoE experts' implementation and flash attention, which the model dispatches itself (no function of
    ours runs them to call ``note``): forward pre-hooks on those modules, and a wrapper on transformers' grouped GEMM.
    Idempotent."""
    _patch_grouped_mm()
    for module in modules:
        if getattr(module, _HOOKED, False):
            continue
        config = getattr(module, "config", None)
        name = type(module).__name__
        if name.endswith("Experts") and hasattr(config, "_experts_implementation"):
            module.register_forward_pre_hook(_record_experts)
        elif (name.endswith("Attention") and hasattr(module, "q_proj")
              and str(getattr(config, "_attn_implementation", "")).startswith("flash_attention")):
            module.register_forward_pre_hook(_record_flash_attention, with_kwargs=True)
        else:
            continue
        setattr(module, _HOOKED, True)


# ---------------------------------------------------------------------------- what the device offers


@functools.lru_cache(maxsize=None)
def package_imports(name: str) -> bool:
    """Whether a kernel package (flash_attn, fla, causal_conv1d) imports here; decided once per process."""
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a broken build is the same as none: the torch path is exact, only slower
        return False
    return True


def transformers_bound_kernel(function: Callable) -> Optional[bool]:
    """What transformers' kernel wrapper around ``function`` bound when its modeling module was imported: True, a
    kernel package's function (fla, causal-conv1d), which it then runs; False, its own torch function, which it runs
    whatever imports later; None, ``function`` is no such wrapper (``package_imports`` decides).

    The wrapper (``use_kernel_func_from_hub_with_fallback``) keeps the choice in its closure: a package that imports
    here but that transformers could not use at its import is not a kernel that ran.
    """
    try:
        bound = inspect.getclosurevars(function).nonlocals.get("is_new_implementation")
    except (TypeError, ValueError):
        return None
    return bound if isinstance(bound, bool) else None


# (import name, pip distribution, op it serves, what its absence costs on a GPU)
CUDA_KERNELS = (
    ("flash_attn", "flash-attn", "attention",
     "full attention runs SDPA (padded rows with a mask, packed rows one sequence at a time) instead of flash-attn"),
    ("fla", "flash-linear-attention", "delta_rule",
     "the gated delta rule runs this project's torch scan, several times slower than fla's Triton kernel"),
    ("causal_conv1d", "causal-conv1d", "short_conv",
     "the short convolution runs torch's depthwise conv1d instead of the fused kernel"),
)


def missing_cuda_kernels(available: Callable[[str], bool] = package_imports) -> list[tuple[str, str, str]]:
    """(distribution, op, cost) of each CUDA kernel package that does not import (``available`` decides)."""
    return [(dist, op, cost) for name, dist, op, cost in CUDA_KERNELS if not available(name)]


class MissingKernels(RuntimeError):
    """backend.require_kernels=true and a CUDA kernel package does not import."""


def check_cuda_kernels(device_type: str, require: bool, log: Optional[logging.Logger] = None,
                       available: Callable[[str], bool] = package_imports) -> list[str]:
    """Before loading: on CUDA, one warning line per missing kernel package (an error with ``require``).

    Returns the warning lines. On CPU nothing is missing: the torch paths are
    the ones a CPU runs, and CPU tensors never reach a Triton or CUDA kernel.
    """
    if device_type != "cuda":
        return []
    lines = [
        f"{dist} does not import: {cost} (pip install {dist})" for dist, _, cost in missing_cuda_kernels(available)
    ]
    if lines and require:
        raise MissingKernels("backend.require_kernels=true: " + "; ".join(lines))
    for line in lines:
        (log or logging.getLogger(__name__)).warning("%s", line)
    return lines


def attention_implementation(requested: Optional[str], device_type: str, half_precision: bool,
                             available: Callable[[str], bool] = package_imports) -> str:
    """The attention implementation both layouts use: ``requested``, else flash-attn where it can run, else SDPA.

    flash-attn serves padded rows and packed rows alike (Hugging Face passes a
    packed row's ``cu_seq_lens`` to its varlen kernel), so neither layout gets
    a faster attention than the other.
    """
    if requested:
        return requested
    if device_type == "cuda" and half_precision and available("flash_attn"):
        return "flash_attention_2"
    return "sdpa"
