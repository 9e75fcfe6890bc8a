"""The library's wheel, built from the checkout as a user would (``pip wheel --no-deps <checkout>``, offline): it
holds balance_batch alone, requires numpy alone, and its extras are lower bounds."""

import subprocess
import sys
import zipfile

from tests.conftest import REPO


def test_the_wheel_is_the_library_alone(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, timeout=120, capture_output=True)
    (wheel,) = tmp_path.glob("balance_batch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(info).decode()
        top = z.read(info.replace("METADATA", "top_level.txt")).decode().split()
    assert top == ["balance_batch"]
    assert {n.split("/")[0] for n in names} == {"balance_batch", info.split("/")[0]}
    assert "balance_batch/integrations/transformers/packing.py" in names
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    plain = [r for r in requires if "extra ==" not in r]
    assert plain == ["numpy>=1.26"]
    assert all("==" not in r.split(";")[0] for r in requires), requires  # no pins, extras included
    assert "Provides-Extra: transformers" in metadata and "Provides-Extra: trl" in metadata
