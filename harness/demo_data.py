"""``python -m harness.demo_data OUT [--rows N]``: the offline demo dataset (harness/data/demo_data.py), kept under the
name its users type."""

import sys

from harness.data.demo_data import main

if __name__ == "__main__":
    sys.exit(main())
