"""A dataset's files and rows: a file or a folder of ``*.jsonl``, ``*.json`` and ``*.parquet`` (sorted), read row by
row with the standard library and pyarrow, each row named by its file and line (or row) for messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

from backends.errors import UserError, first_line
from balance_batch.textfile import utf8_text

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _where(path: Path, line: int, kind: str) -> str:
    """How a message names a row: ``file:line`` in JSON Lines, ``file row N`` in a JSON array or Parquet."""
    return f"{path}:{line}" if kind == "jsonl" else f"{path} row {line}"


# -- files and rows ------------------------------------------------------------------------------------------
def dataset_files(path: str) -> list[Path]:
    """The data files ``workload.path`` names: the file itself, or every data file under a folder (sorted)."""
    expected = "a .jsonl, .json or .parquet file, or a folder of them"
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in DATA_SUFFIXES)
        if not files:
            raise UserError(f"workload.path: the folder '{p}' holds no .jsonl, .json or .parquet file (expected "
                            f"{expected})")
        return files
    if not p.is_file():
        raise UserError(f"workload.path: no such file or folder '{p}' (expected {expected})")
    if p.suffix.lower() not in DATA_SUFFIXES:
        raise UserError(f"workload.path: '{p}' is not a .jsonl, .json or .parquet file (expected {expected})")
    return [p]


def _json_rows(p: Path) -> Iterator[tuple[str, Any]]:
    """A .jsonl file's objects one per line (blank lines skipped); a .json file: one array of rows, or JSON Lines."""
    text = utf8_text(p, "JSON rows are UTF-8", key="workload.path")
    if p.suffix.lower() == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            if exc.msg != "Extra data":  # "Extra data" after the first value: a .json of JSON Lines
                raise UserError(f"workload.path: {p}:{exc.lineno}: not JSON ({exc.msg}, column {exc.colno})") from None
        else:
            if not isinstance(doc, list):
                raise UserError(f"workload.path: {p} holds a JSON {type(doc).__name__}, not an array of rows "
                                "(expected [{...}, {...}] or JSON Lines: one object per line)")
            for i, row in enumerate(doc):
                yield _where(p, i, "json"), row
            return
    # Lines end at \n only: str.splitlines() also breaks at U+2028, U+2029, U+0085 and other characters that
    # json.dumps(ensure_ascii=False) leaves raw inside a string, cutting a row in two and miscounting lines after it.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"workload.path: {p}:{lineno}: not a JSON object ({exc.msg}, column {exc.colno}; "
                            "JSON Lines is one object per line)") from None
        yield _where(p, lineno, "jsonl"), row


def _parquet_rows(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq

        reader = pq.ParquetFile(p)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid (and OSError) for a file it cannot read
        raise UserError(f"workload.path: {p} is not a readable Parquet file ({first_line(str(exc), 160)})") from None
    i = 0
    for batch in reader.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield _where(p, i, "parquet"), row
            i += 1


def iter_rows(files: Sequence[Path]) -> Iterator[tuple[str, Any]]:
    """Every row of the files, in order, each with where it is (for a message)."""
    for p in files:
        yield from (_parquet_rows(p) if p.suffix.lower() == ".parquet" else _json_rows(p))
