"""Check every GPU feature on one machine in about five minutes: agreement, layouts, profile, snapshot, auto, compile.

    python scripts/gpu_check.py --plan --device cuda      # what it will run, with each step's estimated seconds
    python scripts/gpu_check.py --out DIR                 # on a GPU machine (--budget-s 300 by default)
    python scripts/gpu_check.py --out DIR --device cpu    # the same checks on CPU ranks, where they have a CPU form
    python scripts/gpu_check.py --out DIR --model-path /models/Qwen3.5-35B-A3B   # the 35B variant (a node, ~15 min)

Each step is one ``python -m harness -m`` launch with ``hot=true``: its points share a loaded backend wherever
they load the same thing (points that differ in bench.*, the layout or the budget switch through the control
file), no mbs=1 baselines are added (``bench.baseline=false``), nothing is paired (``bench.paired=false``), no
sweep report is drawn, and every point runs one timed repeat of the smoke workload after one warm-up (on a GPU; none
on CPU, where nothing compiles). A point's
own settings are a generated config file (``DIR/conf/gpu_check/<step>.<point>.yaml``), so one launch holds points
that differ in several keys at once. fla's Triton kernels are compiled once per dtype and layout: the compiled
kernels stay in Triton's disk cache for the later launches, and so do the autotuning's choices
(``FLA_CACHE_RESULTS=1``, ``TRITON_CACHE_AUTOTUNING=1``).

The steps run in order of value (the published bf16 first, then the features only a GPU shows, then float32 and
compile). Before each step its estimate, times the ratio of measured to estimated seconds of the steps run so far,
is held against what is left of ``--budget-s``: a step that does not fit runs shortened (its last loads and their
points left out) or is skipped, its reason written; a step that runs past its cap or past the budget is stopped
with its whole process group (the harness, its fork server and every rank), and its finished points still count.
``summary.json``'s ``timing`` records each step's measured seconds beside its estimate: ``--estimates-from`` that
file plans the next run with them.

Everything needed to judge the run is in ``DIR/summary.json``, at the top of the folder (nested files may not come
back from a remote machine), rewritten after every step: the environment, the plan with its estimates, per step its
status, wall seconds, the comparisons with their figures and tolerances, the feature checks with theirs, and per
point its status, error, what it ran (backend, layout, dtype, ranks, device), throughput, peak memory, the kernels
each pass recorded and the precision; then what was covered and what was not. With ``--back OUT`` (gpu_check.sh's
``$OUT``) everything is written under ``--out`` and, after every step, at most 8 files are copied to OUT: the
summary, the logs, the points' results and configs in one small archive, the caches and traces in another.
SIGTERM, SIGINT or SIGHUP stops the running launch's process group within seconds, records the cut in the summary,
copies what finished, and exits 128 + the signal's number. Exits 1 if a check fails or nothing could run, 0 when
every step that ran passed (steps skipped for want of time are listed, not failed), 2 on a bad argument.

With one GPU the harness runs one rank per GPU, so the GPU runs exercise no collective; two ranks cannot share the
GPU (NCCL refuses two ranks on one device). The multi-rank path (gloo collectives, FSDP2 sharding, megatron-core's
gradient sync) then runs on 2 CPU ranks on the same host, compared with the GPU's single rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as python scripts/gpu_check.py
    sys.path.insert(0, str(REPO))

from backends.registry import BACKENDS  # noqa: E402

# The backends by the part each plays here, read from the registry: the one-process reference every backend is
# compared with, the lock-step (sharded) backend the features run on, and the distributed ones.
ALL = [b.name for b in BACKENDS]
REFERENCE = next(b.name for b in BACKENDS if not b.distributed)
SHARDED = next(b.name for b in BACKENDS if b.distributed and b.lockstep)
DISTRIBUTED = [b.name for b in BACKENDS if b.distributed]

KERNEL_MODULES = ("fla", "flash_attn", "causal_conv1d")  # the fast paths' packages, by import name
DEFAULT_BUDGET_S = 300.0  # five minutes of a 15-minute device session: start-up and a rerun fit beside it
BIG_MODEL_BUDGET_S = 1500.0
CPU_BUDGET_S = 600.0  # no device time to save on CPU: room for a machine shared with other runs
SUMMARY = "summary.json"
LOG = "gpu_check.log"
KERNELS_LOG = "kernels.log"  # gpu_check.sh's kernel builds
RESULTS_TAR = "gpu_check_results.tar.gz"  # the points' results.json and configs: small, read after the summary
REST_TAR = "gpu_check_rest.tar.gz"  # everything else under --out: traces, Triton's and inductor's caches
MAX_FILES = 8  # what comes back from a lent machine, none in a folder
GROUP = "gpu_check"  # the config group of the generated point files
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE_S = 3.0  # SIGTERM to a launch's process group (the harness records the point it interrupts), then SIGKILL

# Tolerances, per comparison kind (relative, on per-example fwd+bwd losses; the gradient norm where judged).
# - same kernels, float32: the same math in the same order up to reductions.
# - float32 on CUDA across kernels: fla's Triton kernels multiply in TF32 (10-bit mantissa, ~5e-4 per product)
#   even for float32 inputs, and padded rows and packed rows (cu_seqlens) run different blockings of them. float32
#   experts on CUDA call torch's grouped_mm (transformers 5.24 does not check the dtype there; the kernel record
#   says grouped_mm), which runs its fused kernel for bf16 only and float32 through its own fallback: one mm per
#   expert after a host read of the offsets (aten's GroupedBlas.cpp). CPU ranks run the torch paths in full float32.
# - bf16: rounds differently per layout, per kernel and per backend's precision policy.
RTOL = {
    ("cpu", "float32", "same"): 1e-4,
    ("cpu", "float32", "across"): 1e-4,
    ("cuda", "float32", "same"): 1e-3,
    ("cuda", "float32", "across"): 1e-2,
    ("cpu", "bfloat16", "same"): 3e-2,
    ("cpu", "bfloat16", "across"): 3e-2,
    ("cuda", "bfloat16", "same"): 3e-2,
    ("cuda", "bfloat16", "across"): 3e-2,
}
BF16_RTOL = 3e-2

# Seconds each part of a step costs, per device kind: the estimates --plan adds up and --budget-s spends.
# "cpu": measured on the 2-core development machine (docs/gpus.md says when); "cuda": reasoned for one H200 from
# what each part does (no GPU has run this yet): until one measures them they are estimates, and the summary
# records each step's wall seconds beside its estimate so the next run can replace them.
COSTS = {
    "cpu": {"launch": 9.0, "load": 12.0, "load_inproc": 4.0, "point": 4.0, "triton": 0.0, "profile": 6.0,
            "calibrate": 12.0, "auto": 20.0, "compile": 60.0, "oom": 0.0, "cpu_load": 12.0, "cpu_point": 4.0},
    # launch: python, torch, transformers, Hydra and the harness imported, the config composed (~6 s on a
    # 16-core host); load: one spawned rank importing torch, transformers and fla, a CUDA context and a one-rank
    # NCCL group, the tiny model built (~12 s); a point: a warm-up and a timed repeat of fwd and fwd+bwd of 16
    # short examples on a 4-layer model (~2 s, launches dominate); triton: fla's chunked delta-rule kernels
    # compiled and autotuned for one dtype and one layout (varlen or not): ~20 s, the largest unknown;
    # compile: torch.compile of 4 decoder layers, dynamic shapes, forward and backward graphs (~40 s).
    # triton: fla's chunked gated delta rule and short convolution, forward and backward, compiled and autotuned
    # for one dtype and one layout: 60 s, sourced, not measured here: one chunk-mode forward of fla's gated linear
    # attention took 22 s on its first call (compile and autotune, fla-org/flash-linear-attention#458, a V100);
    # the backward has about as many kernels again, the convolution a few more. Paid once per (dtype, layout) and
    # machine: the kernels and the autotuning's choices stay in TRITON_CACHE_DIR (gpu_check.sh keeps it in its
    # tarball), so a later run that starts from that cache pays nearly nothing.
    "cuda": {"launch": 6.0, "load": 12.0, "load_inproc": 3.0, "point": 2.0, "triton": 60.0, "profile": 5.0,
             "calibrate": 10.0, "auto": 15.0, "compile": 40.0, "oom": 3.0, "cpu_load": 8.0, "cpu_point": 3.0},
    # The 35B variant (one node, the checkpoint on local disk, gradient checkpointing, the smoke workload): a
    # load reads ~67 GB once and broadcasts it (FSDP2) or reads it on every GPU (Megatron DDP), ~120 s; a point
    # of 16 short examples through 40 layers ~15 s; compile of 40 layers ~150 s.
    "cuda-35b": {"launch": 8.0, "load": 120.0, "load_inproc": 120.0, "point": 15.0, "triton": 20.0, "profile": 30.0,
                 "calibrate": 60.0, "auto": 120.0, "compile": 150.0, "oom": 10.0, "cpu_load": 0.0,
                 "cpu_point": 0.0},
}


@dataclass(frozen=True)
class Point:
    """One point of a step: its name and its settings (group choices like ``backend: fsdp2`` and dotted keys)."""

    name: str
    settings: dict
    load: str  # what it loads: points with equal ``load`` share one loaded backend (hot)
    extra: tuple = ()  # cost parts besides a point (profile, calibrate, auto, compile, oom)


@dataclass
class Step:
    """One launch: its points, the comparisons and feature checks that judge them, what it covers."""

    name: str
    covers: list[str]
    points: list[Point]
    # (run, ref, "same" or "across"), each a point's name (<step>.<point>), possibly of an earlier step
    comparisons: list[tuple[str, str, str]] = field(default_factory=list)
    features: dict[str, Callable[[dict, Path], dict]] = field(default_factory=dict)  # point -> judge
    cpu_form: bool = True
    why_not_on_cpu: str = ""
    # In the default run on GPUs (the tiny model): a step left out runs when --only names it (a second run)
    gpu_default: bool = True

    def kernels(self) -> set:
        """The (dtype, layout) pairs whose fla Triton kernels its GPU points run (compiled on first use)."""
        return {(p.settings.get("model.dtype"), p.settings.get("layout", "packed")) for p in self.points
                if "cpu" not in p.load.split("/")}

    def cost(self, costs: dict, loads_before: set) -> dict:
        """The estimate's parts: a launch, each new load, each point and each extra (seconds)."""
        parts = {"launch": costs["launch"]}
        loads = []
        for p in self.points:
            if p.load not in loads:
                loads.append(p.load)
        for load in loads:
            where = load.split("/")
            kind = "load_inproc" if where[0] == REFERENCE else "cpu_load" if "cpu" in where else "load"
            parts[kind] = parts.get(kind, 0.0) + costs[kind]
        for p in self.points:
            kind = "cpu_point" if "cpu" in p.load.split("/") else "point"
            parts[kind] = parts.get(kind, 0.0) + costs[kind]
            for extra in p.extra:
                parts[extra] = parts.get(extra, 0.0) + costs[extra]
        fresh = self.kernels() - loads_before
        if fresh and costs["triton"]:
            parts["triton"] = costs["triton"] * len(fresh)
        return parts


# ---------------------------------------------------------------------------------------------------------------
# Reading results


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def point_name(folder: Path) -> Optional[str]:
    """The point a sweep folder ran: its ``+gpu_check=<step>.<point>`` override, as Hydra recorded it."""
    overrides = folder / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return None
    for line in overrides.read_text().splitlines():
        line = line.strip().lstrip("-").strip().strip("'\"")
        if line.startswith(f"+{GROUP}="):
            return line.split("=", 1)[1]
    return None


def runs_in(sweep: Path) -> dict[str, dict]:
    """Each finished point of a step's sweep by its name, with its folder and its per-example outputs."""
    runs = {}
    for res_file in sorted(sweep.glob("*/results.json")):
        name = point_name(res_file.parent)
        if name is None:
            continue
        res = load(res_file)
        out_file = res_file.parent / "example_outputs.json"
        res["_outputs"] = load(out_file) if out_file.exists() else None
        res["_dir"] = str(res_file.parent)
        runs[name] = res
    return runs


def dtype_of(run: dict) -> Optional[str]:
    return ((run.get("model") or {}).get("built") or {}).get("dtype") or (run.get("model") or {}).get("dtype")


def layout_of(run: dict) -> str:
    """The run's layout: results.json's top-level ``layout`` (there for a failed run too), else its plan's."""
    return run.get("layout") or (run.get("plan") or {}).get("layout") or "padded"


def what_ran(run: dict) -> dict:
    """The kernels each pass ran ({op: {implementation: calls}}) and the run's precision, when results.json has them."""
    kernels = {pass_type: p["kernels"] for pass_type, p in (run.get("passes") or {}).items()
               if isinstance(p, dict) and p.get("kernels") is not None}
    return {"kernels": kernels or None, "precision": run.get("precision")}


def point_record(run: dict) -> dict:
    """What summary.json says of one point: what it asked and ran, how it ended, its figures and its kernels."""
    passes = run.get("passes") or {}
    fb = passes.get("forward_backward") or {}
    return {
        "status": run.get("status"), "error": run.get("error"), "backend": run.get("backend"),
        "layout": layout_of(run), "planner": run.get("planner"), "mtpm": run.get("mtpm"),
        "dtype": dtype_of(run), "world_size": run.get("world_size"), "device": (run.get("device") or {}).get("type"),
        "n_dummy": (run.get("plan") or {}).get("n_dummy"),
        "fwd_tok_per_s": (passes.get("forward") or {}).get("tok_per_s"), "fwdbwd_tok_per_s": fb.get("tok_per_s"),
        "fwdbwd_mem_peak_bytes": fb.get("mem_peak_bytes"), "fwdbwd_util_pct": fb.get("util_pct"),
        "mfu_pct": fb.get("mfu_pct"), "grad_norm": ((run.get("_outputs") or {}).get("forward_backward") or {}).get(
            "grad_norm"),
        **what_ran(run), "notes": kernel_notes(run), "folder": run.get("_dir"),
    }


def kernel_notes(run: dict) -> list[str]:
    """What a point's kernel record does not say by itself: a float32 point on CUDA that records grouped_mm called
    torch's grouped_mm, which runs float32 through its own fallback (one mm per expert after a host read of the
    offsets), not the fused kernel it runs for bf16."""
    notes = []
    on_cuda = (run.get("device") or {}).get("type") == "cuda"
    for pass_type, ops in (what_ran(run)["kernels"] or {}).items():
        if on_cuda and dtype_of(run) == "float32" and "grouped_mm" in (ops.get("moe_experts") or {}):
            notes.append(f"{pass_type}: moe_experts ran torch's grouped_mm in float32: torch's per-expert fallback "
                         "(a host read of the offsets, one mm per expert), not its fused bf16 kernel")
    return notes


def compare(run: dict, ref: dict, rtol: float, judge_grad: bool = True) -> dict:
    """Worst relative difference of per-example fwd+bwd losses and of the gradient norm.

    ``judge_grad=False``: the gradient norm's difference is reported, only the losses decide.
    """
    a = ((run or {}).get("_outputs") or {}).get("forward_backward")
    b = ((ref or {}).get("_outputs") or {}).get("forward_backward")
    if not a or not b:  # a run that failed or was stopped before its fwd+bwd pass
        return {"rtol": rtol, "agrees": False, "error": "no fwd+bwd outputs" + ("" if a else " (run)")
                + ("" if b else " (reference)")}
    if len(a["loss"]) != len(b["loss"]):
        return {"rtol": rtol, "agrees": False, "error": f"{len(a['loss'])} vs {len(b['loss'])} examples"}
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a["loss"], b["loss"]))
    grad = abs(a["grad_norm"] - b["grad_norm"]) / max(abs(b["grad_norm"]), 1e-12)
    return {"rtol": rtol, "max_rel_loss_diff": worst, "rel_grad_norm_diff": grad, "judge_grad": judge_grad,
            "agrees": worst <= rtol and (grad <= rtol or not judge_grad)}


def judge_comparison(run: Optional[dict], ref: Optional[dict], kind: str) -> dict:
    """One comparison, its tolerance chosen by device, dtype and kind (RTOL says why each is what it is)."""
    if run is None or ref is None:
        return {"agrees": False, "error": "not run" + (" (run)" if run is None else "") + (
            " (reference)" if ref is None else "")}
    devices = {(r.get("device") or {}).get("type") or "cpu" for r in (run, ref)}
    device = "cuda" if "cuda" in devices else "cpu"
    dtype = "bfloat16" if "bfloat16" in {dtype_of(run), dtype_of(ref)} else "float32"
    across_layouts = layout_of(run) != layout_of(ref)
    rtol = RTOL[(device, dtype, kind)]
    # Packed and padded rows sum the gradient in another order: its norm is reported, the losses decide.
    return {"layouts": [layout_of(run), layout_of(ref)], "device": device, "dtype": dtype,
            **compare(run, ref, rtol, judge_grad=not across_layouts and dtype == "float32")}


# Feature checks: each reads one point's results.json (and its folder) and says what it found.


def _ok_status(run: dict) -> list[str]:
    return [] if run.get("status") == "ok" else [f"status {run.get('status')}: {run.get('error')}"]


def check_profile(run: dict, folder: Path) -> dict:
    prof = ((run.get("passes") or {}).get("forward_backward") or {}).get("profile") or {}
    traces = prof.get("traces") or []
    sizes = {t: (folder / t).stat().st_size for t in traces if (folder / t).is_file()}
    problems = _ok_status(run) + ([] if traces else ["no trace recorded"]) + [
        f"trace {t} missing" for t in traces if t not in sizes]
    per_rank = [{k: r.get(k) for k in ("rank", "steps", "trace_bytes", "events", "pass_s", "covered_s")}
                for r in prof.get("per_rank") or []]
    # The shares are of the rank thread's host timeline (backends/runtime/profiling.py): on a GPU, where the host
    # launched and waited, not the kernels' own time, which only the trace's GPU rows show.
    on_cuda = (run.get("device") or {}).get("type") == "cuda"
    return {"ok": not problems, "problems": problems, "traces": sizes, "slowdown": prof.get("slowdown"),
            "shares": prof.get("shares"), "shares_of": "host time: the kernels' time is in the traces' GPU rows"
            if on_cuda else "host time", "per_rank": per_rank}


def check_calibrated(run: dict, folder: Path) -> dict:
    cost_model = {k: v for k, v in ((run.get("plan") or {}).get("cost_model") or {}).items() if k != "residuals"}
    source = str(cost_model.get("source", ""))
    problems = _ok_status(run) + ([] if "calibrat" in source else [f"plan.cost_model.source is {source!r}"])
    return {"ok": not problems, "problems": problems, "cost_model": cost_model}


def check_auto(run: dict, folder: Path) -> dict:
    auto = run.get("auto") or {}
    problems = _ok_status(run) + ([] if run.get("mtpm") else ["no budget chosen"])
    return {"ok": not problems, "problems": problems, "chosen": run.get("mtpm"),
            # a probe (run before two sizes were measured) has no prediction: its refit is the model's answer there
            "candidates": [{k: c.get(k) for k in ("mtpm", "decision", "status", "tok_per_s", "measured_peak_bytes",
                                                   "predicted_peak_bytes", "refit_peak_bytes")}
                           for c in auto.get("candidates") or []],
            "limit_bytes": auto.get("limit_bytes")}


def check_compile(run: dict, folder: Path) -> dict:
    built = ((run.get("model") or {}).get("built") or {}).get("compile")
    per_pass = {t: p.get("compile") for t, p in (run.get("passes") or {}).items() if isinstance(p, dict)}
    hits = {t: (c or {}).get("recompile_limit_hits") for t, c in per_pass.items()}
    problems = _ok_status(run) + ([] if built else ["model.built.compile not recorded"]) + [
        f"{t}: {n} recompile-limit hits (those calls ran eagerly)" for t, n in hits.items() if n]
    return {"ok": not problems, "problems": problems, "recompile_limit_hits": hits, "built": built,
            "passes": per_pass}


def check_oom_snapshot(run: dict, folder: Path) -> dict:
    files = run.get("memory_snapshot") or []
    sizes = {f: (folder / f).stat().st_size for f in files if (folder / f).is_file()}
    problems = ([] if run.get("status") == "oom" else [f"status {run.get('status')}, expected oom"]) + (
        [] if sizes else ["no allocator history written"])
    return {"ok": not problems, "problems": problems, "status": run.get("status"), "error": run.get("error"),
            "snapshots": sizes}


def __getattr__(name: str):
    """``backend.hooks=scripts.gpu_check:FSDP2OutOfMemoryInTheWarmup``, built on first use so --plan needs no torch."""
    if name == "FSDP2OutOfMemoryInTheWarmup":
        return _oom_hooks()
    raise AttributeError(name)


def _oom_hooks():
    import torch

    from backends.fsdp2 import FSDP2Hooks

    class FSDP2OutOfMemoryInTheWarmup(FSDP2Hooks):
        """The first fwd+bwd asks the CUDA allocator for twice the device's memory: a real out-of-memory error,
        raised inside the pass the memory snapshot records."""

        def start_pass(self, model, pass_type):
            super().start_pass(model, pass_type)
            if pass_type == "forward_backward" and self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.empty(2 * total, dtype=torch.uint8, device=self.device)

    return FSDP2OutOfMemoryInTheWarmup


# ---------------------------------------------------------------------------------------------------------------
# The plan


@dataclass
class Target:
    """What the check runs on: the device kind, its GPUs, and the model (the tiny one unless a checkpoint)."""

    device: str  # "cpu" or "cuda"
    gpus: int = 0
    model_path: Optional[str] = None
    backends: Optional[tuple] = None  # the agreement steps' backends (default: all; --backends)

    @property
    def costs(self) -> dict:
        return COSTS["cuda-35b" if self.model_path else self.device]


def _p(step: str, name: str, load: str, settings: dict, extra: tuple = ()) -> Point:
    return Point(f"{step}.{name}", settings, load, extra)


def plan(target: Target) -> list[Step]:
    """The steps, in order of value, for ``target``: each feature once, the published bf16 first, then the features
    (what only a GPU shows: traces, the allocator's history, a calibrated fit), then float32 and compile, which a short
    budget drops first."""
    big = target.model_path is not None
    cuda = target.device == "cuda"
    backends = ALL if not big else DISTRIBUTED
    if target.backends:
        backends = [b for b in backends if b in target.backends]
    layouts = ["padded", "packed"]
    budget = {"mtpm": 1024} if not big else {"mtpm": 16384}
    steps: list[Step] = []

    def grid(step: str, dtype: str, names: list[str], device: str = "auto", extra: Optional[dict] = None):
        pts = []
        for backend in names:
            for layout in layouts:
                settings = {"backend": backend, "model.dtype": dtype, "layout": layout, **budget, **(extra or {})}
                if device != "auto":
                    settings["backend.device"] = device
                pts.append(_p(step, f"{backend}.{layout}", f"{backend}/{dtype}/{device}", settings))
        return pts

    def vs(step: str, names: list[str], ref: str) -> list[tuple[str, str, str]]:
        pairs = [(f"{step}.{b}.packed", f"{step}.{b}.padded", "across") for b in names]
        pairs += [(f"{step}.{b}.{lay}", f"{step}.{ref}.{lay}", "same") for b in names if b != ref for lay in layouts]
        return pairs

    # 1. bf16, the published setting: every backend, padded against packed on the same backend, and the backends
    #    against each other per layout. Pays fla's bf16 Triton compile (both layouts).
    ref = backends[0]
    steps.append(Step("bf16", ["bf16", *backends, "padded", "packed", "padded vs packed (same backend)"],
                      grid("bf16", "bfloat16", backends), vs("bf16", backends, ref)))
    # 2. The features a point switches on, on one loaded FSDP2 in bf16: the profiler and the calibrated cost model;
    #    then (a second load, its hooks differ) a real CUDA out-of-memory error under the allocator's history; last
    #    mtpm=auto, which starts ranks of its own.
    base = {"backend": SHARDED, "model.dtype": "bfloat16"}
    feats = [
        _p("features", "profile", f"{SHARDED}/bfloat16", {**base, **budget, "bench.profile": True}, ("profile",)),
        _p("features", "calibrated", f"{SHARDED}/bfloat16",
           {**base, **budget, "cost_model": "calibrated", "calibration.cache": False, "calibration.repeat": 1,
            "calibration.warmup": 1 if cuda else 0},  # as the points' own warm-up: Triton's compile on a GPU
           ("calibrate",)),
    ]
    judges = {"features.profile": check_profile, "features.calibrated": check_calibrated, "features.auto": check_auto}
    if cuda and not big:
        feats.append(_p("features", "oom_snapshot", f"{SHARDED}/bfloat16/oom",
                        {**base, **budget, "bench.memory_snapshot": True,
                         "backend.hooks": "scripts.gpu_check:FSDP2OutOfMemoryInTheWarmup"}, ("oom",)))
        judges["features.oom_snapshot"] = check_oom_snapshot
    # Last: mtpm=auto releases a hot backend and starts its own ranks (alone under the memory limit).
    feats.append(_p("features", "auto", f"{SHARDED}/bfloat16/auto", {**base, "mtpm": "auto"}, ("auto",)))
    steps.append(Step("features", ["bench.profile", "cost_model=calibrated", "mtpm=auto"]
                      + (["bench.memory_snapshot (an induced OOM)"] if cuda and not big else []), feats,
                      features=judges))
    # 3. float32. On CPU: the three backends, padded against packed and against each other, to 1e-4. On one GPU:
    #    FSDP2 packed (fla's varlen kernels, TF32 inside) and the multi-rank path on 2 CPU ranks (gloo) of this
    #    host, both backends and both layouts, each against the GPU's point; on several GPUs, FSDP2 packed against
    #    padded across them (NCCL).
    if not cuda:
        names = backends
        steps.append(Step("fp32", ["fp32", "padded vs packed (same backend)", "collectives (gloo, 2 CPU ranks)"],
                          grid("fp32", "float32", names), vs("fp32", names, names[0])))
    elif not big:
        pts = [_p("fp32", f"{SHARDED}.packed", f"{SHARDED}/float32",
                  {"backend": SHARDED, "model.dtype": "float32", "layout": "packed", **budget})]
        covers = ["fp32"]
        pairs: list = []
        if target.gpus >= 2:
            pts = grid("fp32", "float32", [SHARDED])
            pairs = vs("fp32", [SHARDED], SHARDED)
            covers += ["collectives (NCCL)", "FSDP2 sharding", "padded vs packed (same backend)"]
        else:
            cpu = grid("fp32", "float32", DISTRIBUTED, device="cpu", extra={"world_size": 2})
            cpu = [Point(p.name.replace("fp32.", "fp32.cpu_ranks."), p.settings, p.load, p.extra) for p in cpu]
            pts += cpu
            pairs = [(p.name, f"fp32.{SHARDED}.packed", "across") for p in cpu]
            covers += ["collectives (gloo, 2 CPU ranks)", "FSDP2 sharding", "megatron DDP grad sync",
                       "GPU against CPU ranks"]
        steps.append(Step("fp32", covers, pts, pairs, gpu_default=False))
    # 4. backend.compile on FSDP2 in bf16, packed: the compile record, no recompile-limit hit, and the same losses
    #    as the eager packed point of step 1 (inductor's fused kernels round otherwise: bf16's tolerance).
    steps.append(Step("compile", ["backend.compile"],
                      [_p("compile", f"{SHARDED}.packed", f"{SHARDED}/bfloat16/compile",
                          {**base, **budget, "layout": "packed", "backend.compile": True}, ("compile",))],
                      [(f"compile.{SHARDED}.packed", f"bf16.{SHARDED}.packed", "across")] if SHARDED in backends
                      else [], features={f"compile.{SHARDED}.packed": check_compile},
                      cpu_form=False, why_not_on_cpu="inductor's C++ compile of the layers on 2 cores takes minutes; "
                                                     "tests/integration/test_compile.py covers it on CPU",
                      gpu_default=big))
    return steps


# Why the default run on GPUs leaves a step out: Triton's first compile of fla's kernels for a third (dtype, layout)
# and inductor's compile do not fit five minutes beside the bf16 step and the features.
NOT_DEFAULT = ("not in the default GPU run (fla's Triton compile for float32 and inductor's do not fit "
               "--budget-s 300 beside bf16 and the features): a second run with --only fp32,compile runs them")


def loads_of(step: Step) -> list[str]:
    """What the step's points load, in order of first use (points with one load share a loaded backend)."""
    return list(dict.fromkeys(p.load for p in step.points))


def shortened(step: Step, keep: int) -> Step:
    """The step with the points of its first ``keep`` loads, and the comparisons and feature checks on those points
    (a comparison with a point of an earlier step stays)."""
    loads = loads_of(step)[:keep]
    points = [p for p in step.points if p.load in loads]
    dropped = {p.name for p in step.points} - {p.name for p in points}
    return dataclasses.replace(step, points=points,
                               comparisons=[c for c in step.comparisons if not dropped & {c[0], c[1]}],
                               features={k: v for k, v in step.features.items() if k not in dropped})


def estimates(steps: list[Step], target: Target, only: Optional[str] = None) -> list[dict]:
    """Each step's estimated seconds and their parts, in order (Triton is paid by the first step of each dtype and
    layout). ``only``: the steps asked for by name, which run even where they are not in the default GPU run.
    ``shorter``: the step with fewer loads (its last ones left out), each with its estimate, longest first: what a
    budget that no longer fits the whole step runs."""
    seen: set = set()
    rows = []
    for step in steps:
        why = None
        if target.device != "cuda" and not step.cpu_form:
            why = f"no CPU form: {step.why_not_on_cpu}"
        elif target.device == "cuda" and not step.gpu_default and not only:
            why = NOT_DEFAULT
        parts = step.cost(target.costs, seen) if why is None else {}
        shorter = []
        if why is None:
            for keep in range(len(loads_of(step)) - 1, 0, -1):
                short = shortened(step, keep)
                shorter.append({"points": [p.name for p in short.points],
                                "estimate_s": round(sum(short.cost(target.costs, seen).values()), 1)})
            seen.update(step.kernels())
        rows.append({"step": step.name, "covers": step.covers, "points": [p.name for p in step.points],
                     "estimate_s": round(sum(parts.values()), 1), "parts_s": parts, "shorter": shorter,
                     **({} if why is None else {"skipped": why})})
    return rows


def scale_estimates(rows: list[dict], factor: float, source: str) -> None:
    """Every estimate of ``rows`` (the whole step's, its parts', its shorter forms') times ``factor``."""
    for row in rows:
        row["estimate_s"] = round(row["estimate_s"] * factor, 3)
        row["parts_s"] = {k: round(v * factor, 3) for k, v in row["parts_s"].items()}
        for short in row["shorter"]:
            short["estimate_s"] = round(short["estimate_s"] * factor, 3)
        if row["estimate_s"]:
            row["estimate_from"] = source


def estimates_from(rows: list[dict], path: Path, device: str) -> None:
    """Replace the estimates with what an earlier run measured (its summary.json): a step it ran whole with the same
    points on the same device kind takes its measured seconds; the others are scaled by that run's ratio of measured
    to estimated seconds. One line and exit 2 when the file is no summary of this check."""
    try:
        prior = json.loads(path.read_text())
        timing = prior["timing"]
        ratio, measured = float(timing["ratio"]), timing["measured"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--estimates-from: {path} is not a summary.json of this check with its timing "
                         f"({type(exc).__name__}: {exc}); give the summary.json an earlier run wrote") from None
    if prior.get("device") != device:
        raise SystemExit(f"--estimates-from: {path} measured device {prior.get('device')}, this run is {device}; "
                         "give a summary.json of the same device kind")
    for row in rows:
        if not row["estimate_s"]:
            continue
        got = measured.get(row["step"]) or {}
        if got.get("points") == row["points"] and got.get("exit_code") == 0:
            factor, source = got["wall_s"] / row["estimate_s"], f"measured by {path}"
        else:
            factor, source = ratio, f"{ratio:.2f} x the constants, the ratio {path} measured"
        scale_estimates([row], factor, source)


def print_plan(rows: list[dict], target: Target, budget_s: float) -> None:
    what = f"{target.device}" + (f", {target.gpus} GPU(s)" if target.device == "cuda" else "") + (
        f", model {target.model_path}" if target.model_path else ", the tiny model")
    source = ("reasoned, not yet measured; Triton's compile and autotune from fla-org/flash-linear-attention#458"
              if target.device == "cuda" else "from the 2-core machine's step logs")
    source = next((r["estimate_from"] for r in rows if r.get("estimate_from")), source)
    print(f"gpu_check plan ({what}); estimates ({source}):")
    total = 0.0
    for row in rows:
        # the budget spent as run_steps spends it (before any step has measured the estimates): a step whose
        # estimate exceeds what is left runs its longest shorter form that fits, or is skipped
        why = row.get("skipped") or fits(row["estimate_s"], budget_s - total)
        short = next((s for s in row.get("shorter", []) if s["estimate_s"] <= budget_s - total), None)
        if why and not (short and not row.get("skipped")):
            print(f"  {row['step']:<10}  not run: {why}")
            continue
        if why:
            total += short["estimate_s"]
            print(f"  {row['step']:<10} {short['estimate_s']:6.0f} s  {len(short['points'])} of "
                  f"{len(row['points'])} points (the whole step, {row['estimate_s']:.0f} s, does not fit): "
                  f"{', '.join(short['points'])}")
            continue
        total += row["estimate_s"]
        parts = ", ".join(f"{k} {round(v, 1):g}" for k, v in row["parts_s"].items())
        print(f"  {row['step']:<10} {row['estimate_s']:6.0f} s  {len(row['points'])} point(s)  [{parts}]")
        print(f"  {'':<10}          covers: {', '.join(row['covers'])}")
    print(f"  {'total':<10} {total:6.0f} s  (--budget-s {budget_s:g})")


# ---------------------------------------------------------------------------------------------------------------
# Running


def harness_env(target: Target) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    # Autotuning's choices kept on disk beside Triton's compiled kernels, so a later launch does not tune again:
    # fla's own switch (on by default in its releases) and Triton's for every autotuned kernel.
    env.setdefault("FLA_CACHE_RESULTS", "1")
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    # One node: NCCL's own choice of a network interface can pick one a VM does not route (its ranks then hang at
    # their first collective); the loopback is what ranks on one host talk over.
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if target.device == "cpu":
        # One compute thread per rank: on a shared machine more threads than free cores wait on each other (the
        # in-process backend's fwd+bwd ran 40x slower with 2 threads beside another run on 2 cores).
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def harness(cmd: list[str], timeout: float, log: Path, env: dict) -> tuple[int, float]:
    """Run one launch (``python -m harness ...``) in a session of its own, its output in ``log``; exit code 124 when
    it ran past ``timeout``. Stopped there or by a signal to this script (Cut, raised again), its whole process group
    goes: the harness, its fork server and the ranks."""
    t0 = time.perf_counter()
    print("+", " ".join(["python", *cmd[1:]] if cmd[0] == sys.executable else cmd), flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            took = stop_group(proc)
            print(f"  stopped after {timeout:.0f} s (its process group in {took:.1f} s)", flush=True)
            rc = 124
        except Cut as cut:
            cut.stopped_in_s = round(stop_group(proc), 2)
            print(f"  {cut}: stopped the launch and its process group in {cut.stopped_in_s:.1f} s", flush=True)
            raise
    return rc, time.perf_counter() - t0


def yaml_of(settings: dict) -> str:
    """A point's settings as a ``# @package _global_`` config: group choices as overrides, the rest as dotted keys."""
    groups = {"backend", "model", "workload", "logger", "batching"}
    lines = ["# @package _global_", "# written by scripts/gpu_check.py"]
    chosen = {k: v for k, v in settings.items() if k in groups}
    if chosen:
        lines.append("defaults:")
        lines += [f"  - override /{k}: {v}" for k, v in chosen.items()]
    nested: dict = {}
    for key, value in settings.items():
        if key in groups:
            continue
        *heads, last = key.split(".")
        node = nested
        for head in heads:
            node = node.setdefault(head, {})
        node[last] = value

    def emit(node: dict, indent: int) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                lines.append(" " * indent + f"{key}:")
                emit(value, indent + 2)
            else:
                lines.append(" " * indent + f"{key}: {json.dumps(value)}")

    emit(nested, 0)
    return "\n".join(lines) + "\n"


def command(step: Step, out: Path, target: Target, examples: Optional[int]) -> list[str]:
    """The step's launch: ``python -m harness -m`` over its points."""
    return [sys.executable, "-m", "harness", *launch_args(step, out, target, examples)]


def launch_args(step: Step, out: Path, target: Target, examples: Optional[int]) -> list[str]:
    # A warm-up on a GPU keeps Triton's compiling out of the timed repeat; on CPU nothing needs warming.
    warmup = 1 if target.device == "cuda" else 0
    common = ["bench.save_outputs=true", f"bench.warmup={warmup}", "bench.repeat=1", "bench.baseline=false",
              "bench.paired=false", "logger=none", "hot=true", "~hydra.callbacks.report",
              f"hydra.searchpath=['file://{out / 'conf'}']", f"hydra.sweep.dir='{out / 'runs' / step.name}'"]
    common.append("workload=smoke")
    if examples:
        common.append(f"workload.n_examples={examples}")
    if target.model_path:
        common += ["model=qwen3_5_35b_a3b", f"model.path={target.model_path}", "gc=true"]
    return ["-m", f"+{GROUP}=" + ",".join(p.name for p in step.points), *common]


def judge(step: Step, runs: dict[str, dict], reached_only: bool = False) -> dict:
    """The step's comparisons and feature checks over every point run so far (``runs``, by point name).
    ``reached_only``: a step stopped part-way is judged on the points it finished (the others, and the one the stop
    interrupted, are listed, not failed)."""
    if reached_only:
        runs = {k: r for k, r in runs.items() if r.get("status") != "interrupted"}
    entry: dict = {"comparisons": [], "features": {}}
    for run_key, ref_key, kind in step.comparisons:
        if reached_only and not (run_key in runs and ref_key in runs):
            continue
        entry["comparisons"].append({"run": run_key, "ref": ref_key, "kind": kind,
                                     **judge_comparison(runs.get(run_key), runs.get(ref_key), kind)})
    for key, fn in step.features.items():
        run = runs.get(key)
        if reached_only and not run:
            continue
        entry["features"][key] = fn(run, Path(run["_dir"])) if run else {"ok": False, "problems": ["not run"]}
    # Every point must end ok, except those a feature check judges (an induced out-of-memory error ends "oom").
    failed = [p.name for p in step.points if p.name not in step.features
              and (runs.get(p.name) or {}).get("status") != "ok" and (p.name in runs or not reached_only)]
    entry["failed_points"] = failed
    entry["ok"] = (not failed and all(c["agrees"] for c in entry["comparisons"])
                   and all(f["ok"] for f in entry["features"].values()))
    return entry


def coverage(runs: dict[str, dict], target: Target, summary_steps: dict) -> dict:
    """What the finished points exercised, read from their results.json, and what they did not."""
    ok = [r for r in runs.values() if r.get("status") == "ok"]

    def where(r: dict) -> str:
        return f"{r['backend']} x{r['world_size']} on {(r.get('device') or {}).get('type')}"

    multi = [r for r in ok if (r.get("world_size") or 1) > 1]
    gpu_multi = [r for r in multi if (r.get("device") or {}).get("type") == "cuda"]
    covered = {
        "ranks": sorted({where(r) for r in ok}),
        "collectives": sorted({f"{where(r)} ({'nccl' if r in gpu_multi else 'gloo'})" for r in multi}),
        "dummy_steps": sorted({where(r) for r in ok if sum((r.get("plan") or {}).get("n_dummy") or [0]) > 0}),
        "packed": sorted({where(r) for r in ok if layout_of(r) == "packed"}),
        "padded": sorted({where(r) for r in ok if layout_of(r) == "padded"}),
        "bf16": sorted({where(r) for r in ok if dtype_of(r) == "bfloat16"}),
        "float32": sorted({where(r) for r in ok if dtype_of(r) == "float32"}),
        "features": sorted(k for s in summary_steps.values() for k, f in (s.get("features") or {}).items()
                           if f.get("ok")),
    }
    not_covered = [f"step {name}: {s.get('reason') or s.get('status')}" for name, s in summary_steps.items()
                   if s.get("status") != "passed"]
    if not gpu_multi:
        not_covered.append("NCCL collectives, FSDP2 sharding and dummy steps across GPUs (fewer than 2 GPUs: the "
                           "multi-rank path ran on CPU ranks with gloo)")
    if target.device == "cpu":
        not_covered += ["CUDA kernels (fla, flash-attn, causal-conv1d) and TF32", "bench.memory_snapshot (CUDA only)"]
    if not target.model_path:
        not_covered += ["the published model (Qwen3.5-35B-A3B): the tiny random model only (--model-path runs it)",
                        "loading a checkpoint from disk"]
    not_covered += ["the published workload (seed_mixed_128): the smoke workload only", "more than one node",
                    "pairing (bench.paired) and mbs=1 baselines: off to fit the time"]
    return {"covered": covered, "not_covered": not_covered}


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    info["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    from importlib import metadata

    for dist_name in ("transformers", "peft", "accelerate", "megatron-core", "hydra-core", "flash-linear-attention",
                      "fla-core", "flash-attn", "causal-conv1d", "triton", "nvidia-ml-py"):
        try:
            info[dist_name] = metadata.version(dist_name)
        except Exception:  # noqa: BLE001 - not installed, or metadata unreadable: recorded as None
            info[dist_name] = None
    info["imports"] = {name: try_import(name) for name in KERNEL_MODULES}
    return info


def try_import(module: str) -> dict:
    """Whether ``module`` imports here (a wheel built for another torch or CUDA installs but fails to import)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - an extension's import can fail in many ways
        return {"imported": False, "error": f"{type(exc).__name__}: "
                                            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    return {"imported": True, "version": getattr(mod, "__version__", None)}


def fits(estimate_s: float, left_s: float) -> Optional[str]:
    """Why a step is skipped (its estimate exceeds what is left of the budget), or None when it fits."""
    if estimate_s > left_s:
        return f"estimated {estimate_s:.0f} s, {max(left_s, 0):.0f} s left of --budget-s"
    return None


def cap_s(estimate_s: float, device: str) -> float:
    """A step's wall-clock cap. On a GPU its estimate with room for a slow start, so one stuck step cannot take the
    device time of the rest; on CPU none but the budget's: a machine shared with other runs slows every step alike
    (the CPU form's bf16 step took 3 times its estimate beside five other engineers' runs)."""
    return max(3.0 * estimate_s, estimate_s + 120.0) if device == "cuda" else float("inf")


class Cut(BaseException):
    """A signal stopped the check (SIGTERM, SIGINT or SIGHUP): raised once, in the main thread, by its handler."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.stopped_in_s: Optional[float] = None  # how long the running launch's process group took to end


def catch_signals() -> None:
    """Each stop signal raises Cut where the check is (waiting on a launch, mostly); the signals after the first
    are ignored, so the stop, the summary and the copy to --back are not themselves cut."""

    def handler(signum, frame):
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Cut(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, handler)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (a launch's group holds this user's processes only)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen) -> float:
    """Stop a launch started in a session of its own: SIGTERM to its process group (the harness, its fork server,
    every rank), SIGKILL to what is left after STOP_GRACE_S, then wait (5 s at most) until the group is gone. Stop
    signals wait until it is done. Returns the seconds it took."""
    t0 = time.monotonic()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        proc.wait()
        deadline = time.monotonic() + 5
        while group_alive(proc.pid) and time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # its last process ended since the check
                break
            time.sleep(0.05)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return time.monotonic() - t0


def fit(step: Step, row: dict, left_s: float, ratio: float) -> tuple[Optional[Step], float, Optional[str]]:
    """The step as it fits in ``left_s`` with each estimate times ``ratio``: whole, else its longest shorter form
    that fits; (None, 0, why) when none does."""
    forms = [(step, row["estimate_s"])] + [(shortened(step, len(loads_of(step)) - 1 - i), s["estimate_s"])
                                           for i, s in enumerate(row["shorter"])]
    for form, estimate in forms:
        if estimate * ratio <= left_s:
            return form, estimate, None
    scaled = f" ({row['estimate_s']:.0f} s x {ratio:.2f}, the measured ratio so far)" if ratio != 1 else ""
    return None, 0.0, f"estimated {row['estimate_s'] * ratio:.0f} s{scaled}, {max(left_s, 0):.0f} s left of --budget-s"


def run_steps(steps: list[Step], rows: list[dict], target: Target, out: Path, budget_s: float,
              examples: Optional[int], summary: dict, save: Callable[[], None],
              clock: Callable[[], float] = time.monotonic, runs: Optional[dict] = None) -> dict[str, dict]:
    """Runs the steps in order within ``budget_s`` (as ``clock`` tells it); returns every point's results by name
    (``runs``, filled as the steps end, so a caller that catches Cut has them too).

    After each step its measured seconds against its estimate update ``summary["timing"]``'s ratio, which scales the
    estimates of the steps after it. A Cut (a stop signal) stops the running launch, records the step as cut and
    is raised again."""
    t_end = clock() + budget_s
    conf = out / "conf" / GROUP
    conf.mkdir(parents=True, exist_ok=True)
    runs = {} if runs is None else runs
    timing = summary.setdefault("timing", {"ratio": 1.0, "measured": {}})
    spent = {"wall_s": 0.0, "estimate_s": 0.0}
    finished: list[str] = []
    for step, row in zip(steps, rows):
        entry: dict = {"covers": step.covers, "estimate_s": row["estimate_s"]}
        summary["steps"][step.name] = entry
        if "skipped" in row:
            entry.update(status="skipped", reason=row["skipped"], ok=None)
            save()
            continue
        ratio = timing["ratio"]
        name = step.name
        step, estimate, reason = fit(step, row, t_end - clock(), ratio)
        if step is None:  # no longer fits: listed, not failed
            entry.update(status="skipped", reason=reason, ok=None)
            print(f"- {name}: skipped ({reason})", flush=True)
            save()
            continue
        if estimate != row["estimate_s"]:
            entry["shortened"] = {"points": [p.name for p in step.points], "estimate_s": estimate,
                                  "why": f"the whole step, {row['estimate_s'] * ratio:.0f} s, did not fit"}
        for p in step.points:
            (conf / f"{p.name}.yaml").write_text(yaml_of(p.settings))
        sweep = out / "runs" / step.name
        shutil.rmtree(sweep, ignore_errors=True)  # a rerun replaces this script's own runs
        sweep.parent.mkdir(parents=True, exist_ok=True)
        cap = cap_s(estimate * ratio, target.device)
        by_budget = cap >= t_end - clock()
        cap = min(cap, t_end - clock())
        entry.update(scaled_estimate_s=round(estimate * ratio, 1), cap_s=round(cap, 1), log=f"{step.name}.log")
        summary["running"] = step.name
        save()
        t0 = time.perf_counter()
        try:
            rc, wall = harness(command(step, out, target, examples), cap, out / f"{step.name}.log",
                               harness_env(target))
        except Cut as cut:
            rc, wall = None, time.perf_counter() - t0
            record(entry, step, sweep, runs, rc, wall, f"cut by {cut}")
            summary["cut"] = {"by": str(cut), "step": step.name, "finished": finished, "after_s": round(wall, 2),
                              "group_stopped_in_s": getattr(cut, "stopped_in_s", None)}
            raise
        finally:
            summary.pop("running", None)
        status = None
        if rc == 124 and by_budget:
            status = "cut by --budget-s"
            summary["cut"] = {"by": "--budget-s", "step": step.name, "finished": finished, "after_s": round(wall, 2)}
        elif rc == 124:
            status = "stopped at its cap"
        record(entry, step, sweep, runs, rc, wall, status)
        if rc == 0 or wall >= estimate:  # a whole run, or one that already took longer than its estimate
            spent["wall_s"] += wall
            spent["estimate_s"] += estimate
            # never below a quarter: one step far faster than its estimate does not promise the same of the rest
            timing["ratio"] = round(max(spent["wall_s"] / spent["estimate_s"], 0.25), 3)
        timing["measured"][step.name] = {"points": [p.name for p in step.points], "estimate_s": estimate,
                                         "wall_s": round(wall, 2), "exit_code": rc}
        finished.append(step.name)
        print(f"- {step.name}: {entry['status']} in {wall:.0f} s (estimated {estimate:.0f} s"
              + (f", {estimate * ratio:.0f} s at the measured ratio {ratio:.2f}" if ratio != 1 else "") + ")",
              flush=True)
        save()
    return runs


def record(entry: dict, step: Step, sweep: Path, runs: dict, rc: Optional[int], wall: float,
           status: Optional[str]) -> None:
    """A step's entry once its launch ended: its points, comparisons and checks, its status. ``status`` names a stop
    (its cap, the budget, a signal); a step cut by the budget or a signal is judged on the points it reached."""
    got = runs_in(sweep)
    runs.update(got)
    cut = status is not None and status.startswith("cut")
    entry.update(exit_code=rc, wall_s=round(wall, 2),
                 points={name: point_record(got[name]) if name in got else {"status": "not reached"}
                         for name in (p.name for p in step.points)},
                 **judge(step, runs, reached_only=cut))
    if cut:
        finished = [p.name for p in step.points if (got.get(p.name) or {}).get("status") not in (None, "interrupted")]
        entry["ok"] = entry["ok"] if finished else None
    else:
        entry["ok"] = entry["ok"] and rc == 0
    entry["status"] = status or ("passed" if entry["ok"] else "failed")


def write_atomic(path: Path, text: str) -> None:
    """``text`` to ``path`` whole or not at all: a temporary file beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def copy_atomic(src: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


class Back:
    """What comes back from a lent machine: at most MAX_FILES files in ``dest``, none in a folder, copied from the
    work folder after every step, each written whole (a run stopped at any moment has returned what finished):
    summary.json, gpu_check.log, kernels.log, each step's log, RESULTS_TAR (each point's results.json, outputs and
    configs, the generated point files, nvidia-smi's answer, and the logs past the 8 files), and at the end
    REST_TAR, everything else (traces, Triton's and inductor's caches), which may be too large to come back."""

    # per point: what judging it needs, small (no traces, snapshots or caches)
    POINT_FILES = ("results.json", "example_outputs.json", "plan.json", ".hydra/config.yaml", ".hydra/overrides.yaml")
    LEFT_OUT = ("site", "build")  # gpu_check.sh's installed wheels and kernel build trees, rebuilt from .whl/

    def __init__(self, work: Path, dest: Path):
        self.work, self.dest = work, dest

    def clear(self) -> None:
        """This check's files of an earlier run in ``dest``, and what a stopped copy left half-written."""
        self.dest.mkdir(parents=True, exist_ok=True)
        for f in self.dest.iterdir():
            ours = f.name == SUMMARY or f.suffix in (".log", ".tmp") or f.name in (RESULTS_TAR, REST_TAR)
            if f.is_file() and ours:
                f.unlink()

    def logs(self) -> tuple[list[Path], list[Path]]:
        """The logs that come back as files, and those that go into RESULTS_TAR (past the 8 files)."""
        top = [self.work / LOG, self.work / KERNELS_LOG]
        steps = sorted((f for f in self.work.glob("*.log") if f not in top), key=lambda f: f.stat().st_mtime)
        logs = [f for f in top if f.is_file()] + steps
        room = MAX_FILES - 3  # summary.json and the two archives
        return logs[:room], logs[room:]

    def results(self, extra: list[Path]) -> list[Path]:
        files = [f for name in self.POINT_FILES for f in self.work.glob(f"runs/*/*/{name}")]
        files += sorted(self.work.glob(f"conf/{GROUP}/*.yaml")) + [self.work / "nvidia-smi.txt"] + extra
        return sorted({f for f in files if f.is_file()})

    def _tar(self, name: str, files: list[Path], level: int) -> None:
        tmp = self.work / f".{name}.tmp"
        with tarfile.open(tmp, "w:gz", compresslevel=level) as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(self.work)), recursive=False)
        try:
            os.replace(tmp, self.dest / name)
        except OSError:  # another file system
            copy_atomic(tmp, self.dest / name)
            tmp.unlink()

    def ship(self, rest: bool = False) -> list[str]:
        """Copy the summary, the logs and RESULTS_TAR (and with ``rest``, REST_TAR) to ``dest``; their names."""
        plain, extra = self.logs()
        copy_atomic(self.work / SUMMARY, self.dest / SUMMARY)
        for f in plain:
            copy_atomic(f, self.dest / f.name)
        self._tar(RESULTS_TAR, self.results(extra), 9)
        if rest:
            top = {SUMMARY, *(f.name for f in plain)}
            files = [f for f in sorted(self.work.rglob("*")) if not f.is_dir()
                     and f.relative_to(self.work).parts[0] not in self.LEFT_OUT and f.name not in top
                     and not f.name.endswith(".tmp") and f.name not in (RESULTS_TAR, REST_TAR)]
            self._tar(REST_TAR, files, 1)  # caches compress little: the fastest level
        return sorted(f.name for f in self.dest.iterdir() if f.is_file() and not f.name.startswith("."))


class Tee:
    """A stream that also appends to a file: this script's output in gpu_check.log, after gpu_check.sh's own."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.file.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def describe(args: argparse.Namespace) -> Target:
    """The target the arguments name; a CUDA device asked for where none is, one line and exit 2."""
    import torch

    from backends.registry import BACKENDS

    model_path = args.model_path or None
    backends = None
    if args.backends:
        backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
        known = [b.name for b in BACKENDS]
        if not backends or any(b not in known for b in backends):
            raise SystemExit(f"--backends: {args.backends!r} names no backend or an unknown one; valid: "
                             f"{', '.join(known)}")
    if args.device == "cpu":
        if model_path:
            raise SystemExit("--model-path: the 35B variant runs on GPUs (the checkpoint does not fit 2 CPU ranks); "
                             "drop --device cpu, or --model-path")
        return Target("cpu", 0, model_path, backends)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.plan and args.device == "cuda":
        return Target("cuda", args.gpus or have or 1, model_path, backends)
    if args.device == "cuda" and not have:
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "--device cpu runs the CPU form, --plan --device cuda prints the GPU plan")
    return Target("cuda", have, model_path, backends) if have else Target("cpu", 0, model_path, backends)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")),
                    help="where summary.json, each step's log and its points go (default: $OUT, else gpu_check_out)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA when there is one; cpu: the CPU form; cuda: a GPU (with --plan, none needed)")
    ap.add_argument("--gpus", type=int, default=None, help="with --plan --device cuda: the GPUs to plan for (1)")
    ap.add_argument("--plan", action="store_true", help="print the steps and their estimated seconds; run nothing")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"the whole check's wall-clock limit; a step whose estimate does not fit in what is left "
                         f"is skipped with its reason (default {DEFAULT_BUDGET_S:g} s on a GPU, "
                         f"{BIG_MODEL_BUDGET_S:g} s with --model-path, {CPU_BUDGET_S:g} s on CPU)")
    ap.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated backends of the bf16 and fp32 steps (default: all)")
    ap.add_argument("--examples", type=int, default=None, help="workload.n_examples of every point (smoke: 16)")
    ap.add_argument("--model-path", default=os.environ.get("GPU_CHECK_MODEL_PATH"),
                    help="the 35B variant: Qwen3.5-35B-A3B from this local checkpoint, gradient checkpointing on")
    ap.add_argument("--back", type=Path, default=None,
                    help="copy at most 8 files here after every step (gpu_check.sh: $OUT; --out is then the work "
                         "folder): summary.json, the logs, the results archive, at the end the rest")
    ap.add_argument("--estimates-from", type=Path, default=None,
                    help="an earlier run's summary.json: plan with the seconds its steps measured")
    ap.add_argument("--estimate-scale", type=float, default=1.0,
                    help="multiply every estimate (a slower or faster machine than COSTS assumes; < 1 tests the "
                         "budget against estimates known to be short)")
    args = ap.parse_args(argv)
    if args.estimate_scale <= 0:
        ap.error(f"--estimate-scale: must be > 0, got {args.estimate_scale:g}")
    if args.budget_s is not None and args.budget_s <= 0:
        ap.error(f"--budget-s: must be > 0 seconds, got {args.budget_s:g}")
    if args.examples is not None and args.examples < 1:
        ap.error(f"--examples: must be >= 1, got {args.examples}")
    if args.gpus is not None and args.gpus < 1:
        ap.error(f"--gpus: must be >= 1, got {args.gpus}")
    if args.gpus is not None and not (args.plan and args.device == "cuda"):  # a run uses the GPUs it finds
        ap.error("--gpus: plans for that many GPUs with --plan --device cuda only, and would be ignored here; add "
                 "--plan --device cuda, or drop --gpus")
    return args


def select(steps: list[Step], only: Optional[str]) -> list[Step]:
    if not only:
        return steps
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = [s.name for s in steps]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--only: no step {', '.join(unknown)}; the steps here are {', '.join(known)}")
    return [s for s in steps if s.name in names]


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    try:
        target = describe(args)
        steps = select(plan(target), args.only)
        rows = estimates(steps, target, args.only)
        if args.estimates_from:
            estimates_from(rows, args.estimates_from, target.device)
        if args.estimate_scale != 1:
            scale_estimates(rows, args.estimate_scale, f"x{args.estimate_scale:g} (--estimate-scale)")
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise
    if args.budget_s is None:
        args.budget_s = (BIG_MODEL_BUDGET_S if target.model_path else DEFAULT_BUDGET_S) if target.device == "cuda" \
            else CPU_BUDGET_S
    if args.plan:
        print_plan(rows, target, args.budget_s)
        print("plan only: nothing installed, run or written (a run records this plan in its summary.json, 'plan')")
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    back = Back(out, args.back.resolve()) if args.back and args.back.resolve() != out else None
    t_start = time.perf_counter()
    summary: dict = {"ok": None, "device": target.device, "gpus": target.gpus, "model_path": target.model_path,
                     "budget_s": args.budget_s, "plan": rows, "tolerances": {"/".join(k): v for k, v in RTOL.items()},
                     "steps": {}}

    def save() -> None:
        summary["wall_s"] = round(time.perf_counter() - t_start, 1)
        write_atomic(out / SUMMARY, json.dumps(summary, indent=2, default=str))
        if back:
            try:
                back.ship()
            except OSError as exc:  # the check goes on: everything stays in --out
                print(f"gpu_check: copying to {back.dest} failed ({exc}); everything is in {out}", flush=True)

    streams = sys.stdout, sys.stderr
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    runs: dict[str, dict] = {}
    code = None
    try:
        if back:
            back.clear()
            sys.stdout, sys.stderr = Tee(sys.stdout, out / LOG), Tee(sys.stderr, out / LOG)
        catch_signals()
        try:
            print_plan(rows, target, args.budget_s)
            summary["environment"] = environment()
            run_steps(steps, rows, target, out, args.budget_s, args.examples, summary, save, runs=runs)
        except Cut as cut:
            code = 128 + cut.signum
            summary.setdefault("cut", {"by": str(cut), "step": None, "finished": [
                n for n, s in summary["steps"].items() if "exit_code" in s]})
            print(f"gpu_check: {cut}: {summary['cut']['step'] or 'between steps'} cut; finished: "
                  f"{', '.join(summary['cut']['finished']) or 'none'}", flush=True)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the summary is written whole
        summary.update(coverage(runs, target, summary["steps"]))
        summary["skipped"] = [n for n, s in summary["steps"].items() if s.get("status") == "skipped"]
        summary["ok"] = all(s.get("ok") is not False for s in summary["steps"].values()) and any(
            s.get("ok") for s in summary["steps"].values())
        save()
        print(json.dumps({"ok": summary["ok"], "steps": {k: v.get("status") for k, v in summary["steps"].items()},
                          "skipped": summary["skipped"], "cut": summary.get("cut"), "wall_s": summary["wall_s"],
                          "summary": str(out / SUMMARY)}, indent=2), flush=True)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if back:
            try:  # last, and the one copy a signal may cut: caches and traces, which may be too large to come back
                names = back.ship(rest=True)
            except Cut as cut:
                code = code or 128 + cut.signum
                names = back.ship()
            print(f"gpu_check: {len(names)} files in {back.dest}; read {back.dest / SUMMARY} first, then "
                  f"{RESULTS_TAR}", flush=True)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if back:
            for stream in (sys.stdout, sys.stderr):
                stream.file.close()
        sys.stdout, sys.stderr = streams
    return code if code is not None else 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
