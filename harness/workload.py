"""Workload generation: sequence lengths (the published generator or a lengths file) and examples."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from backends.errors import UserError
from backends.messages import Example


def mixed_lengths(n_examples: int, min_len: int, max_len: int, seed: int) -> list[int]:
    """The published benchmark's length generator: 15% short, 70% middle, 15% long, shuffled.

    Kept exactly as published (same RandomState calls in the same order), so
    ``mixed_lengths(128, 64, 32768, 42)`` sums to 1,669,550 tokens.
    """
    rng = np.random.RandomState(seed)
    n_short = max(1, int(0.15 * n_examples))
    n_long = max(1, int(0.15 * n_examples))
    # n_examples < 3 has no middle band: draw one short and one long, keep n_examples
    # of them (the published generator fails there; everywhere else this is it exactly).
    n_mid = max(0, n_examples - n_short - n_long)
    short_max = min(256, max_len)
    long_min = max(min_len, 3 * max_len // 4)
    lengths = np.concatenate(
        [
            rng.randint(min_len, short_max + 1, n_short),
            rng.randint(short_max + 1, long_min, n_mid),
            rng.randint(long_min, max_len + 1, n_long),
        ]
    )
    rng.shuffle(lengths)
    return [int(n) for n in lengths[:n_examples]]


# A length is plain ASCII digits, with an optional sign: int() alone also takes 1_000 and
# full-width or other Unicode digits, which a lengths file written by a script never means.
_LENGTH = re.compile(r"[+-]?[0-9]+")


def read_lengths_file(path: str) -> list[int]:
    """Sequence lengths from a UTF-8 text file, one positive integer per line (blank lines and # comments skipped).

    A byte-order mark at the start (what some editors write) is skipped.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"workload.path: '{p}' is a folder, not a file (expected a text file with one sequence length per line)")
    if not p.is_file():
        raise UserError(f"workload.path: no such file '{p}' (expected a text file with one sequence length per line)")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise UserError(f"workload.path: cannot read '{p}' ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise UserError(
            f"workload.path: {p} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {lineno}; "
            "expected a text file with one sequence length per line, in ASCII digits)"
        ) from None
    lengths = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _LENGTH.fullmatch(line):
            raise UserError(
                f"workload.path: {p}:{lineno}: {line!r} is not an integer "
                "(expected one positive length per line, in ASCII digits 0-9)"
            )
        n = int(line)
        if n <= 0:
            raise UserError(f"workload.path: {p}:{lineno}: length {n} is not positive (every sequence needs at least 1 token)")
        lengths.append(n)
    if not lengths:
        raise UserError(f"workload.path: {p} holds no lengths (expected one positive integer per line)")
    return lengths


@dataclass
class WorkloadSpec:
    """What the harness needs to know of a workload config (see conf/workload/)."""

    name: str
    kind: str = "mixed"  # "mixed" (the published generator) or "lengths_file"
    n_examples: int = 128
    min_len: int = 64
    max_len: int = 32768
    seed: int = 42
    path: Optional[str] = None


def workload_lengths(spec: WorkloadSpec) -> list[int]:
    """The workload's sequence lengths, in request order."""
    if spec.kind == "lengths_file":
        if not spec.path:
            raise UserError("workload.path: not set (give a text file with one sequence length per line)")
        return read_lengths_file(spec.path)
    if spec.kind != "mixed":
        raise UserError(f"workload.kind: '{spec.kind}' is not a workload kind (valid: mixed, lengths_file)")
    for key in ("n_examples", "min_len"):
        value = getattr(spec, key)
        if value <= 0:
            raise UserError(f"workload.{key}: must be a positive integer, got {value}")
    if spec.max_len < spec.min_len:
        raise UserError(f"workload.max_len: must be >= workload.min_len ({spec.min_len}), got {spec.max_len}")
    # The generator's three bands: [min_len, 256], [257, 3/4 max_len), [3/4 max_len, max_len].
    if spec.min_len > 256:
        raise UserError(f"workload.min_len: the mixed generator's short band is min_len..256, so min_len must be <= 256, got {spec.min_len}")
    n_mid = spec.n_examples - 2 * max(1, int(0.15 * spec.n_examples))
    if n_mid > 0 and max(spec.min_len, 3 * spec.max_len // 4) <= 257:
        raise UserError(f"workload.max_len: the mixed generator's middle band 257..3/4 max_len needs max_len >= 344, got {spec.max_len}")
    return mixed_lengths(spec.n_examples, spec.min_len, spec.max_len, spec.seed)


def make_examples(lengths: list[int], vocab_size: int, seed: int) -> list[Example]:
    """Random token ids in the model's vocabulary; targets are the ids shifted left.

    The last target is a pad target (id 0). Loss weights are 0 on the first
    ``len // 2`` positions and 1 on the rest, like a prompt followed by a completion.
    """
    rng = np.random.default_rng(seed)
    examples = []
    for n in lengths:
        ids = rng.integers(0, vocab_size, size=n, dtype=np.int64)
        targets = np.empty_like(ids)
        targets[:-1] = ids[1:]
        targets[-1] = 0
        weights = np.ones(n, dtype=np.float32)
        weights[: n // 2] = 0.0
        examples.append(Example(input_ids=ids, target_tokens=targets, weights=weights))
    return examples
