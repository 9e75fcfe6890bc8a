"""Running a Hydra app so that a mistake in the command line is one line, not a traceback."""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from backends.errors import UserError
from harness.app.config import composition_error_line, register_configs


class StartRefused(BaseException):
    """A user error found in a Hydra callback before the run starts.

    Hydra turns an ``Exception`` raised in a callback into a warning and goes
    on, so this one derives from ``BaseException`` to stop the run.
    """


def run_hydra_cli(hydra_main: Callable[[], object], exit_code: Callable[[], int]) -> int:
    """Call a ``@hydra.main`` function; return 2 with one line on a config mistake, else ``exit_code()``."""
    register_configs()
    user_wants_trace = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Let composition errors reach this function so they print as one line; with
    # HYDRA_FULL_ERROR=1 set by the user they keep Hydra's full traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        hydra_main()
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted_hint()}", file=sys.stderr)
        return 130
    except StartRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException, ValueError, UserError) as exc:
        # ValueError: Hydra's own command-line usage errors (e.g. -m with --cfg);
        # UserError: the sweeper's checks of the sweep folder
        if user_wants_trace:
            raise
        line = composition_error_line(exc) if isinstance(exc, (HydraException, OmegaConfBaseException)) else str(exc)
        print(f"error: {line}", file=sys.stderr)
        return 2
    except OSError as exc:
        # Whatever the callbacks and the sweeper did not catch: Hydra writing its output folder or logs.
        if user_wants_trace:
            raise
        key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(sys.argv[1:]) else "hydra.run.dir"
        print(f"error: {key}: cannot write '{exc.filename or ''}' ({exc.strerror or exc}); choose a writable folder",
              file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        if not user_wants_trace:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    return exit_code()


def reaped(run: Callable[[], int]) -> int:
    """``run()``'s exit status, returned once every process it started has exited and been reaped (orphaned
    descendants included: this process is their subreaper)."""
    from backends.runtime.children import become_subreaper

    become_subreaper()
    try:
        return run()
    finally:
        end_children()


def end_children() -> None:
    """Before a CLI process exits: what it started ended and reaped, so that nothing it started outlives it.

    A hot sweep's backend is closed and W&B's service process stopped here, before the children are waited for:
    their own exit handlers would do both only after this (a no-op then)."""
    from backends.runtime.children import end_children as end_and_reap
    from harness.sweep.hot import HOT

    HOT.close()
    if "wandb" in sys.modules:
        from backends.runtime.memory import outside_the_data_limit

        try:
            with outside_the_data_limit():  # as every W&B call here (harness/point/tracking.py)
                sys.modules["wandb"].teardown()
        except Exception as exc:  # noqa: BLE001 - results.json holds everything; the wait below still ends it
            print(f"warning: W&B teardown failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    end_and_reap()


def _interrupt(signum, frame):
    """SIGTERM (a scheduler's pre-emption, kill) stops the run like Ctrl-C: workers stopped, results kept."""
    raise KeyboardInterrupt


def interrupted_hint() -> str:
    from harness.app.state import STATE

    last = STATE.last_dir
    if last is None:
        return "nothing was measured"
    sweep = last.parent
    if (sweep / "multirun.yaml").exists():
        return (f"finished points are kept in {sweep}; to continue, rerun the same command with "
                f"resume=true hydra.sweep.dir={sweep}")
    return f"what was measured is kept in {last}"
