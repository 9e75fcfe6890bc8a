"""One run of the standard commands per (backend, dtype, compiled), shared by every test module that reads it.

test_precision, test_compile and test_balance ask their questions of the same backends (each layout and pass type,
a second budget where compiled code is compared, the uneven plan in bf16); the eager runs are made once per test
session (under pytest -n, once for all workers), when first asked for.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from pathlib import Path
from typing import Optional

import numpy as np

from backends.messages import PassCommand, make_command
from backends.specs import BackendSpec, ModelSpec
from backends.start import make_backend
from harness.data.workload import make_examples

# 16 lengths, 64 to 288 tokens, chosen for compiled layers (test_compile): on 1 rank and on 2, at both budgets,
# every padded micro-batch holds 2 or 3 rows and the ranks' schedules are equally long (no one-token dummy); within
# the first budget's pass the padded batches' row counts and lengths vary, and so do the packed rows' sequence
# counts and tokens. Each compiled graph is therefore made symbolic in the first pass, the second budget compiles
# nothing, and no size-1 specialisation (a one-row batch) adds graphs: inductor code generation costs seconds per
# graph on 2 cores.
LENGTHS = [int(n) for n in np.random.RandomState(3).randint(64, 301, 16)]
EXAMPLES = make_examples(LENGTHS, 2048, seed=0)
BACKENDS = ("pytorch", "fsdp2", "megatron_ddp")
DTYPES = ("float32", "bfloat16")
# (planner, layout): the original procedure's padded rows and the balanced planner's packed rows
LAYOUTS = {"padded": ("greedy", "padded"), "packed": ("balanced", "packed")}
BUDGETS = (700, 600)  # the second budget makes rows of other lengths: compiled dynamic shapes must not compile again
# test_balance's plan built to be uneven, run by the eager bf16 runs after the standard commands: rank 0 runs two
# long sequences, rank 1 two short ones (a lock-step rank 1 waits at both steps, an independent one at the end);
# the one-process backend runs all four.
UNEVEN = make_examples([1500, 1400, 64, 64], 2048, seed=1)
UNEVEN_PLAN = {1: [[[0], [1], [2], [3]]], 2: [[[0], [1]], [[2], [3]]]}


PASS_TYPES = ("forward", "forward_backward")
# The (layout, pass type) pairs each in-process compiled cell runs, in order (test_compile's docstring says why
# these). The plain model's cell is test_compile's command-line sweep: pytorch float32, packed, both pass types.
COMPILED = {
    ("fsdp2", "bfloat16"): (("packed", "forward_backward"),),
    ("megatron_ddp", "bfloat16"): (("padded", "forward_backward"),),
}
COMPILED_CLI = {("pytorch", "float32"): (("packed", "forward"), ("packed", "forward_backward"))}
# Ranks of each in-process compiled cell: one. A wrapper's hooks and collectives run eagerly outside the compiled
# layer, so every rank compiles the same graphs, each of them (side by side: 181 core-seconds for fsdp2 bf16 on 2
# ranks, 116 on 1; megatron_ddp 241 and 153); a second rank adds its own copy of that work and records merged over
# ranks, which tests/unit/test_compiling.py checks on records of its own. Each cell is compared with its backend's
# eager run on 2 ranks.
COMPILED_RANKS = {("fsdp2", "bfloat16"): 1, ("megatron_ddp", "bfloat16"): 1}


def run_standard_commands(name: str, dtype: str, compile: bool) -> dict:
    """``{"built", "precision", (layout, budget, pass_type): PassResult}`` from one backend started for it.

    Eager: every layout and pass type at the first budget, and at the second the pairs compiled code is compared
    with there; in bf16 (the published precision, test_balance's) also ``"uneven"``, the uneven plan's
    forward+backward after a warm-up of its own. Compiled: the cell's pairs (``COMPILED``) at both budgets.
    """
    world = COMPILED_RANKS[name, dtype] if compile else None if name == "pytorch" else 2
    spec = BackendSpec(name=name, world_size=world, device="cpu", compile=compile)
    with make_backend(spec, ModelSpec(dtype=dtype)) as backend:
        out = {"built": backend.model_info, "precision": backend.precision, "world": backend.world_size}
        for budget in BUDGETS:
            for label, pass_type in cases(name, dtype, compile, budget):
                planner, layout = LAYOUTS[label]
                out[label, budget, pass_type] = backend.run_pass(
                    make_command(pass_type, EXAMPLES, budget, 1, layout=layout, planner=planner))
        if dtype == "bfloat16" and not compile:
            uneven = PassCommand("forward_backward", UNEVEN, None, 1, layout="packed",
                                 schedules=UNEVEN_PLAN[backend.world_size])
            backend.run_pass(uneven)  # a warm-up, as the harness does before it times anything
            out["uneven"] = backend.run_pass(uneven)
        return out


def cases(name: str, dtype: str, compile: bool, budget: int = BUDGETS[0]) -> list[tuple[str, str]]:
    """The (layout, pass type) pairs a run covers at ``budget``, in the order it runs them."""
    if compile:
        return list(COMPILED[name, dtype])
    if budget != BUDGETS[0]:  # only where compiled code is compared with this run
        return list(COMPILED.get((name, dtype)) or COMPILED_CLI.get((name, dtype)) or ())
    return [(label, p) for label in LAYOUTS for p in PASS_TYPES]


class BackendRuns(dict):
    """``runs[name, dtype, compiled]``: run on first use, then kept for the session (conftest's ``backend_runs``).

    With ``shared_dir`` (pytest -n: the folder every worker's temporary folders are in), a run is made once for
    all workers: the first to ask runs it under a lock of its own and writes it there, the others wait and read it.
    """

    def __init__(self, shared_dir: Optional[Path] = None):
        super().__init__()
        self.shared_dir = shared_dir

    def __missing__(self, key):
        self[key] = run_standard_commands(*key) if self.shared_dir is None else self._shared(key)
        return self[key]

    def _shared(self, key) -> dict:
        path = self.shared_dir / ("backend-run-" + "-".join(map(str, key)) + ".pickle")
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not path.exists():
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(pickle.dumps(run_standard_commands(*key)))
                os.replace(tmp, path)  # a worker that dies mid-run leaves no half-written run behind
            return pickle.loads(path.read_bytes())
