"""A checkpoint directory, checked before it is measured: its config, its weight files, and that they are the model's
weights.

``check_checkpoint`` is what the harness and the server run (through
``build.model_vocab_size``) before any process is started or any weight read:

- config.json parses (``configs.read_json_file``) and transformers knows its architecture;
- the weight files transformers would read are there, and their headers parse
  (safetensors: the header only; ``.bin``: the pickle, onto the meta device);
- the headers hold exactly the model's weights. transformers' own loading runs
  on meta tensors made from the headers (nothing is read or allocated), so its
  renames, fused experts and the keys each model ignores (Qwen3.5's ``mtp.*``,
  a vision tower) count as they do in a real load. A weight the model has and
  the files lack would run randomly initialised; one the files hold and the
  model lacks would be dropped. Either is refused in one line, unless
  ``model.allow_missing_weights=true``, and then listed in results.json.

``build_model``'s real load asks transformers for the same keys again
(``weights_loaded``), on every process that reads the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Optional

from backends.errors import UserError, first_line
from backends.model.configs import check_model_spec, read_json_file
from backends.specs import ModelSpec

log = logging.getLogger(__name__)

# The one model built in code; every other model name is a checkpoint read from model.path.
TINY_MODEL_NAME = "tiny"

# transformers' file names, in the order it looks for them in a local directory.
SAFE, SAFE_INDEX, BIN, BIN_INDEX = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
SHOWN_KEYS = 3  # weight names quoted in a one-line error


def check_model_path(spec: ModelSpec) -> Optional[Path]:
    """The checkpoint directory, checked before any process is started; None for the tiny model."""
    check_model_spec(spec)  # model.vocab_size with a checkpoint
    if spec.path is None:
        if spec.name != TINY_MODEL_NAME:
            # Building the tiny model here would run a random toy labelled as this model.
            raise UserError(
                f"model.path: model '{spec.name}' needs a local checkpoint directory (model.path=/path/to/checkpoint); "
                f"null builds the tiny random model, which only model={TINY_MODEL_NAME} may do"
            )
        return None
    path = Path(os.path.expanduser(str(spec.path)))
    if not (path / "config.json").is_file():
        raise UserError(
            f"model.path: '{path}' is not a local checkpoint directory (expected config.json and weights there; "
            "nothing is downloaded at run time)"
        )
    return path


def read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict (one line naming the file when it is not one)."""
    return read_json_file(path / "config.json", "a checkpoint's config.json")


def load_config(path: Path, **kwargs):
    """transformers' config of the checkpoint, or one line naming config.json and what transformers makes of it."""
    from transformers import AutoConfig

    read_config(path)  # a file that is not JSON is named here, not as transformers' OSError
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"model.path: transformers cannot read {path / 'config.json'} "
                        f"({type(exc).__name__}: {first_line(str(exc), 300)})") from None


def weight_files(path: Path) -> list[Path]:
    """The files transformers would read the weights from, each there (sharded: every shard its index names)."""
    explicit = read_config(path).get("transformers_weights")
    for name in [explicit] if isinstance(explicit, str) else [SAFE, SAFE_INDEX, BIN, BIN_INDEX]:
        file = path / name
        if not file.is_file():
            continue
        if not name.endswith(".index.json"):
            return [file]
        weight_map = read_json_file(file, "a sharded checkpoint's index").get("weight_map")
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())
        ):
            raise UserError(f"model.path: {file} has no weight_map from tensor names to files "
                            "(as save_pretrained writes it)")
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not (path / n).is_file()]
        if absent:
            raise UserError(f"model.path: {file} names {len(absent)} weight file(s) not in {path}: {_some(absent)} "
                            "(a copy or download that did not finish?)")
        return [path / n for n in names]
    expected = explicit if isinstance(explicit, str) else f"{SAFE}, or {SAFE_INDEX} and its shards, or {BIN}"
    raise UserError(f"model.path: '{path}' holds config.json but no weights (expected {expected})")


def check_weight_files(path: Path) -> list[Path]:
    """``weight_files``, each header read (no weight): a corrupt or truncated file is one line naming it."""
    files = weight_files(path)
    _weight_shapes(files)
    return files


def _weight_shapes(files: list[Path]) -> dict:
    """Every tensor of the files as a meta tensor of its shape and dtype, from the headers alone."""
    from transformers.modeling_utils import load_state_dict

    shapes: dict = {}
    for file in files:
        kind = "safetensors" if file.name.endswith(".safetensors") else "PyTorch weights"
        try:
            shapes.update(load_state_dict(str(file), map_location="meta"))
        except Exception as exc:  # noqa: BLE001 - whatever the reader says, it is this file that cannot be read
            reason = first_line(str(exc), 200).removeprefix("Error while deserializing header: ") or type(exc).__name__
            hint = ""
            if any(
                s in reason for s in ("incomplete metadata", "header too small", "failed finding central directory")
            ):
                hint = ": the file is shorter than it says, a copy or download that did not finish?"
            raise UserError(f"model.path: {file} is not a readable {kind} file ({reason}{hint})") from None
    return shapes


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load report and progress bar off: a check that reads no weight should not look like a load."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _key_report(path: Path, files: list[Path]) -> Optional[tuple[list[str], list[str]]]:
    """(missing, unexpected) weight names, as transformers' own load of these files would find them; nothing is read.

    None when they cannot be told here (a quantized checkpoint, or transformers failing on meta tensors):
    then the real load's own report (``weights_loaded`` in ``build_model``) is the check. A check that
    runs ahead of the load must never refuse what would load.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = load_config(path)
    shapes = _weight_shapes(files)
    try:
        with _quiet_transformers(), torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config)  # the class and config a real load would use
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"model.path: transformers cannot build a causal LM from {path / 'config.json'} "
                        f"({type(exc).__name__}: {first_line(str(exc), 300)})") from None
    if getattr(shell.config, "quantization_config", None) is not None:
        log.debug("model.path: %s is quantized; its weight names are checked by the load itself", path)
        return None
    try:
        with _quiet_transformers():
            # mismatched sizes reported here rather than raised, so the error can name them
            _, info = type(shell).from_pretrained(None, config=shell.config, state_dict=shapes, device_map="meta",
                                                  output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as exc:  # noqa: BLE001 - see the docstring: the load checks what this cannot
        log.warning("model.path: the weight names in %s could not be checked before loading (%s: %s); "
                    "the load checks them", path, type(exc).__name__, first_line(str(exc), 200))
        return None
    mismatched = sorted(info["mismatched_keys"])
    if mismatched:  # a weight of another shape than the config says: never measured, allowed or not
        shown = ", ".join(f"{name} {tuple(got)} in the files, {tuple(want)} in the model"
                          for name, got, want in mismatched[:SHOWN_KEYS])
        more = f" and {len(mismatched) - SHOWN_KEYS} more" if len(mismatched) > SHOWN_KEYS else ""
        raise UserError(f"model.path: the weights in {path} do not fit its config.json: {len(mismatched)} of another "
                        f"shape ({shown}{more}); the config and the weights are of different models")
    return sorted(info["missing_keys"]), sorted(info["unexpected_keys"])


_checked: dict[tuple, Optional[tuple[list[str], list[str]]]] = {}


def check_checkpoint(spec: ModelSpec) -> Optional[Path]:
    """The checkpoint directory, with its config, files and weight names checked (see the module); None for the tiny
    model.

    Cheap to call again (a hot sweep calls it per point): the key report is
    kept per directory while none of its files changes.
    """
    path = check_model_path(spec)
    if path is None:
        return None
    files = weight_files(path)
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in [path / "config.json", *files])
    if stamp not in _checked:
        _checked.clear()
        _checked[stamp] = _key_report(path, files)
    if _checked[stamp] is not None:
        weights_loaded(spec, *_checked[stamp])
    return path


def _some(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN_KEYS} more" if len(names) > SHOWN_KEYS else ""
    return ", ".join(names[:SHOWN_KEYS]) + more


def weights_loaded(spec: ModelSpec, missing: list[str], unexpected: list[str],
                   level: int = logging.WARNING) -> dict[str, list[str]]:
    """What a checkpoint's load left out: refused in one line, or (``model.allow_missing_weights``) logged and returned.

    The record is results.json's ``model.built.missing_weights`` and ``unexpected_weights``. ``level``: the
    allowed case's log line (the check before start-up warns once; each load after it, where transformers
    prints its own table, logs at debug).
    """
    missing, unexpected = sorted(missing), sorted(unexpected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's weights missing ({_some(missing)}), "
                         "which would run randomly initialised")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({_some(unexpected)}), which the model has no place for")
        what = f"the weights in {spec.path} do not match its config.json: " + "; ".join(parts)
        if not spec.allow_missing_weights:
            raise UserError(f"model.path: {what}; use a complete checkpoint, or model.allow_missing_weights=true "
                            "to measure it anyway (results.json then lists them under model.built)")
        log.log(
            level, "%s (model.allow_missing_weights=true: measured anyway, listed in results.json model.built)", what
        )
    return {"missing_weights": missing, "unexpected_weights": unexpected}
