"""A dataset's rows rendered and tokenized: the local tokenizer and its fingerprint, each format's rendering (chat
template, prompt and completion, text) with the spans a trainer trains on, and the rows tokenized once, in batches,
into one array of ids and one of trained flags."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from backends.errors import UserError, first_line

log = logging.getLogger("harness")

FORMATS = ("messages", "prompt_completion", "text")
TRAIN_ON = ("completion", "all")
DEFAULT_FIELD = {"messages": "messages", "text": "text"}  # the row's key for a format (prompt_completion: two)
# The files of a tokenizer folder that decide how text becomes ids (their bytes go into the cache key).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
BATCH_ROWS = 512  # rows tokenized per call (a fast tokenizer batches in Rust)
PROGRESS_EVERY_S = 10.0


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
