"""One run of the standard commands per (backend, dtype, compiled), shared by every test module that reads it.

test_precision and test_compile ask the same questions of the same backends (each layout, two budgets, both
pass types); the eager runs they both compare against are run once per test session, when first asked for.
"""

from __future__ import annotations

from backends.messages import make_command
from backends.specs import BackendSpec, ModelSpec
from backends.start import make_backend
from harness.workload import make_examples, mixed_lengths

EXAMPLES = make_examples(mixed_lengths(16, 64, 512, 42), 2048, seed=0)
BACKENDS = ("pytorch", "fsdp2", "megatron_ddp")
DTYPES = ("float32", "bfloat16")
# (planner, layout): the original procedure's padded rows and the balanced planner's packed rows
LAYOUTS = {"padded": ("greedy", "padded"), "packed": ("balanced", "packed")}
BUDGETS = (700, 500)  # the second budget makes rows of other lengths: compiled dynamic shapes must not compile again


def run_standard_commands(name: str, dtype: str, compile: bool) -> dict:
    """``{"built", "precision", (layout, budget, pass_type): PassResult}`` from one backend started for it."""
    spec = BackendSpec(name=name, world_size=None if name == "pytorch" else 2, device="cpu", compile=compile)
    with make_backend(spec, ModelSpec(dtype=dtype)) as backend:
        out = {"built": backend.model_info, "precision": backend.precision}
        for label, (planner, layout) in LAYOUTS.items():
            for budget in BUDGETS:
                for pass_type in ("forward", "forward_backward"):
                    out[label, budget, pass_type] = backend.run_pass(
                        make_command(pass_type, EXAMPLES, budget, 1, layout=layout, planner=planner))
        return out


class BackendRuns(dict):
    """``runs[name, dtype, compiled]``: run on first use, then kept for the session (conftest's ``backend_runs``)."""

    def __missing__(self, key):
        self[key] = run_standard_commands(*key)
        return self[key]
