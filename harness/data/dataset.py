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

Reading files and rows is harness/data/rows.py; the tokenizer, rendering and tokenizing harness/data/rendering.py;
here: the cache, the options, and the examples a point runs.
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
from typing import Any, Optional, Sequence

import numpy as np

from backends.errors import UserError
from harness.data.rendering import (
    DEFAULT_FIELD,
    FORMATS,
    TRAIN_ON,
    Renderer,
    Tokenized,
    load_tokenizer,
    tokenize_rows,
    tokenizer_fingerprint,
)
from harness.data.rows import dataset_files, iter_rows

log = logging.getLogger("harness")
CACHE_VERSION = 2  # bumped when what is cached, or how it is computed, changes


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
    if spec.truncate_to is not None and spec.truncate_to < 0:
        raise UserError(f"workload.truncate_to: must be a positive integer (cut longer examples to it), or 0 or null "
                        f"(no truncation), got {spec.truncate_to}")
    if spec.n_examples is not None and spec.n_examples < 0:
        raise UserError(f"workload.n_examples: must be >= 0 or null (0 or null: every example; N: N drawn with "
                        f"workload.seed), got {spec.n_examples}")
    if spec.field is not None and spec.format == "prompt_completion":
        raise UserError("workload.field: format=prompt_completion reads the keys prompt and completion; "
                        "workload.field names the key of format=messages or format=text")


def cache_folder(spec) -> Path:
    """The folder tokens are cached in, absolute; with the cache on, a UserError (before anything is tokenized) when
    it is a file or lies under one: nothing could ever be written there."""
    if spec.cache_dir and not spec.cache:
        raise UserError(f"workload.cache_dir: '{spec.cache_dir}' is set, and workload.cache=false reads and writes no "
                        "cache, so it would be ignored; drop it, or set workload.cache=true")
    key = "workload.cache_dir" if spec.cache_dir else "workload.cache_dir (default: $BALANCE_BATCH_CACHE or ~/.cache)"
    folder = Path(os.path.abspath(Path(spec.cache_dir).expanduser() if spec.cache_dir else default_cache_dir()))
    if spec.cache:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            where = "is a file" if existing == folder else f"lies under the file '{existing}'"
            raise UserError(f"{key}: '{folder}' {where}, not a folder (expected a folder for the tokenized rows, "
                            "created if absent; or workload.cache=false and no cache_dir)")
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


# The roles chat templates know: only 'assistant' turns are trained, the others are the prompt.
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})


def _warn_of_roles(tokens: Tokenized, path: str) -> None:
    """One warning for turns whose role is 'assistant' in another case or with spaces ('Assistant'), and one for rows
    with no assistant turn among roles of another convention ('human', 'bot'): roles are matched exactly, as a trainer
    matches them, so those turns train nothing."""
    for role, (turns, rows) in tokens.roles.items():
        if role != "assistant" and role.strip().lower() == "assistant":
            log.warning("workload.path: %s: %s turns in %s of %s rows have the role %r, which is not 'assistant' "
                        "(roles are matched exactly): none of their tokens is trained; write 'assistant'", path,
                        f"{turns:,}", f"{rows:,}", f"{tokens.rows:,}", role)
    # Roles of another convention (ShareGPT's human/gpt, bot, model): rows with no assistant turn train nothing.
    other = sorted(r for r in tokens.roles if r not in _CHAT_ROLES and r.strip().lower() != "assistant")
    without = tokens.rows - tokens.roles.get("assistant", [0, 0])[1]
    if other and without:
        log.warning("workload.path: %s: %s of %s rows have no turn with the role 'assistant' (roles there include "
                    "%s, which no mask trains): none of their tokens is trained; name the model's turns "
                    "'assistant' and the user's 'user'", path, f"{without:,}", f"{tokens.rows:,}",
                    ", ".join(repr(r) for r in other))


def select(tokens: Tokenized, spec, record: dict) -> DatasetExamples:
    """Rows with tokens, truncated to ``truncate_to``, ``n_examples`` drawn with ``seed`` and shuffled (or in file
    order); or, with ``n_tokens``, the first of them in that order while their tokens stay within it."""
    lengths = np.diff(tokens.offsets)
    usable = np.flatnonzero(lengths > 0)
    if usable.size == 0:
        raise UserError(f"workload.path: {spec.path}: every one of its {tokens.rows:,} rows renders to no tokens")
    n = 0 if spec.n_tokens else spec.n_examples or 0
    if n > usable.size:
        raise UserError(f"workload.n_examples: {n:,}, but {spec.path} has {usable.size:,} examples (0 or null: all "
                        f"of them; at most {usable.size:,})")
    rng = np.random.default_rng(spec.seed)
    chosen = np.sort(rng.choice(usable, size=n, replace=False)) if n else usable
    if spec.shuffle:
        chosen = rng.permutation(chosen)
    limit = spec.truncate_to or None
    if spec.n_tokens:
        chosen = _within_tokens(chosen, lengths, limit, spec)
        n = len(chosen)
    ids, trained = [], []
    truncated = cut = emptied = 0
    for i in chosen:
        row_ids, row_trained = tokens.row(int(i))
        if limit is not None and row_ids.size > limit:
            truncated += 1
            cut += int(row_ids.size - limit)
            # an example whose trained tokens all lie past truncate_to still runs, but trains on nothing
            emptied += bool(example_weights(row_trained, spec.train_on).any()
                            and not example_weights(row_trained[:limit], spec.train_on).any())
            row_ids, row_trained = row_ids[:limit], row_trained[:limit]
        ids.append(row_ids)
        trained.append(row_trained)
    examples = DatasetExamples(ids, trained, spec.train_on)
    weights = [example_weights(t, spec.train_on) for t in trained]
    n_trained = sum(int((w > 0).sum()) for w in weights)
    if n_trained == 0:
        raise UserError(_nothing_to_train(tokens, chosen, spec, limit, len(ids), truncated))
    if emptied:
        log.warning("workload.truncate_to=%d cut every trained token from %s of the %s examples (%s truncated): they "
                    "run but train on nothing; a larger truncate_to keeps them", limit, f"{emptied:,}", f"{len(ids):,}",
                    f"{truncated:,}")
    examples.record = {
        **record,
        "rows": tokens.rows,
        "empty_rows": int(tokens.rows - usable.size),
        "examples_available": int(usable.size),
        "sampled": n or None,
        "order": "shuffled" if spec.shuffle else "file order",
        "truncate_to": limit,
        "truncated": truncated,
        "tokens_cut": cut,
        "trained_tokens": n_trained,
        "examples_without_trained_tokens": sum(1 for w in weights if not (w > 0).any()),
        "largest_id": int(max(int(a.max()) for a in ids)),
    }
    return examples


def _within_tokens(chosen: np.ndarray, lengths: np.ndarray, limit: Optional[int], spec) -> np.ndarray:
    """The first rows of ``chosen`` whose tokens (each cut to ``limit``) sum to at most ``spec.n_tokens``, at least
    one; a dataset holding fewer tokens than that is refused, as more examples than it has are."""
    total = np.cumsum(np.minimum(lengths[chosen], limit) if limit else lengths[chosen])
    if total[-1] < spec.n_tokens:
        cut = " after truncation to workload.truncate_to" if limit else ""
        raise UserError(f"workload.n_tokens: {spec.n_tokens:,}, but {spec.path} holds {int(total[-1]):,} tokens{cut} "
                        f"in {len(chosen):,} examples (at most {int(total[-1]):,}; or workload.n_examples)")
    return chosen[: max(1, int(np.searchsorted(total, spec.n_tokens, side="right")))]


def _nothing_to_train(tokens: Tokenized, chosen, spec, limit: Optional[int], n: int, truncated: int) -> str:
    """The line for examples with no trained token, naming a setting that trains some: a truncate_to long enough to
    keep one (the least that does), train_on=all where the examples have two tokens or more, else the rows' roles."""
    rows = [tokens.row(int(i)) for i in chosen]
    # position t predicts token t + 1: a row trains once it keeps its first trained token past position 0 (or, with
    # train_on=all, any second token)
    firsts = [int(np.flatnonzero(t[1:])[0]) + 2 for _, t in rows if t[1:].any()] if spec.train_on != "all" else []
    need = 2 if spec.train_on == "all" else min(firsts, default=None)
    longest = max(int(ids.size) for ids, _ in rows)
    works = []
    if truncated and need is not None:
        works.append(f"workload.truncate_to={need} or more (0: no truncation)")
    if spec.train_on != "all" and min(longest, limit or longest) >= 2:
        works.append("workload.train_on=all")
    if spec.train_on == "all":
        cut = f" (workload.truncate_to={limit})" if truncated else ""
        what = (f"workload.train_on: all, but each of the {n:,} examples is one token long{cut}, and a token trains "
                "only as the next one's target")
    else:
        after = f" left after workload.truncate_to={limit}" if truncated else ""
        what = (f"workload.train_on: {spec.train_on}, but none of the {n:,} examples has a completion or assistant "
                f"token{after} to train on")
    return f"{what}; {'set ' + ' or '.join(works) if works else 'check the rows (their roles, their lengths)'}"


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
