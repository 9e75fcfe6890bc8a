"""The one error class the library shares with the harness (a mistake in what the user asked for), and the checks
of a count or a choice argument its entry points share."""

import numbers
from typing import Optional, Sequence


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
