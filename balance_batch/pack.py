"""``python -m balance_batch.pack LENGTHS --capacity N``: pack a corpus on disk into rows a training loop reads.

LENGTHS is a lengths file (text: one length per line, or ``length,count`` lines, as ``workload=lengths_file``
reads), a ``.npy`` array of lengths, or a tokenized dataset cache (``.npz`` with ``offsets``, as
``workload=dataset`` writes under ``workload.cache_dir``). The rows go to ``--out`` (an ``.npz``; default: beside
LENGTHS, its whole name and ``.packed<N>.npz``, or ``.wrapped<N>.npz`` with ``--strategy wrapped``, so ``x.txt``
and ``x.npy`` never write the same file), written atomically, as the arrays ``balance_batch.pack`` returns:

    z = np.load("corpus.csv.packed512.npz")
    indices, offsets = z["indices"], z["offsets"]   # row r: indices[offsets[r]:offsets[r + 1]]

plus ``capacity``, ``empty`` (the 0-token sequences, in no row) and ``truncated``, and, where rows hold pieces of
sequences (``--oversize truncate|split``, ``--strategy wrapped``), ``piece_starts`` and ``piece_lengths``.

A length of 0 is a sequence of no tokens in every input, as in ``balance_batch.pack``: it keeps its index and goes
in ``empty`` (a lengths file may hold one here, where ``workload=lengths_file`` refuses it: a workload runs every
sequence it draws through the model). A negative length is refused, naming the file and its line or index.

A line on stderr per stage (reading, packing, writing), and a last line on stdout with the rows, the packing's
share of the lower bound, its efficiency and the time it took. A mistake (no such file, a folder, a bad capacity,
a negative length, a length over the capacity with ``--oversize error``, an ``--out`` not ending in ``.npz``) is one
line and exit 2.

The function is ``balance_batch.pack`` (``balance_batch/corpus.py``); import this module only to run it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zipfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from balance_batch.corpus import OVERSIZE, STRATEGIES, Packing, pack
from balance_batch.errors import UserError
from balance_batch.lengths import load_lengths_file

PROG = "python -m balance_batch.pack"


class _Refused(Exception):
    """A mistake in the command: one line, exit 2."""


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def read_lengths(path: Path) -> np.ndarray:
    """Every sequence's length, in corpus order, from a text lengths file, a .npy array or a tokenized cache."""
    if path.is_dir():
        raise _Refused(f"'{path}' is a folder, not a file (expected a lengths file, a .npy array or a tokenized "
                       "cache .npz)")
    if not path.is_file():
        raise _Refused(f"no such file '{path}' (expected a lengths file, a .npy array or a tokenized cache .npz)")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise _Refused(f"'{path}' is not a readable .npy array ({exc})") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise _Refused(f"'{path}' holds a {arr.dtype} array of shape {arr.shape} (expected one integer length "
                           "per sequence)")
        arr = arr.astype(np.int64, copy=False)
        if arr.size and int(arr.min()) < 0:
            i = int(np.argmax(arr < 0))
            raise _Refused(f"{path}: lengths[{i}] = {int(arr[i])} is negative (valid: 0 or more tokens; 0 is a "
                           "sequence of no tokens)")
        return arr
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                if "offsets" not in z.files:
                    raise _Refused(f"'{path}' has no 'offsets' array (expected a tokenized dataset cache, as "
                                   "workload=dataset writes)")
                offsets = z["offsets"].astype(np.int64)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise _Refused(f"'{path}' is not a readable .npz file ({exc})") from None
        lengths = np.diff(offsets)
        if lengths.size and int(lengths.min()) < 0:
            i = int(np.argmax(lengths < 0))
            raise _Refused(f"{path}: offsets[{i + 1}] = {int(offsets[i + 1])} is below offsets[{i}] = "
                           f"{int(offsets[i])}, a negative length for sequence {i} (valid: offsets that never "
                           "decrease)")
        return lengths
    try:
        return load_lengths_file(str(path), empty_ok=True).expanded()
    except UserError as exc:
        raise _Refused(str(exc)) from None


def default_out(path: Path, capacity: int, strategy: str = "bfd") -> Path:
    """Beside the input, its whole name kept (``x.txt`` and ``x.npy`` pack to different files)."""
    return path.with_name(f"{path.name}.{'wrapped' if strategy == 'wrapped' else 'packed'}{capacity}.npz")


def check_out(out: Path) -> None:
    """An .npz file name in an existing folder: the rows are several arrays, which a .npy cannot hold."""
    if out.suffix != ".npz":
        raise _Refused(f"--out: '{out}' must end in .npz (the rows are several arrays: indices, offsets, ...)")
    if out.is_dir():
        raise _Refused(f"--out: '{out}' is a folder (expected a file name ending in .npz)")
    if not out.parent.is_dir():
        raise _Refused(f"--out: no folder '{out.parent}' to write '{out.name}' in")


def write_rows(out: Path, packing: Packing) -> None:
    """The rows as an .npz (indices, offsets, capacity, empty, truncated, and the pieces where there are some),
    written to a temporary name and renamed into place."""
    arrays = dict(indices=packing.indices, offsets=packing.offsets, capacity=np.int64(packing.capacity),
                  empty=packing.empty, truncated=packing.truncated)
    if packing.piece_starts is not None:
        arrays.update(piece_starts=packing.piece_starts, piece_lengths=packing.piece_lengths)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True) if tmp.parent.is_dir() else None
        raise _Refused(f"--out: cannot write '{out}' ({exc.strerror or exc})") from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (expected a positive number)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not positive (expected a positive number)")
    return n


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse would print the usage first)
        self.exit(2, f"{PROG}: {message} (see --help)\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _Parser(prog=PROG, description="Pack a corpus into rows of at most --capacity tokens.")
    parser.add_argument("lengths", type=Path, help="a lengths file, a .npy array of lengths or a tokenized cache .npz")
    parser.add_argument("--capacity", type=_positive, required=True, help="tokens per row")
    parser.add_argument("--max-seqs-per-row", type=_positive, default=None, help="sequences per row, at most")
    parser.add_argument("--oversize", choices=OVERSIZE, default=None,
                        help="a sequence over the capacity: a row of its own (alone, the default), refused (error), "
                        "cut to the capacity (truncate) or packed in pieces of the capacity (split)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="bfd",
                        help="best-fit decreasing (bfd, the default) or every sequence end to end, cut into rows of "
                        "exactly --capacity tokens (wrapped)")
    parser.add_argument("--out", type=Path, default=None, help="where the rows go, an .npz (default: beside LENGTHS)")
    args = parser.parse_args(argv)
    try:
        if args.lengths.is_dir():
            raise _Refused(f"'{args.lengths}' is a folder, not a file (expected a lengths file, a .npy array or a "
                           "tokenized cache .npz)")
        out = args.out or default_out(args.lengths, args.capacity, args.strategy)
        check_out(out)
        options = dict(max_seqs_per_row=args.max_seqs_per_row, oversize=args.oversize, strategy=args.strategy)
        try:
            pack([], args.capacity, **options)  # options that contradict each other, before a corpus is read
        except ValueError as exc:
            raise _Refused(_as_options(str(exc).removeprefix("pack: "))) from None
        t0 = time.perf_counter()
        _say(f"reading {args.lengths} ...")
        lengths = read_lengths(args.lengths)
        _say(f"read {lengths.size:,} lengths ({int(lengths.sum()):,} tokens) in {time.perf_counter() - t0:.2f} s; "
             f"packing into rows of {args.capacity:,} ...")
        t1 = time.perf_counter()
        try:
            packing = pack(lengths, args.capacity, **options)
        except ValueError as exc:
            raise _Refused(_as_options(str(exc).removeprefix("pack: "))) from None
        packed_s = time.perf_counter() - t1
        _say(f"packed in {packed_s:.2f} s; writing {out} ...")
        write_rows(out, packing)
    except _Refused as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    aside = "".join(f", {a.size:,} {what}" for a, what in ((packing.empty, "empty (in no row)"),
                                                           (packing.truncated, "truncated")) if a.size)
    print(f"{lengths.size:,} sequences{aside} into {packing.rows:,} rows of {args.capacity:,} tokens in "
          f"{packed_s:.2f} s: {packing.bound_ratio:.6f} of the lower bound ({packing.lower_bound:,} rows), "
          f"efficiency {packing.efficiency:.6f}; rows in {out}")
    return 0


def _as_options(message: str) -> str:
    """pack's ValueError in the command's words: its keyword arguments as options."""
    for key, option in (("oversize", "--oversize"), ("max_seqs_per_row", "--max-seqs-per-row"),
                        ("strategy", "--strategy")):
        message = message.replace(f"{key}=", f"{option} ")
    return message.replace("'", "")


if __name__ == "__main__":
    sys.exit(main())
