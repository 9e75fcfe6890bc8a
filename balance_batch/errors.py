"""The one error class the library shares with the harness (a mistake in what the user asked for), and the checks
of a count, a choice or the lengths its entry points share."""

import numbers
from typing import Optional, Sequence

import numpy as np


class UserError(Exception):
    """A mistake in what the user asked for: a config value, a path, a request.

    The message names the key (or path) and says what would be valid; the harness reports it as one line (exit 2).
    """


def positive_int(key: str, value, none_ok: bool = False, who: str = "") -> Optional[int]:
    """``value`` as an int, or one ValueError naming ``key`` (and ``who`` takes it, e.g. ``pack``); None passes where
    ``none_ok``. A bool is no count."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        named = f"{who}: {key}" if who else f"{key}:"
        raise ValueError(f"{named} must be a positive integer{' or None' if none_ok else ''}, got {value!r}")
    return int(value)


def check_choice(key: str, value: str, valid: Sequence[str], who: str = "") -> None:
    """One ValueError naming ``key`` (and ``who`` takes it) unless ``value`` is one of ``valid``."""
    if value not in valid:
        named = f"{who}: {key}" if who else key
        raise ValueError(f"{named} must be one of {', '.join(valid)}, got {value!r}")


def checked_lengths(lengths, who: str = "") -> np.ndarray:
    """``lengths`` as a flat int64 array of token counts (0 or more; floats that are whole numbers taken), or one
    ValueError naming ``who`` takes them and the first thing wrong."""
    lead = f"{who}: lengths" if who else "lengths"
    valid = "a flat sequence of token counts, integers 0 or more"
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{lead} must be {valid} ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{lead} must be {valid}, got an array of shape {arr.shape}")
    whole = arr.dtype.kind in "iu" or (arr.dtype.kind == "f" and bool(np.all(np.mod(arr, 1) == 0)))
    if arr.size and not whole:
        raise ValueError(f"{lead} must be {valid}, got {shown(lengths)}")
    arr = arr.astype(np.int64)
    if arr.size and int(arr.min()) < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{lead}[{i}] = {int(arr[i])}: a length is a count of tokens, 0 or more")
    return arr


def checked_loss_tokens(loss_tokens, lengths: np.ndarray, who: str = "") -> np.ndarray:
    """Per sequence, the tokens its loss counts, as int64 (an integer in [0, its length] each), or one ValueError
    naming ``who`` takes them and the first count out of range."""
    key = f"{who}: loss_tokens_per_sequence" if who else "loss_tokens_per_sequence"
    arr = np.asarray(loss_tokens)
    if arr.ndim != 1 or len(arr) != len(lengths) or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{key}: must be one integer per sequence ({len(lengths)}), got {shown(loss_tokens)}")
    bad = np.flatnonzero((arr < 0) | (arr > lengths))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{key}: each count must be between 0 and its sequence's length; "
                         f"loss_tokens_per_sequence[{i}] is {int(arr[i])} for a length of {int(lengths[i])}")
    return arr.astype(np.int64)


def shown(value) -> str:
    """``value`` as a message shows it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
