"""Lengths files: a corpus's sequence lengths as UTF-8 text, one length per line or ``length,count`` lines (a
histogram). What ``python -m balance_batch.pack`` packs (and the harness's ``workload=lengths_file`` draws from); a
mistake is a UserError naming the file, the line and what is valid."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from balance_batch.errors import UserError
from balance_batch.textfile import utf8_text

# A length (or a count) is plain ASCII digits, with an optional sign: int() alone also takes 1_000 and
# full-width or other Unicode digits, which a lengths file written by a script never means.
_LENGTH = re.compile(r"[+-]?[0-9]+")
# The optional first line of a histogram file, as a spreadsheet or pandas writes it.
_HEADER = re.compile(r"length\s*,\s*count", re.IGNORECASE)
# The longest sequence a workload may hold: 16,777,216 tokens (a million-token context and then some). Its token ids
# alone are built in memory at 8 bytes a token, so a length of 10**11 (a typo) asked for 745 GiB and failed as an
# out of memory, where the file's line is the mistake.
MAX_LENGTH = 2**24
PLAIN, HISTOGRAM = "lengths", "histogram"  # LengthsFile.format: one length per line, or length,count lines
_FORMAT_WORDS = {PLAIN: "one length per line", HISTOGRAM: "length,count lines"}


@dataclass(frozen=True)
class LengthsFile:
    """What a lengths file holds: each line's length and how many sequences have it (1 on every line of a plain file).

    A histogram keeps its lines as they are (a corpus of millions of sequences
    is a few hundred of them); nothing is expanded until a workload is drawn.
    """

    path: str
    format: str  # PLAIN (one length per line) or HISTOGRAM (length,count lines)
    lengths: np.ndarray  # int64, one per data line, in file order
    counts: np.ndarray  # int64, one per data line: how many sequences have that length

    @property
    def sequences(self) -> int:
        """Sequences in the file: the sum of the counts."""
        return int(self.counts.sum())

    @property
    def distinct_lengths(self) -> int:
        return int(np.unique(self.lengths).size)

    def expanded(self) -> np.ndarray:
        """Every sequence's length, in file order (a histogram's line repeated count times)."""
        return np.repeat(self.lengths, self.counts)

    def sample(self, n: int, seed: int) -> np.ndarray:
        """``n`` lengths drawn with replacement, each line weighted by its count: numpy's default_rng(``seed``).

        Integer draws over the cumulative counts rather than float probabilities,
        so a weight is exact for any total and the draw is the same on every machine.
        """
        rng = np.random.default_rng(seed)
        ends = np.cumsum(self.counts)
        return self.lengths[np.searchsorted(ends, rng.integers(0, int(ends[-1]), size=n), side="right")]

    def shuffled(self, seed: int) -> np.ndarray:
        """Every sequence once, in an order drawn with default_rng(``seed``) (not the sorted order a histogram
        lists)."""
        return np.random.default_rng(seed).permutation(self.expanded())


def _file_text(p: Path) -> str:
    """The file's text, or a UserError naming the path: a folder, no file, unreadable, not UTF-8 (a BOM is skipped)."""
    expected = "expected a text file with one sequence length per line, or length,count lines"
    if p.is_dir():
        raise UserError(f"'{p}' is a folder, not a file ({expected})")
    if not p.is_file():
        raise UserError(f"no such file '{p}' ({expected})")
    return utf8_text(p, f"{expected}, in ASCII digits")


def _positive(where: str, what: str, text: str, needs: str, empty_ok: bool = False) -> int:
    """``text`` as a positive integer (a length of 0 too, with ``empty_ok``), or a UserError: ``where`` (path:line),
    ``what`` (length, count), ``needs`` (why > 0)."""
    if not _LENGTH.fullmatch(text):
        pair = "a length of 0 or more and a positive count" if empty_ok else "two positive integers"
        raise UserError(f"{where}: {what} {text!r} is not an integer "
                        f"(expected length,count lines of {pair}, in ASCII digits 0-9)")
    n = int(text)
    if what == "length":
        _check_length(where, n, empty_ok)
    elif n <= 0:
        raise UserError(f"{where}: {what} {n} is not positive ({needs})")
    return n


def _check_length(where: str, n: int, empty_ok: bool = False) -> None:
    """A length in range, or a UserError naming ``where`` (path:line) and the valid range: 1.., or with ``empty_ok``
    0.. (a sequence of no tokens)."""
    if n < 0 and empty_ok:
        raise UserError(f"{where}: length {n} is negative (valid: 0..{MAX_LENGTH:,} tokens; 0 is a "
                        "sequence of no tokens)")
    if n <= 0 and not empty_ok:
        raise UserError(f"{where}: length {n} is not positive (every sequence needs at least 1 token)")
    if n > MAX_LENGTH:
        raise UserError(f"{where}: length {n:,} is longer than any workload may hold (valid: "
                        f"{0 if empty_ok else 1}..{MAX_LENGTH:,} tokens)")


def load_lengths_file(path: str, empty_ok: bool = False, key: str = "") -> LengthsFile:
    """A lengths file: UTF-8 text, either one positive length per line or ``length,count`` lines (a histogram).

    Blank lines and ``#`` comments are skipped, spaces around a value or the comma
    are fine, and a histogram may start with the header ``length,count``. The
    first data line decides the format; a line of the other format, or of
    neither, is a UserError naming the path, the line and what the file is read as.
    ``empty_ok`` takes a length of 0 too (a sequence of no tokens, which ``balance_batch.pack`` places in no row);
    a workload refuses it, since every sequence it draws runs through the model. ``key``: the setting that named
    the file, put before each message (the harness's ``workload.path``).
    """
    try:
        return _load(path, empty_ok)
    except UserError as exc:
        if key:
            raise UserError(f"{key}: {exc}") from None
        raise


def _load(path: str, empty_ok: bool) -> LengthsFile:
    word = "non-negative" if empty_ok else "positive"
    p = Path(path).expanduser()
    text = _file_text(p)
    fmt: Optional[str] = None
    decided = ""  # what decided the format, for the message of a line that does not fit it
    lengths: list[int] = []
    counts: list[int] = []
    for lineno, raw in enumerate(text.split("\n"), start=1):  # not splitlines(): U+2028 in a comment ends no line
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{p}:{lineno}"
        if fmt is None and _HEADER.fullmatch(line):
            fmt, decided = HISTOGRAM, f"its header on line {lineno} says"
            continue
        kind = HISTOGRAM if "," in line else PLAIN
        if fmt is None:
            fmt, decided = kind, f"line {lineno} is"
        elif kind != fmt:
            found = "has a comma (length,count)" if kind == HISTOGRAM else "has no count (length,count)"
            raise UserError(
                f"{where}: {line!r} {found} in a file of {_FORMAT_WORDS[fmt]} (as {decided}); "
                "a file is all one length per line or all length,count lines"
            )
        if kind == PLAIN:
            if not _LENGTH.fullmatch(line):
                expected = (f"one {word} length per line, in ASCII digits 0-9, or length,count lines"
                            if decided == f"line {lineno} is"  # the first data line: either format would do
                            else f"a {word} length in ASCII digits 0-9: this file is one length per line, as "
                                 f"{decided}")
                raise UserError(f"{where}: {line!r} is not an integer (expected {expected})")
            n = int(line)
            _check_length(where, n, empty_ok)
            lengths.append(n)
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            raise UserError(f"{where}: {line!r} has {len(fields)} fields (expected length,count: "
                            + ("a length of 0 or more and a positive count)" if empty_ok else "two positive integers)"))
        lengths.append(_positive(where, "length", fields[0], "every sequence needs at least 1 token", empty_ok))
        counts.append(_positive(where, "count", fields[1],
                                "a count says how many sequences have that length: at least 1"))
    if not lengths:
        raise UserError(f"{p} holds no lengths (expected one {word} integer per line, or length,count "
                        "lines)")
    ones = np.ones(len(lengths), dtype=np.int64)
    return LengthsFile(str(p), fmt, np.asarray(lengths, dtype=np.int64),
                       np.asarray(counts, dtype=np.int64) if fmt == HISTOGRAM else ones)


def read_lengths_file(path: str, key: str = "") -> list[int]:
    """Every sequence length a lengths file holds, in file order (a histogram's lines expanded as listed)."""
    return load_lengths_file(path, key=key).expanded().tolist()
