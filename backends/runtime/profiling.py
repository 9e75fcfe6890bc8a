"""A pass under torch.profiler: a Chrome/Perfetto trace per rank, and where the pass's time went, read back from it.

``profiled(command, rank, device)`` wraps one rank's pass when the command asks
for a profile (``PassCommand.profile_dir``): CPU activities (and CUDA on a GPU),
shapes and memory recorded, the pass inside a ``balance_batch/pass`` range. The
trace is written as ``<profile_dir>/<pass>-rank<r>.json.gz`` (open it in
https://ui.perfetto.dev or TensorBoard), then read back by ``breakdown`` on the
rank that wrote it, so a job spread over nodes needs no shared folder.

The breakdown is the pass's host timeline on the thread that ran it: every
operator's self time (its duration less its children's) goes to one category,
and the time no operator covers is ``idle`` (Python between operators, waiting
outside any operator). The categories, first match wins:

- ``collectives``: all-gather, reduce-scatter, all-reduce, broadcast, their waits (c10d, gloo, NCCL), and FSDP2's
  ``FSDP::`` ranges around them (unshard, reshard, the post-backward reduce);
- ``backward``: anything under autograd's backward (the pass has no optimizer step);
- ``delta_rule``, ``logprob_head``: inside this project's ranges (``balance_batch/delta_rule``, ...);
- ``attention``: SDPA and flash attention; ``convolution``: the short convolutions;
- ``moe_experts``: the experts' grouped GEMMs; ``other_matmuls``: every other matrix product;
- ``other``: every other operator (norms, elementwise, routing, copies).

The shares sum to 1 by construction of the timeline; ``covered_s`` (the
operators' self time plus idle) against ``pass_s`` (the range's duration) is
the check that the trace was read whole.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from pathlib import Path
from typing import Iterator, Optional

PASS_RANGE = "balance_batch/pass"
RANGE_PREFIX = "balance_batch/"
CATEGORIES = ("attention", "delta_rule", "convolution", "moe_experts", "other_matmuls", "logprob_head", "backward",
              "collectives", "other", "idle")
# The ranges the model code opens (backends/model/packing.py, logprobs.py): their operators are theirs.
RANGES = ("delta_rule", "logprob_head")
_COLLECTIVE = ("all_gather", "allgather", "reduce_scatter", "reducescatter", "all_reduce", "allreduce", "broadcast",
               "c10d::", "gloo", "nccl", "record_param_comms", "wait_tensor", "barrier",
               # FSDP2's ranges: unshard (all-gather and its wait, copy-out), reshard, post-backward reduce-scatter
               "fsdp::")
_ATTENTION = ("scaled_dot_product", "flash_attn", "flash_attention", "_efficient_attention", "_cudnn_attention")
_CONVOLUTION = ("conv1d", "convolution", "causal_conv1d")
_EXPERTS = ("_grouped_mm", "grouped_mm")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm", "aten::einsum",
           "aten::addbmm", "aten::_addmm_activation")
BACKWARD = "autograd::engine::evaluate_function"
TOP_OPS = 12


def trace_path(profile_dir: str, pass_type: str, rank: int) -> Path:
    return Path(profile_dir) / f"{pass_type}-rank{rank}.json.gz"


@contextlib.contextmanager
def profiled(profile_dir: Optional[str], pass_type: str, rank: int, device) -> Iterator[dict]:
    """Profile the block when ``profile_dir`` is set; afterwards the yielded dict holds ``trace`` and ``breakdown``."""
    out: dict = {}
    if not profile_dir:
        yield out
        return
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if getattr(device, "type", None) == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
        with record_function(PASS_RANGE):
            yield out
        if getattr(device, "type", None) == "cuda":
            torch.cuda.synchronize(device)
    path = trace_path(profile_dir, pass_type, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.json.gz")  # export_chrome_trace gzips by the suffix
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, path)
    out["trace"] = str(path)
    out["breakdown"] = breakdown(read_trace(path))


def read_trace(path) -> dict:
    """A Chrome trace as torch.profiler writes it (gzipped by its suffix, or plain JSON)."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        return json.load(f)


def category(name: str, stack: list[str]) -> str:
    """The category of an operator ``name`` whose enclosing events (outermost first) are ``stack``."""
    low = name.lower()
    lows = [s.lower() for s in stack]
    if any(c in s for s in (*lows, low) for c in _COLLECTIVE):
        return "collectives"
    if any(s.startswith(BACKWARD) for s in (*stack, name)):
        return "backward"
    for s in reversed((*stack, name)):  # the innermost of this project's ranges
        if s.startswith(RANGE_PREFIX) and s[len(RANGE_PREFIX):] in RANGES:
            return s[len(RANGE_PREFIX):]
    if any(c in low for c in _ATTENTION):
        return "attention"
    if any(c in low for c in _CONVOLUTION):
        return "convolution"
    if any(c in low for c in _EXPERTS):
        return "moe_experts"
    if low in _MATMUL:
        return "other_matmuls"
    return "other"


def breakdown(trace: dict, top: int = TOP_OPS) -> dict:
    """Where the profiled pass's time went on the thread that ran it (see the module's docstring).

    Returns ``pass_s``, ``covered_s``, ``seconds`` and ``shares`` per category (shares sum to 1), and the
    ``top_ops`` by self time (name, category, self seconds, calls).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    passes = [e for e in events if e.get("name") == PASS_RANGE]
    if not passes:
        raise ValueError(f"no '{PASS_RANGE}' range in the trace: not a pass profiled by this harness")
    region = max(passes, key=lambda e: e["dur"])
    start, end, tid, pid = region["ts"], region["ts"] + region["dur"], region.get("tid"), region.get("pid")
    # The pass's thread, inside the range, outermost first (a parent starts no later and lasts no shorter).
    mine = sorted((e for e in events if e.get("tid") == tid and e.get("pid") == pid and e is not region
                   and e["ts"] >= start and e["ts"] + e["dur"] <= end + 1e-3),
                  key=lambda e: (e["ts"], -e["dur"]))
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[tuple[str, str], list] = {}
    stack: list[dict] = []  # enclosing events of the one being read
    child_time: list[float] = []  # per stack entry, its children's total duration
    top_level = 0.0  # time covered by operators directly under the pass range

    def close(e: dict, children: float, names: list[str]) -> None:
        # a range's own time is its Python between operators: the range's category (delta_rule's own scan loop)
        own = max(0.0, e["dur"] - children)
        name = e["name"]
        cat = category(name, names)
        seconds[cat] += own / 1e6
        entry = per_op.setdefault((name, cat), [0.0, 0])
        entry[0] += own / 1e6
        entry[1] += 1

    for e in mine:
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1e-3:
            done = stack.pop()
            close(done, child_time.pop(), [s["name"] for s in stack])
        if stack:
            child_time[-1] += e["dur"]
        else:
            top_level += e["dur"]
        stack.append(e)
        child_time.append(0.0)
    while stack:
        done = stack.pop()
        close(done, child_time.pop(), [s["name"] for s in stack])
    pass_s = region["dur"] / 1e6
    seconds["idle"] = max(0.0, pass_s - top_level / 1e6)
    covered = sum(seconds.values())
    shares = {k: (v / covered if covered > 0 else 0.0) for k, v in seconds.items()}
    ops = sorted(((n, c, s, k) for (n, c), (s, k) in per_op.items()), key=lambda t: -t[2])[:top]
    return {
        "pass_s": pass_s,
        "covered_s": covered,
        "seconds": seconds,
        "shares": shares,
        "top_ops": [{"name": n, "category": c, "self_s": s, "calls": k} for n, c, s, k in ops],
    }
