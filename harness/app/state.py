"""What the points of one invocation ended with: the exit status the CLI returns, and the latest point's folder.

Its own module so that harness/point/task.py and harness/app/callbacks.py (which record it) and
harness/__main__.py and harness/app/cli.py (which read it) import it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

# Exit status the CLI returns once every point ran: the worst seen.
EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR = 0, 1, 2


class RunState:
    """What the points of one invocation ended with (a multirun runs many in this process)."""

    def __init__(self) -> None:
        self.exit_code = EXIT_OK
        self.last_dir: Path | None = None  # the latest point's folder, for messages after an interrupt
        # A resumed multirun: the folders (names under the sweep folder) of the points this invocation lists,
        # set by the sweeper; None when every folder in the sweep is this invocation's.
        self.sweep_folders: set[str] | None = None

    def record(self, code: int) -> None:
        self.exit_code = max(self.exit_code, code)


# The one mutable global of a run, because Hydra hands nothing back: a task function's return value is
# dropped (and a multirun calls it once per point), and callbacks are built by Hydra from harness/conf/config.yaml.
# Written by run_point (harness/point/task.py) after every point and by ReportCallback.on_multirun_end
# (harness/app/callbacks.py: points a launcher ran in other processes), and by the sweeper (sweep_folders: which
# points a resumed sweep lists); read by __main__ for the exit status
# once Hydra returns, and by cli.interrupted_hint (last_dir) after a Ctrl-C has unwound Hydra.
STATE = RunState()
