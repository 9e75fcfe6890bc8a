"""Reading a user's text file: one UserError line for a file that cannot be read or is not UTF-8."""

from __future__ import annotations

from pathlib import Path

from balance_batch.errors import UserError


def utf8_text(p: Path, expected: str, key: str = "") -> str:
    """A file's text, or a UserError naming the path (after ``key``, the setting that named it, where given):
    unreadable, or not UTF-8 (the byte, its line, ``expected``); a byte-order mark is skipped."""
    lead = f"{key}: " if key else ""
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise UserError(f"{lead}cannot read '{p}' ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{lead}{p} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {lineno}; "
                        f"{expected})") from None
