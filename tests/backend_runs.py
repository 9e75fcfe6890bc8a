"""One run of the standard commands per (backend, dtype, compiled), shared by every test module that reads it.

test_precision and test_compile ask the same questions of the same backends (each layout, two budgets, both
pass types); the eager runs they both compare against are run once per test session (under pytest -n, once for
all workers), when first asked for.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from pathlib import Path
from typing import Optional

import numpy as np

from backends.messages import make_command
from backends.specs import BackendSpec, ModelSpec
from backends.start import make_backend
from harness.workload import make_examples

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


PASS_TYPES = ("forward", "forward_backward")
# The (layout, pass type) pairs each compiled cell runs, in order (test_compile's docstring says why these). Eager
# runs run every pair.
COMPILED = {
    ("pytorch", "float32"): (("packed", "forward_backward"),),
    ("fsdp2", "bfloat16"): (("packed", "forward_backward"),),
    ("megatron_ddp", "bfloat16"): (("padded", "forward_backward"),),
}


def run_standard_commands(name: str, dtype: str, compile: bool) -> dict:
    """``{"built", "precision", (layout, budget, pass_type): PassResult}`` from one backend started for it.

    Eager: every layout and pass type. Compiled: the cell's pairs (``COMPILED``).
    """
    spec = BackendSpec(name=name, world_size=None if name == "pytorch" else 2, device="cpu", compile=compile)
    with make_backend(spec, ModelSpec(dtype=dtype)) as backend:
        out = {"built": backend.model_info, "precision": backend.precision}
        for label, pass_type in cases(name, dtype, compile):
            planner, layout = LAYOUTS[label]
            for budget in BUDGETS:
                out[label, budget, pass_type] = backend.run_pass(
                    make_command(pass_type, EXAMPLES, budget, 1, layout=layout, planner=planner))
        return out


def cases(name: str, dtype: str, compile: bool) -> list[tuple[str, str]]:
    """The (layout, pass type) pairs a run covers, in the order it runs them."""
    if compile:
        return list(COMPILED[name, dtype])
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
