"""Workloads: sequence lengths (the published generator, or a lengths file: plain or a histogram) with random token
ids, or your own data tokenized from a local dataset (harness/data/dataset.py), and the examples a backend runs."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from backends.errors import UserError
from backends.messages import Example
from balance_batch.lengths import HISTOGRAM, MAX_LENGTH, load_lengths_file


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


def chat_lengths(n_examples: int, min_len: int, max_len: int, seed: int) -> list[int]:
    """Chat-like lengths: many short sequences and a long tail, as fine-tuning chat data has.

    Log-normal around a median of 150 tokens (σ = 1.2: p99 about 2,400), rounded and clipped to
    [min_len, max_len], drawn with numpy's ``default_rng(seed)``; the demo chats
    (``python -m harness.demo_data``) measure median 126 and p99 2,559.
    """
    rng = np.random.default_rng(seed)
    drawn = rng.lognormal(mean=np.log(150.0), sigma=1.2, size=n_examples)
    return [int(n) for n in np.clip(np.rint(drawn), min_len, max_len)]


@dataclass
class WorkloadSpec:
    """What the harness needs to know of a workload config (see harness/conf/workload/)."""

    name: str
    # "mixed" (the published generator), "chat" (many short, a long tail), "lengths_file", "dataset"
    kind: str = "mixed"
    # mixed: how many to generate. lengths_file, dataset: how many to draw (0 or null: every sequence in it).
    n_examples: Optional[int] = 128
    # The batch sized in tokens instead: examples taken in the workload's order while their sum stays within it (at
    # least one); null: n_examples counts them. A workload's own n_examples then gives way; a typed one is refused.
    n_tokens: Optional[int] = None
    min_len: int = 64
    max_len: Optional[int] = 32768  # mixed, chat: the longest length generated
    # Which lengths are drawn (mixed, chat), which sequences and in what order (lengths_file, dataset); the token ids
    # are the top-level token_seed's, the weights model.init_seed's.
    seed: int = 42
    path: Optional[str] = None
    # dataset only (harness/data/dataset.py)
    format: str = "messages"  # messages (chat template), prompt_completion or text
    tokenizer: Optional[str] = None  # a local tokenizer folder; null: model.path
    field: Optional[str] = None  # the row's key for messages / text; null: "messages" / "text"
    train_on: str = "completion"  # completion (completion / assistant tokens, as trainers mask prompts) or all
    shuffle: bool = True  # requests in an order drawn with seed (false: file order)
    cache: bool = True  # read and write the tokenized rows in cache_dir
    cache_dir: Optional[str] = None  # null: $BALANCE_BATCH_CACHE, else $XDG_CACHE_HOME/balance_batch/tokenized
    truncate_to: Optional[int] = None  # cut longer examples to this many tokens (0 or null: no truncation)


@dataclass
class Workload:
    """A workload's lengths in request order and, for a lengths file, what was read and how the batch was drawn."""

    lengths: list[int]
    file: Optional[dict] = None  # results.json's workload.file (see file_lengths)
    dataset: Optional[Any] = None  # workload=dataset: harness.data.dataset.DatasetExamples (real ids, trained tokens)

    def examples(self, vocab_size: int, seed: int, model: str = "the model") -> list[Example]:
        """What the backend runs: a dataset's own ids and trainer-style weights (checked against the vocabulary
        the backend built), else random ids in the vocabulary (``make_examples``)."""
        if self.dataset is None:
            return make_examples(self.lengths, vocab_size, seed)
        from harness.data.dataset import check_vocabulary, dataset_examples

        check_vocabulary(self.dataset.record["largest_id"], vocab_size, model)
        return dataset_examples(self.dataset)


def tokens_prefix(draw: Callable[[int], Sequence[int]], n_tokens: int, guess: int) -> list[int]:
    """The batch ``workload.n_tokens`` asks for: the first lengths of ``draw(n)`` whose sum is at most ``n_tokens`` (at
    least one, so a first sequence longer than the target runs alone). ``n`` starts at ``guess`` and doubles until the
    ``n`` lengths drawn hold the target, so the batch depends on the workload's settings alone."""
    n = max(1, guess)
    while True:
        lengths = np.asarray(draw(n), dtype=np.int64)
        total = np.cumsum(lengths)
        if total[-1] >= n_tokens:
            break
        n *= 2
    return lengths[: max(1, int(np.searchsorted(total, n_tokens, side="right")))].tolist()


def check_one_size(spec: WorkloadSpec, overrides: Sequence[str]) -> None:
    """``workload.n_tokens`` sizes the batch in tokens, and a workload's own ``n_examples`` gives way to it; one typed
    on the command line beside it (``overrides``: Hydra's) is refused naming both, as it would be ignored."""
    from harness.sweep.points import override_key

    if spec.n_tokens is not None and any(override_key(o) == "workload.n_examples" for o in overrides):
        raise UserError(f"workload.n_examples: {spec.n_examples} and workload.n_tokens: {spec.n_tokens} both size the "
                        "batch (n_examples counts examples; n_tokens takes them until that many tokens); keep one")


def file_lengths(spec: WorkloadSpec) -> Workload:
    """A lengths file's batch: ``n_examples`` > 0 draws that many (with replacement, weighted by count, ``seed``), and
    ``n_tokens`` draws so until that many tokens; 0 or null takes every sequence, a plain file in its own order and a
    histogram shuffled with ``seed`` (a histogram lists lengths sorted, and requests in sorted order are no
    workload)."""
    if not spec.path:
        raise UserError("workload.path: not set (give a text file with one sequence length per line, or length,count "
                        "lines)")
    n = 0 if spec.n_tokens else spec.n_examples or 0
    if n < 0:
        raise UserError(f"workload.n_examples: must be >= 0 or null for a lengths file (0 or null: every sequence in "
                        f"the file; more: that many drawn from it), got {n}")
    table = load_lengths_file(spec.path, key="workload.path")
    if spec.n_tokens:
        mean = float(np.average(table.lengths, weights=table.counts))
        lengths = np.asarray(tokens_prefix(lambda k: table.sample(k, spec.seed), spec.n_tokens,
                                           math.ceil(spec.n_tokens / mean)))
        n, order = len(lengths), "sampled"
    elif n > 0:
        lengths, order = table.sample(n, spec.seed), "sampled"
    elif table.format == HISTOGRAM:
        lengths, order = table.shuffled(spec.seed), "shuffled"
    else:
        lengths, order = table.lengths, "file order"
    # absolute: a relative path in results.json names nothing once it is read from another folder
    record = {"path": os.path.abspath(table.path), "format": table.format, "distinct_lengths": table.distinct_lengths,
              "sequences": table.sequences, "sampled": n or None, "order": order}
    return Workload(lengths.tolist(), record)


# The keys of workload.* each kind reads (name, kind, n_examples and seed: all of them); another kind's key must
# keep the value that means "not set" (the schema's default, or the 0 / null a preset writes), else it is refused:
# results.json would record, as a setting of the run, a value that did nothing.
READS = {"mixed": {"min_len", "max_len"}, "chat": {"min_len", "max_len"}, "lengths_file": {"path"},
         "dataset": {"truncate_to", "path", "format", "tokenizer", "field", "train_on", "shuffle", "cache",
                     "cache_dir"}}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(WorkloadSpec)}
UNSET = {"min_len": (0, None, _DEFAULTS["min_len"]), "max_len": (0, None, _DEFAULTS["max_len"]),
         "truncate_to": (0, None),
         **{key: (_DEFAULTS[key],) for key in ("path", "format", "tokenizer", "field", "train_on", "shuffle", "cache",
                                              "cache_dir")}}
_KIND_WORDS = {"mixed": "generated lengths", "chat": "generated lengths", "lengths_file": "lengths read from a file",
               "dataset": "your own rows, tokenized"}


def check_unused(spec: WorkloadSpec) -> None:
    """A UserError naming the first workload key that ``spec.kind`` does not read but that is set."""
    reads = READS.get(spec.kind)
    if reads is None:
        return  # an unknown kind is refused by load_workload, naming the valid ones
    for key, unset in UNSET.items():
        value = getattr(spec, key)
        if key in reads or any(value == u and type(value) is type(u) for u in unset):
            continue
        if (spec.kind, key) == ("dataset", "max_len"):  # the old spelling of a dataset's truncation length
            raise UserError(f"workload.max_len: renamed workload.truncate_to for a dataset (it cuts longer examples "
                            f"to that many tokens; max_len is the generators' longest length): "
                            f"workload.truncate_to={value}")
        kinds = [k for k, keys in READS.items() if key in keys]
        users = ", ".join(kinds[:-1]) + f" or {kinds[-1]}" if len(kinds) > 1 else kinds[0]
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        raise UserError(f"workload.{key}: {shown} is set, but workload {spec.name} (kind {spec.kind}: "
                        f"{_KIND_WORDS[spec.kind]}) does not read it, only workloads of kind {users} do; drop it "
                        "(results.json would record a setting that did nothing)")


def load_workload(spec: WorkloadSpec, model=None, check_vocabulary: bool = True) -> Workload:
    """The workload's lengths in request order (and, from a lengths file or a dataset, what was read).

    ``model`` (backends.specs.ModelSpec): a dataset's tokenizer defaults to its folder, and its ids are checked
    against its vocabulary before anything starts (``check_vocabulary``; a server's is checked when it answers).
    """
    check_unused(spec)
    if spec.n_tokens is not None and spec.n_tokens <= 0:
        raise UserError(f"workload.n_tokens: must be a positive integer (the batch's tokens) or null "
                        f"(workload.n_examples counts the examples), got {spec.n_tokens}")
    if spec.kind == "lengths_file":
        return file_lengths(spec)
    if spec.kind == "dataset":
        return dataset_workload(spec, model, check_vocabulary)
    if spec.kind not in ("mixed", "chat"):
        raise UserError(f"workload.kind: '{spec.kind}' is not a workload kind (valid: mixed, chat, lengths_file, "
                        "dataset)")
    if spec.max_len is None:
        raise UserError(f"workload.max_len: must be a positive integer for the {spec.kind} generator, got null")
    for key in ("min_len",) if spec.n_tokens else ("n_examples", "min_len"):
        value = getattr(spec, key)
        if value is None or value <= 0:
            raise UserError(f"workload.{key}: must be a positive integer, got {'null' if value is None else value}")
    if spec.max_len < spec.min_len:
        raise UserError(f"workload.max_len: must be >= workload.min_len ({spec.min_len}), got {spec.max_len}")
    if spec.max_len > MAX_LENGTH:
        raise UserError(f"workload.max_len: must be at most {MAX_LENGTH:,} tokens (the longest sequence a workload may "
                        f"hold), got {spec.max_len:,}")
    generate = functools.partial(_generated, spec)
    if spec.n_tokens:  # a first guess of the count from the longest length; tokens_prefix doubles it as needed
        return Workload(tokens_prefix(generate, spec.n_tokens, 2 * math.ceil(spec.n_tokens / spec.max_len)))
    return Workload(generate(spec.n_examples))


def _generated(spec: WorkloadSpec, n: int) -> list[int]:
    """``n`` lengths of the mixed or the chat generator, with ``spec``'s bounds and seed."""
    if spec.kind == "chat":
        return chat_lengths(n, spec.min_len, spec.max_len, spec.seed)
    # The generator's three bands: [min_len, 256], [257, 3/4 max_len), [3/4 max_len, max_len].
    if spec.min_len > 256:
        raise UserError("workload.min_len: the mixed generator's short band is min_len..256, so min_len must be <= "
                        f"256, got {spec.min_len}")
    n_mid = n - 2 * max(1, int(0.15 * n))
    if n_mid > 0 and max(spec.min_len, 3 * spec.max_len // 4) <= 257:
        raise UserError("workload.max_len: the mixed generator's middle band 257..3/4 max_len needs max_len >= 344, "
                        f"got {spec.max_len}")
    return mixed_lengths(n, spec.min_len, spec.max_len, spec.seed)


def dataset_workload(spec: WorkloadSpec, model=None, check_vocabulary: bool = True) -> Workload:
    """``workload=dataset``: the dataset's examples (harness/data/dataset.py), their ids checked against ``model``'s
    vocabulary."""
    from harness.data.dataset import check_vocabulary as check
    from harness.data.dataset import load_dataset

    data = load_dataset(spec, model.path if model is not None else None)
    if model is not None and check_vocabulary:
        from backends.model.build import model_vocab_size

        check(data.record["largest_id"], model_vocab_size(model), f"model {model.name}")
    return Workload(data.lengths, dataset=data)


def workload_lengths(spec: WorkloadSpec) -> list[int]:
    """The workload's sequence lengths, in request order."""
    return load_workload(spec).lengths


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
