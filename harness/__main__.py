"""``python -m harness``: the benchmark, a Hydra app over conf/."""

from __future__ import annotations

import os
import sys

import hydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from harness.app import STATE, config_error_line, run_point
from harness.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> int:
    return run_point(cfg)


def composition_error_line(exc: BaseException) -> str:
    """One line for a Hydra composition error, naming the key (or the group and its valid options)."""
    if isinstance(exc, MissingConfigException) and exc.options:
        group = os.path.dirname(exc.missing_cfg_file or "") or "config"
        name = os.path.basename(exc.missing_cfg_file or "")
        return f"{group}: '{name}' is not an option (valid: {', '.join(sorted(exc.options))})"
    cause = exc.__cause__
    first = str(exc).splitlines()[0].strip() if str(exc).strip() else type(exc).__name__
    override = getattr(exc, "override", None) or _override_in(first)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = getattr(cause, "full_key", None) or "?"
        return f"{key}: not a config key{f' (from {override})' if override else ''}; `python -m harness --cfg job` lists them"
    if isinstance(cause, OmegaConfBaseException):
        return config_error_line(cause) + (f" (from {override})" if override else "")
    return first


def _override_in(message: str) -> str:
    for prefix in ("Error merging override ", "Could not override "):
        if message.startswith(prefix):
            return message[len(prefix) :].strip(" .'")
    return ""


def main() -> int:
    user_wants_trace = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Let composition errors reach this function so they print as one line; with
    # HYDRA_FULL_ERROR=1 set by the user they keep Hydra's full traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except (HydraException, OmegaConfBaseException) as exc:
        if user_wants_trace:
            raise
        print(f"error: {composition_error_line(exc)}", file=sys.stderr)
        return 2
    finally:
        if not user_wants_trace:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    return STATE.exit_code


if __name__ == "__main__":
    sys.exit(main())
