"""``python -m harness.serve``: the live server (harness/server/serve.py), kept under the name its users type."""

from backends.runtime.collector import exit_with
from harness.server.serve import main

if __name__ == "__main__":
    exit_with(main())
