"""A pass under torch.profiler: a Chrome/Perfetto trace per profiled rank, and where the time went, read back from it.

``profiled(...)`` wraps one rank's pass when the command asks for a profile
(``PassCommand.profile_dir``), on the ranks it names (``profile_ranks``, by
default rank 0 alone). It records a window of micro-batches, not the pass:
``profile_steps`` of them after the first (a fwd+bwd pass of the published
model is ~10^7 events per rank, a multi-GB trace), or the whole pass inside a
``balance_batch/pass`` range when the pass has no more steps than that (or
``profile_steps`` is 0). CPU activities (and CUDA on a GPU) and shapes are
recorded; the allocator's events only with ``profile_memory``. The trace is
written as ``<profile_dir>/<pass>-rank<r>.json.gz`` (open it in
https://ui.perfetto.dev or TensorBoard), its size recorded, then read back by
``breakdown`` in a child process of the rank that wrote it (parsing holds the
interpreter lock, which would stop the rank's heartbeat), so a job spread over
nodes needs no shared folder.

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
operators' self time plus idle) against ``pass_s`` (the profiled ranges'
duration: the pass, or the window's ``ProfilerStep#<k>`` ranges) is the check
that the trace was read whole.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

PASS_RANGE = "balance_batch/pass"
STEP_RANGE = "ProfilerStep#"  # torch.profiler's range around each step of a schedule: one micro-batch here
# By default a profile holds a few micro-batches of one rank: a whole fwd+bwd pass of the published model on every rank
# is ~10^7 events, a multi-GB trace per rank (bench.profile_steps, bench.profile_ranks)
PROFILE_STEPS = 3
PROFILE_RANKS = (0,)
RANGE_PREFIX = "balance_batch/"
CATEGORIES = ("attention", "delta_rule", "convolution", "moe_experts", "other_matmuls", "logprob_head", "backward",
              "collectives", "other", "idle")
# The ranges the model code opens (the library's packing.py, logprobs.py): their operators are theirs.
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


def profile_window(n_steps: int, steps: int) -> Optional[tuple[int, int]]:
    """The micro-batches a pass of ``n_steps`` profiles, as (first, count): ``steps`` of them after the first (the
    first step is the profiler's warm-up, whose start-up would skew it); None: the whole pass (``steps`` 0, or a
    pass with no more steps than that)."""
    if steps <= 0 or n_steps <= steps:
        return None
    return 1, steps


class Profiled(dict):
    """What ``profiled`` yields: empty until the block ends, then this rank's record (``trace``, ``breakdown``, what
    was profiled, the trace's size). ``step()`` marks where a micro-batch ends."""

    def __init__(self):
        super().__init__()
        self._prof = None

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()


def _window_schedule(first: int, count: int):
    """torch.profiler's actions for micro-batch ``k`` (the profiler's step number): warm up on the one before the
    window, record the window, save at its end, nothing elsewhere."""
    from torch.profiler import ProfilerAction

    def action(k: int):
        if k == first - 1:
            return ProfilerAction.WARMUP
        if first <= k < first + count - 1:
            return ProfilerAction.RECORD
        if k == first + count - 1:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    return action


@contextlib.contextmanager
def profiled(profile_dir: Optional[str], pass_type: str, rank: int, device, n_steps: int = 0,
             steps: int = PROFILE_STEPS, ranks: Optional[Sequence[int]] = PROFILE_RANKS,
             memory: bool = False) -> Iterator[Profiled]:
    """Profile the block when ``profile_dir`` is set and ``rank`` is one of ``ranks`` (None: every rank).

    ``n_steps`` is the rank's micro-batch count: the profiler records ``steps`` of them (``profile_window``; the
    block calls ``step()`` after each micro-batch), or the whole block inside a ``balance_batch/pass`` range.
    ``memory`` records the allocator's events too (``profile_memory``: many more events). Afterwards the yielded
    dict holds ``trace``, ``breakdown`` (read in a child process: see ``breakdown_apart``), ``steps`` (the first
    and last micro-batch profiled), ``trace_bytes``, ``events`` and ``memory``.
    """
    out = Profiled()
    if not profile_dir or (ranks is not None and rank not in ranks):
        yield out
        return
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if getattr(device, "type", None) == "cuda":
        activities.append(ProfilerActivity.CUDA)
    window = profile_window(n_steps, steps)
    schedule = _window_schedule(*window) if window else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ww]armup.*")
        prof = profile(activities=activities, schedule=schedule, record_shapes=True, profile_memory=memory)
    with prof:
        if window:
            out._prof = prof
            try:
                yield out
            finally:
                out._prof = None
        else:
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
    out["steps"] = [window[0], window[0] + window[1] - 1] if window else [0, max(0, n_steps - 1)]
    out["memory"] = bool(memory)
    out["trace_bytes"] = path.stat().st_size
    out["breakdown"] = breakdown_apart(path)
    out["events"] = out["breakdown"].pop("events")


def breakdown_apart(path, timeout_s: float = 1800.0) -> dict:
    """``breakdown(read_trace(path))`` computed in a child Python process, with ``events`` (the complete events read).

    Reading a trace holds the interpreter lock for as long as the JSON takes to parse; in the rank's own process
    that would stop its heartbeat thread, and its peers would give it up. The rank waits for the child instead
    (the lock released), and the child's memory goes back when it ends.
    """
    root = str(Path(__file__).resolve().parents[2])
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from backends.runtime.profiling import breakdown, read_trace; "
            "t = read_trace(sys.argv[2]); b = breakdown(t); "
            "b['events'] = sum(1 for e in t.get('traceEvents', []) if e.get('ph') == 'X'); print(json.dumps(b))")
    done = subprocess.run([sys.executable, "-c", code, root, str(path)], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"reading the profile {path}: {last}")
    return json.loads(done.stdout)


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
    """Where the profiled time went on the thread that ran it (see the module's docstring).

    The profiled time is the ``balance_batch/pass`` range (a whole pass), else every ``ProfilerStep#<k>`` range (the
    micro-batches a window recorded), summed. Returns ``pass_s``, ``covered_s``, ``seconds`` and ``shares`` per
    category (shares sum to 1), and the ``top_ops`` by self time (name, category, self seconds, calls).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    passes = [e for e in events if e.get("name") == PASS_RANGE]
    regions = [max(passes, key=lambda e: e["dur"])] if passes else [
        e for e in events if str(e.get("name", "")).startswith(STEP_RANGE)]
    if not regions:
        raise ValueError(f"no '{PASS_RANGE}' range (nor '{STEP_RANGE}<k>' ones) in the trace: not a pass profiled by "
                         "this harness")
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[tuple[str, str], list] = {}
    pass_s = 0.0
    for region in regions:
        pass_s += region["dur"] / 1e6
        seconds["idle"] += _read_region(events, region, seconds, per_op)
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


def _read_region(events: list, region: dict, seconds: dict, per_op: dict) -> float:
    """Adds the self time of every operator inside ``region`` (on its thread) to ``seconds`` and ``per_op``; returns
    the region's idle seconds (no operator covers them)."""
    start, end, tid, pid = region["ts"], region["ts"] + region["dur"], region.get("tid"), region.get("pid")
    # The region's thread, inside the range, outermost first (a parent starts no later and lasts no shorter).
    mine = sorted((e for e in events if e.get("tid") == tid and e.get("pid") == pid and e is not region
                   and e["ts"] >= start and e["ts"] + e["dur"] <= end + 1e-3),
                  key=lambda e: (e["ts"], -e["dur"]))
    stack: list[dict] = []  # enclosing events of the one being read
    child_time: list[float] = []  # per stack entry, its children's total duration
    top_level = 0.0  # time covered by operators directly under the region

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
    return max(0.0, (region["dur"] - top_level) / 1e6)
