"""calibration.* set while cost_model=flops is refused in one line naming both (exit 2, before anything runs); with
cost_model=calibrated the same settings are taken, and a multirun's flops points carry the sweep's settings."""

from __future__ import annotations

import pytest

from backends.errors import UserError
from harness.app.config import resolve_config
from tests.conftest import compose_config, config_error


@pytest.mark.parametrize("override", ["calibration.repeat=5", "calibration.max_len=1024", "calibration.cache=false",
                                      "calibration.cache_dir=/tmp/fits", "calibration.warmup=0"])
def test_a_calibration_setting_beside_the_flop_model_is_one_line_naming_both(override):
    line = config_error(override)
    assert line is not None and "\n" not in line
    assert line.startswith(override + ":") and "cost_model=flops" in line and "cost_model=calibrated" in line
    assert config_error(override, "cost_model=calibrated") is None


def test_every_calibration_setting_given_is_named_and_defaults_are_not_refused():
    line = config_error("calibration.repeat=5", "calibration.max_len=2048")
    assert line.startswith("calibration.max_len=2048, calibration.repeat=5:") and line.endswith("drop them")
    assert config_error("calibration.repeat=3") is None  # the default: nothing set apart from it
    spec = resolve_config(compose_config("cost_model=calibrated", "calibration.repeat=5", "mtpm=4096"))
    assert spec.calibration.repeat == 5


def test_the_refusal_is_the_clis_exit_2(tmp_path):
    """The CLI's path for a config mistake: one line, exit 2, no torch imported (as for any config error)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import runpy, sys\nsys.argv = ['harness', *sys.argv[1:]]\ntry:\n    runpy.run_module('harness', "
            "run_name='__main__')\nexcept SystemExit as exc:\n    print('exit', exc.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code, "calibration.repeat=5", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "exit 2 False", proc.stdout + proc.stderr
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "calibration.repeat=5" in line]
    assert len(errors) == 1 and "cost_model=flops" in errors[0], proc.stdout + proc.stderr
    with pytest.raises(UserError, match="calibration.repeat=5"):
        resolve_config(compose_config("calibration.repeat=5"))
