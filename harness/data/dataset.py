"""Your own data as a workload: rows of a local JSONL, JSON or Parquet file (or a folder of them), tokenized with a
local tokenizer, with the loss weights a fine-tuning trainer sets (``workload=dataset``).

Rows are read with the standard library (JSON, JSON Lines) and pyarrow (Parquet) rather than Hugging Face
``datasets``: a bad row is reported by its file and line, nested ``messages`` stay Python lists, nothing is
written to a second cache of Arrow files, and nothing is ever fetched. A folder is every ``*.jsonl``,
``*.json`` and ``*.parquet`` under it, in sorted path order.

Formats (``workload.format``), as TRL's ``SFTTrainer`` reads them:

- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the tokenizer's chat
  template. Trained tokens (``train_on=completion``) are the assistant turns: for each, what the rendering of
  the conversation up to and including it adds to the rendering up to it with the generation prompt (the reply
  and its end-of-turn tokens).
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``, both strings (the tokenizer's special tokens
  around prompt + completion, then its end-of-sequence token) or both message lists (the chat template, the
  prompt with the generation prompt); trained tokens are the completion's.
- ``text``: ``{"text": ...}`` plus the end-of-sequence token; every token is trained.

Every row is tokenized once per (files' contents, tokenizer files, chat template, format, field) and cached
(``workload.cache_dir``); truncation, sampling and ``train_on`` apply to the cached tokens, so changing them does
not tokenize again. A file's content is its SHA-256, not its size and modification time: ``cp -p``, rsync, tar and
``touch -r`` keep an edited file's time (hashing reads the file once, about 0.9 s per GB here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from backends.errors import UserError, first_line
from harness.data.textfile import utf8_text

log = logging.getLogger("harness")

FORMATS = ("messages", "prompt_completion", "text")
TRAIN_ON = ("completion", "all")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
DEFAULT_FIELD = {"messages": "messages", "text": "text"}  # the row's key for a format (prompt_completion: two)
CACHE_VERSION = 2  # bumped when what is cached, or how it is computed, changes
# The files of a tokenizer folder that decide how text becomes ids (their bytes go into the cache key).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
BATCH_ROWS = 512  # rows tokenized per call (a fast tokenizer batches in Rust)
PROGRESS_EVERY_S = 10.0


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
    text = utf8_text(p, "JSON rows are UTF-8")
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


# -- the tokenizer ------------------------------------------------------------------------------------------
def load_tokenizer(path: Optional[str], model_path: Optional[str]):
    """A fast Hugging Face tokenizer from a local folder (``workload.tokenizer``, else ``model.path``), and that
    folder; nothing is downloaded."""
    if path is None and model_path is None:
        raise UserError("workload.tokenizer: not set, and the model has no folder to take it from "
                        "(model.path is null): give a local tokenizer folder, "
                        "e.g. one written by python -m harness.demo_data OUT")
    key = "workload.tokenizer" if path is not None else "workload.tokenizer (default: model.path)"
    folder = Path(path if path is not None else model_path).expanduser()
    if not folder.is_dir():
        raise UserError(f"{key}: no such folder '{folder}' (expected a local tokenizer folder: tokenizer.json, "
                        "tokenizer_config.json)")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError... for such a folder
        raise UserError(f"{key}: '{folder}' does not load as a tokenizer ({type(exc).__name__}: "
                        f"{first_line(str(exc), 200)})") from None
    if not getattr(tok, "is_fast", False):
        raise UserError(f"{key}: '{folder}' loads a slow (Python) tokenizer; loss masks need a fast one's character "
                        "offsets (a tokenizer.json in the folder)")
    return tok, folder


def tokenizer_fingerprint(folder: Path, tok) -> dict[str, Any]:
    """What decides the ids: the tokenizer files' bytes, its chat template and the tokenizers library's version."""
    import tokenizers

    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = folder / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    template = tok.chat_template if isinstance(getattr(tok, "chat_template", None), str) else None
    return {"files_sha256": h.hexdigest(), "tokenizers": tokenizers.__version__,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None}


# -- rendering a row --------------------------------------------------------------------------------------------
@dataclass
class Rendered:
    """A row as text, the character spans whose tokens are trained, and how it is tokenized."""

    text: str
    spans: list[tuple[int, int]]  # [start, end) character spans of completion / assistant text
    special_tokens: bool  # add the tokenizer's own special tokens (BOS...) around the text (not for a chat template)
    eos: bool  # append the end-of-sequence token (trained)


def _messages(where: str, value: Any, key: str) -> list[dict]:
    need = f"'{key}' must be a list of {{role, content}} objects"
    if not isinstance(value, list) or not value:
        raise UserError(f"workload.path: {where}: {need}, got {_kind(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise UserError(f"workload.path: {where}: {key}[{i}] is not a {{role, content}} object of strings "
                            f"({_kind(m)}; {need})")
        for part in ("role", "content"):
            if part not in m:
                raise UserError(f"workload.path: {where}: {key}[{i}] has no '{part}' (keys "
                                f"{', '.join(map(str, m)) or 'none'}; {need} of strings)")
            if not isinstance(m[part], str):
                parts = (" (a list of content parts, as multimodal rows have, is not read: give the text as one "
                         "string)" if part == "content" and isinstance(m[part], list) else "")
                raise UserError(f"workload.path: {where}: {key}[{i}].{part} is {_kind(m[part])} "
                                f"({_shown(m[part])}), not a string{parts}")
    return value


def _shown(value: Any, limit: int = 60) -> str:
    """A value as JSON, cut to ``limit`` characters, for a one-line message."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return {dict: "an object", str: "a string", type(None): "null", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


class Renderer:
    """Turns rows of one format into ``Rendered`` text, with the tokenizer's chat template where the format needs it."""

    def __init__(self, fmt: str, field: Optional[str], tok, tokenizer_path: str, masks: bool = True):
        self.fmt = fmt
        self.masks = masks  # find the trained spans (train_on=completion); train_on=all needs none
        self.key = field or DEFAULT_FIELD.get(fmt)
        self.tok = tok
        self.tokenizer_path = tokenizer_path
        self.roles: dict[str, list[int]] = {}  # role -> [turns, rows with it]: a role the masks miss is warned of

    def _count_roles(self, messages: list[dict]) -> None:
        for role in {m["role"] for m in messages}:
            self.roles.setdefault(role, [0, 0])[1] += 1
        for m in messages:
            self.roles[m["role"]][0] += 1

    def _template(self, where: str, messages: list[dict], generation_prompt: bool) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise UserError(f"workload.tokenizer: '{self.tokenizer_path}' has no chat template, and workload.format="
                            f"{self.fmt} renders {where} with one (add chat_template.jinja to the folder, or use "
                            "format=text)")
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError, or the template's own raise_exception
            raise UserError(f"workload.path: {where}: the chat template of '{self.tokenizer_path}' refused this row "
                            f"({first_line(str(exc), 200)})") from None

    def _opening(self, where: str, first: dict) -> str:
        """What a template writes before a conversation's opening assistant turn's content: its rendering of no
        messages with the generation prompt; where that is not how the turn starts (or a template refuses no
        messages), the text before the content."""
        alone = self._template(where, [first], False)
        try:
            opening = self.tok.apply_chat_template([], tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that reads messages[0] unconditionally
            opening = None
        if isinstance(opening, str) and alone.startswith(opening):
            return opening
        at = alone.find(first["content"]) if first["content"] else -1
        return alone[:at] if at >= 0 else ""

    def _chat(self, where: str, messages: list[dict]) -> Rendered:
        """The conversation rendered once; each assistant turn's span from two renderings of its prefix."""
        full = self._template(where, messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or not self.masks:
                continue
            # The turn's role header is the prompt's, trained for no turn: the rendering before it, with the
            # generation prompt (for a first turn, that of no messages: the header and any default system prompt).
            start = self._template(where, messages[:i], True) if i else self._opening(where, messages[0])
            end = self._template(where, messages[: i + 1], False)
            if not (full.startswith(start) and full.startswith(end) and len(end) >= len(start)):
                raise UserError(f"workload.path: {where}: the chat template renders turn {i} differently inside the "
                                "whole conversation than on its own, so its assistant tokens cannot be found (use "
                                "workload.train_on=all, or a template that renders each turn the same)")
            spans.append((len(start), len(end)))
        return Rendered(full, spans, special_tokens=False, eos=False)

    def render(self, where: str, row: Any) -> Rendered:
        if not isinstance(row, dict):
            raise UserError(f"workload.path: {where}: a row must be an object, got {_kind(row)}")
        if self.fmt == "prompt_completion":
            missing = [k for k in ("prompt", "completion") if k not in row]
            if missing:
                raise UserError(f"workload.path: {where}: no '{missing[0]}' key (format=prompt_completion needs prompt "
                                f"and completion; keys here: {', '.join(map(str, row)) or 'none'})")
            prompt, completion = row["prompt"], row["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                return Rendered(prompt + completion, [(len(prompt), len(prompt) + len(completion))], True, True)
            if isinstance(prompt, list) and isinstance(completion, list):
                p = self._template(where, _messages(where, prompt, "prompt"), True)
                full = self._template(where, prompt + _messages(where, completion, "completion"), False)
                if not full.startswith(p):
                    raise UserError(f"workload.path: {where}: the chat template renders the prompt differently inside "
                                    "the whole conversation, so the completion's tokens cannot be found")
                return Rendered(full, [(len(p), len(full))], False, False)
            raise UserError(f"workload.path: {where}: prompt and completion must both be strings or both be lists of "
                            f"{{role, content}} (got {_kind(prompt)} and {_kind(completion)})")
        if self.key not in row:
            need = "a list of {role, content}" if self.fmt == "messages" else "a string"
            raise UserError(f"workload.path: {where}: no '{self.key}' key (format={self.fmt} needs {need} there; keys "
                            f"here: {', '.join(map(str, row)) or 'none'}; workload.field names another key)")
        value = row[self.key]
        if self.fmt == "messages":
            messages = _messages(where, value, self.key)
            self._count_roles(messages)
            return self._chat(where, messages)
        if not isinstance(value, str):
            raise UserError(f"workload.path: {where}: '{self.key}' must be a string, got {_kind(value)}")
        return Rendered(value, [(0, len(value))], True, True)


# -- tokenizing (once) --------------------------------------------------------------------------------------------
@dataclass
class Tokenized:
    """Every row's ids and trained-token mask, concatenated: row i is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray  # int64
    trained: np.ndarray  # bool: the token is a completion / assistant token
    offsets: np.ndarray  # int64, rows + 1
    roles: dict = dataclass_field(default_factory=dict)  # role -> [turns, rows with it] (format=messages)

    @property
    def rows(self) -> int:
        return int(self.offsets.size - 1)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.trained[a:b]


def _encode(tok, batch: list[Rendered]) -> list[tuple[list[int], list[bool]]]:
    """Ids and trained flags of rendered rows: a token is trained when any of its characters lies in a trained span
    (a token that merges the prompt's last space with the completion's first letter belongs to the completion)."""
    out = []
    for special in (True, False):
        idx = [i for i, r in enumerate(batch) if r.special_tokens == special]
        if not idx:
            continue
        enc = tok([batch[i].text for i in idx], add_special_tokens=special, return_offsets_mapping=True)
        for i, ids, offsets in zip(idx, enc["input_ids"], enc["offset_mapping"]):
            spans = batch[i].spans
            trained = [b > a and any(a < e and b > s for s, e in spans) for a, b in offsets]
            out.append((i, list(ids), trained))
    eos = tok.eos_token_id
    result: list = [None] * len(batch)
    for i, ids, trained in out:
        if batch[i].eos and eos is not None and ids:
            ids, trained = ids + [eos], trained + [True]
        result[i] = (ids, trained)
    return result


def tokenize_rows(rows: Iterator[tuple[str, Any]], renderer: Renderer, tok, what: str,
                  clock: Callable[[], float] = time.monotonic) -> Tokenized:
    """Render and tokenize every row, ``BATCH_ROWS`` at a time, logging progress every ``PROGRESS_EVERY_S``."""
    ids: list[np.ndarray] = []
    trained: list[np.ndarray] = []
    lengths = [0]
    pending: list[Rendered] = []
    t0 = last = clock()

    def flush() -> None:
        for row_ids, row_trained in _encode(tok, pending):
            ids.append(np.asarray(row_ids, dtype=np.int64))
            trained.append(np.asarray(row_trained, dtype=bool))
            lengths.append(len(row_ids))
        pending.clear()

    for where, row in rows:
        pending.append(renderer.render(where, row))
        if len(pending) >= BATCH_ROWS:
            flush()
            if clock() - last >= PROGRESS_EVERY_S:
                last = clock()
                log.info("tokenizing %s: %s rows, %s tokens (%.0f s)", what, f"{len(ids):,}", f"{sum(lengths):,}",
                         last - t0)
    flush()
    empty = np.zeros(0, dtype=np.int64)
    return Tokenized(np.concatenate(ids) if ids else empty, np.concatenate(trained) if trained else empty.astype(bool),
                     np.cumsum(lengths, dtype=np.int64), {r: list(n) for r, n in sorted(renderer.roles.items())})


# -- the cache ------------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """Where tokens are cached when ``workload.cache_dir`` is null: $BALANCE_BATCH_CACHE, else the user's cache
    folder."""
    if os.environ.get("BALANCE_BATCH_CACHE"):
        return Path(os.environ["BALANCE_BATCH_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "balance_batch" / "tokenized"


# path -> ((size, mtime_ns, ctime_ns, inode), sha256): a sweep's points hash each file once per process. The
# change time is in the stamp because no copy tool can keep it: an edit always moves it.
_HASHED: dict[str, tuple[tuple[int, int, int, int], str]] = {}


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (read in chunks; remembered in this process while the file is unchanged)."""
    st = path.stat()
    stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    name = str(path.resolve())
    known = _HASHED.get(name)
    if known is not None and known[0] == stamp:
        return known[1]
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise UserError(f"workload.path: cannot read '{path}' ({exc.strerror or exc})") from None
    _HASHED[name] = (stamp, digest)
    return digest


def cache_key(files: Sequence[Path], fmt: str, field: Optional[str], tokenizer: dict, masks: bool = True) -> str:
    """The key of a dataset's tokens (``masks``: trained spans found, for train_on=completion): the files' contents,
    not their sizes and times, which a copy that keeps times (``cp -p``, rsync, tar) makes equal for other bytes."""
    made_of = {
        "version": CACHE_VERSION,
        "masks": masks,
        "files": [{"path": str(f.resolve()), "sha256": file_sha256(f)} for f in files],
        "format": fmt,
        "field": field,
        "tokenizer": tokenizer,
    }
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:20]


def read_cache(path: Path, key: str) -> Optional[Tokenized]:
    """The cached tokens, or None (no file, another key, a file cut short: it is then tokenized again)."""
    import zipfile

    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != key:
                return None
            return Tokenized(z["ids"].astype(np.int64), z["trained"].astype(bool), z["offsets"].astype(np.int64),
                             json.loads(str(z["roles"])))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        return None


def write_cache(path: Path, key: str, tokens: Tokenized) -> None:
    """Write atomically (a run killed mid-write leaves no half file); a cache folder that cannot be written is a
    warning."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        ids = tokens.ids.astype(np.int32) if tokens.ids.size == 0 or tokens.ids.max() < 2**31 else tokens.ids
        with open(tmp, "wb") as f:
            np.savez(f, key=np.asarray(key), ids=ids, trained=tokens.trained, offsets=tokens.offsets,
                     roles=np.asarray(json.dumps(tokens.roles)))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("workload.cache_dir: cannot write the tokenized dataset to %s (%s); it is tokenized again next "
                    "run", path, exc.strerror or exc)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # under a path that is no folder there is nothing to remove
            pass


# -- the workload ----------------------------------------------------------------------------------------------
@dataclass
class DatasetExamples:
    """The examples a dataset workload runs: ids and per-token trained flags, in request order, and its record."""

    ids: list[np.ndarray]
    trained: list[np.ndarray]
    train_on: str
    record: dict = dataclass_field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return [int(a.size) for a in self.ids]


def check_options(spec) -> None:
    if spec.format not in FORMATS:
        raise UserError(f"workload.format: '{spec.format}' is not a format (valid: {', '.join(FORMATS)})")
    if spec.train_on not in TRAIN_ON:
        raise UserError(f"workload.train_on: '{spec.train_on}' is not valid (valid: completion (the completion or "
                        "assistant tokens, as a trainer masks the prompt), all)")
    if spec.max_len is not None and spec.max_len < 0:
        raise UserError(f"workload.max_len: must be a positive integer (truncate longer examples to it), or 0 or null "
                        f"(no truncation), got {spec.max_len}")
    if spec.n_examples is not None and spec.n_examples < 0:
        raise UserError(f"workload.n_examples: must be >= 0 or null (0 or null: every example; N: N drawn with "
                        f"workload.seed), got {spec.n_examples}")
    if spec.field is not None and spec.format == "prompt_completion":
        raise UserError("workload.field: format=prompt_completion reads the keys prompt and completion; "
                        "workload.field names the key of format=messages or format=text")


def cache_folder(spec) -> Path:
    """The folder tokens are cached in, absolute; with the cache on, a UserError (before anything is tokenized) when
    it is a file or lies under one: nothing could ever be written there."""
    key = "workload.cache_dir" if spec.cache_dir else "workload.cache_dir (default: $BALANCE_BATCH_CACHE or ~/.cache)"
    folder = Path(os.path.abspath(Path(spec.cache_dir).expanduser() if spec.cache_dir else default_cache_dir()))
    if spec.cache:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            where = "is a file" if existing == folder else f"lies under the file '{existing}'"
            raise UserError(f"{key}: '{folder}' {where}, not a folder (expected a folder for the tokenized rows, "
                            "created if absent; or workload.cache=false)")
    return folder


def _absolute(path: Any) -> str:
    """A path as results record it: absolute (a relative one means nothing once read from another folder)."""
    return os.path.abspath(Path(path).expanduser())


def load_dataset(spec, model_path: Optional[str]) -> DatasetExamples:
    """``workload=dataset``: the rows tokenized (or read from the cache), truncated, sampled and ordered."""
    if not spec.path:
        raise UserError("workload.path: not set (give a local .jsonl, .json or .parquet file, or a folder of them)")
    check_options(spec)
    folder = cache_folder(spec)
    files = dataset_files(spec.path)
    tok, tokenizer_folder = load_tokenizer(spec.tokenizer, model_path)
    fingerprint = tokenizer_fingerprint(tokenizer_folder, tok)
    masks = spec.train_on != "all"  # train_on=all trains every token: no spans to find (nor templates to check)
    key = cache_key(files, spec.format, spec.field, fingerprint, masks)
    cache_path = folder / f"{key}.npz"
    tokens = read_cache(cache_path, key) if spec.cache else None
    hit = tokens is not None
    what = str(files[0]) if len(files) == 1 else f"{len(files)} files under {spec.path}"
    if tokens is None:
        t0 = time.monotonic()
        renderer = Renderer(spec.format, spec.field, tok, str(tokenizer_folder), masks)
        tokens = tokenize_rows(iter_rows(files), renderer, tok, what)
        log.info("tokenized %s: %s rows, %s tokens in %.1f s", what, f"{tokens.rows:,}", f"{tokens.ids.size:,}",
                 time.monotonic() - t0)
        if tokens.rows == 0:
            raise UserError(f"workload.path: {spec.path} holds no rows (expected one row per example)")
        if spec.cache:
            write_cache(cache_path, key, tokens)
    else:
        log.info("read %s's tokens from the cache %s (%s rows, %s tokens)", what, cache_path, f"{tokens.rows:,}",
                 f"{tokens.ids.size:,}")
    if masks:
        _warn_of_roles(tokens, spec.path)
    return select(tokens, spec, {
        "path": _absolute(spec.path),
        "files": [_absolute(f) for f in files],
        "format": spec.format,
        "field": spec.field or DEFAULT_FIELD.get(spec.format),
        "train_on": spec.train_on,
        "tokenizer": {"path": _absolute(tokenizer_folder), "class": type(tok).__name__, "vocab_size": len(tok),
                      "chat_template_sha256": fingerprint["chat_template_sha256"]},
        "cache": {"key": key, "path": str(cache_path) if spec.cache else None, "hit": hit},
    })


def _warn_of_roles(tokens: Tokenized, path: str) -> None:
    """One warning for turns whose role is 'assistant' in another case or with spaces ('Assistant'): roles are
    matched exactly, as a trainer matches them, so those turns train nothing."""
    for role, (turns, rows) in tokens.roles.items():
        if role != "assistant" and role.strip().lower() == "assistant":
            log.warning("workload.path: %s: %s turns in %s of %s rows have the role %r, which is not 'assistant' "
                        "(roles are matched exactly): none of their tokens is trained; write 'assistant'", path,
                        f"{turns:,}", f"{rows:,}", f"{tokens.rows:,}", role)


def select(tokens: Tokenized, spec, record: dict) -> DatasetExamples:
    """Rows with tokens, truncated to ``max_len``, ``n_examples`` drawn with ``seed`` and shuffled (or in file
    order)."""
    lengths = np.diff(tokens.offsets)
    usable = np.flatnonzero(lengths > 0)
    if usable.size == 0:
        raise UserError(f"workload.path: {spec.path}: every one of its {tokens.rows:,} rows renders to no tokens")
    n = spec.n_examples or 0
    if n > usable.size:
        raise UserError(f"workload.n_examples: {n:,}, but {spec.path} has {usable.size:,} examples (0 or null: all "
                        f"of them; at most {usable.size:,})")
    rng = np.random.default_rng(spec.seed)
    chosen = np.sort(rng.choice(usable, size=n, replace=False)) if n else usable
    if spec.shuffle:
        chosen = rng.permutation(chosen)
    limit = spec.max_len or None
    ids, trained = [], []
    truncated = cut = emptied = 0
    for i in chosen:
        row_ids, row_trained = tokens.row(int(i))
        if limit is not None and row_ids.size > limit:
            truncated += 1
            cut += int(row_ids.size - limit)
            # an example whose trained tokens all lie past max_len still runs, but trains on nothing
            emptied += bool(example_weights(row_trained, spec.train_on).any()
                            and not example_weights(row_trained[:limit], spec.train_on).any())
            row_ids, row_trained = row_ids[:limit], row_trained[:limit]
        ids.append(row_ids)
        trained.append(row_trained)
    examples = DatasetExamples(ids, trained, spec.train_on)
    weights = [example_weights(t, spec.train_on) for t in trained]
    n_trained = sum(int((w > 0).sum()) for w in weights)
    if n_trained == 0:
        raise UserError(f"workload.train_on: completion, but none of the {len(ids):,} examples has a completion or "
                        f"assistant token{' left after truncation to workload.max_len' if truncated else ''} to train "
                        "on (use train_on=all, or check the rows' roles)")
    if emptied:
        log.warning("workload.max_len=%d cut every trained token from %s of the %s examples (%s truncated): they run "
                    "but train on nothing; a larger max_len keeps them", limit, f"{emptied:,}", f"{len(ids):,}",
                    f"{truncated:,}")
    examples.record = {
        **record,
        "rows": tokens.rows,
        "empty_rows": int(tokens.rows - usable.size),
        "examples_available": int(usable.size),
        "sampled": n or None,
        "order": "shuffled" if spec.shuffle else "file order",
        "max_len": limit,
        "truncated": truncated,
        "tokens_cut": cut,
        "trained_tokens": n_trained,
        "examples_without_trained_tokens": sum(1 for w in weights if not (w > 0).any()),
        "largest_id": int(max(int(a.max()) for a in ids)),
    }
    return examples


def example_weights(trained: np.ndarray, train_on: str) -> np.ndarray:
    """Per-position loss weights, as a causal-LM trainer sets them: position t predicts token t + 1, so its weight is
    whether token t + 1 is trained (every token with ``train_on=all``); the last position has no target."""
    n = int(trained.size)
    w = np.zeros(n, dtype=np.float32)
    if n > 1:
        w[:-1] = 1.0 if train_on == "all" else trained[1:].astype(np.float32)
    return w


def check_vocabulary(largest_id: int, vocab_size: int, what: str) -> None:
    """One line when the tokenizer's ids do not fit the model's embedding."""
    if largest_id >= vocab_size:
        raise UserError(f"workload.tokenizer: token id {largest_id:,} (the largest in the dataset's examples) is "
                        f"outside the vocabulary of {what}, {vocab_size:,} ids (0..{vocab_size - 1:,}): "
                        "use the model's own tokenizer, or a model with a vocabulary of at least "
                        f"{largest_id + 1:,} (model.vocab_size for the tiny model)")


def dataset_examples(data: DatasetExamples) -> list:
    """The backend's examples: the real ids, targets shifted left (the last one a pad target, weight 0), and weights."""
    from backends.messages import Example

    out = []
    for ids, trained in zip(data.ids, data.trained):
        targets = np.zeros_like(ids)
        targets[:-1] = ids[1:]
        out.append(Example(input_ids=ids.astype(np.int64), target_tokens=targets,
                           weights=example_weights(trained, data.train_on)))
    return out
