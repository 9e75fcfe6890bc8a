"""How a point fails: one line on the console, the status and the message in results.json, the traceback or a
backend's details in error.txt; the exit code the CLI reports (running out of memory is a result, not a failure)."""

from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path
from typing import Optional

from backends.errors import BackendError, UserError
from harness.app.roles import tell_launcher
from harness.app.state import EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR
from harness.point.results import RESULTS_FILE, SNAPSHOT_DIR, PointResults

log = logging.getLogger("harness")


def user_error(results: PointResults, exc: UserError) -> int:
    log.error("%s", exc)
    tell_launcher(str(exc))
    results.fail("error", str(exc))
    return EXIT_USER_ERROR


def backend_failed(results: PointResults, out_dir: Path, label: str, exc: BackendError, hot: bool) -> int:
    if hot:
        from harness.sweep.hot import HOT

        HOT.close()  # its workers are gone; the next point loads a fresh one
    log.error("%s%s", label, exc)
    if exc.status != "oom":
        tell_launcher(f"{label}{exc}")
    if exc.details:
        (out_dir / "error.txt").write_text(exc.details)
    # bench.memory_snapshot: what held the memory
    snapshots = sorted((out_dir / SNAPSHOT_DIR).glob("*.pickle"))
    if snapshots:
        results.update(memory_snapshot=[os.path.relpath(p, out_dir) for p in snapshots])
    results.fail(exc.status, str(exc))
    # Running out of memory is a measurement (this budget does not fit), not a failure.
    return EXIT_OK if exc.status == "oom" else EXIT_FAILED


def interrupted(results: PointResults, out_dir: Path, label: str) -> None:
    log.error("%sinterrupted; finished passes are kept in %s", label, out_dir / RESULTS_FILE)
    results.fail("interrupted", "interrupted (Ctrl-C or SIGTERM) before the point finished")


def in_process_out_of_memory(cfg, exc: Exception) -> Optional[BackendError]:
    """An in-process backend's (pytorch's) bench.memory_limit_gb holds the harness's own process: an allocation, or
    a thread (the samplers' stacks), refused there is the limit, status oom as any backend's; None for anything
    else."""
    from omegaconf import OmegaConf

    from backends.errors import first_line
    from backends.registry import is_distributed
    from backends.runtime.memory import is_out_of_memory, is_thread_start_failure

    limit_gb = OmegaConf.select(cfg, "bench.memory_limit_gb", default=None, throw_on_resolution_failure=False)
    backend = OmegaConf.select(cfg, "backend.name", default=None, throw_on_resolution_failure=False)
    in_process = backend is not None and not is_distributed(backend)
    if limit_gb is None or not in_process or not (is_out_of_memory(exc) or is_thread_start_failure(exc)):
        return None
    return BackendError(f"out of memory in the harness's process, which the pytorch backend shares "
                        f"(bench.memory_limit_gb={limit_gb:g}): {first_line(str(exc), 200) or type(exc).__name__}",
                        details=traceback.format_exc(), status="oom")


def internal_error(results: PointResults, out_dir: Path, label: str, exc: Exception) -> int:
    """An internal failure: one line on the console, the traceback in the log and in error.txt."""
    log.error("%s%s: %s", label, type(exc).__name__, exc)
    log.debug("%s", traceback.format_exc())
    (out_dir / "error.txt").write_text(traceback.format_exc())
    results.fail("error", f"{type(exc).__name__}: {exc}")
    return EXIT_FAILED
