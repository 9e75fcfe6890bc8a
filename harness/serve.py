"""``python -m harness.serve``: the live server (harness/server/serve.py), kept under the name its users type."""

import sys

from harness.server.serve import main

if __name__ == "__main__":
    sys.exit(main())
