"""A small real dataset and a tokenizer for the tiny model, made offline from this repository's own text.

    python -m harness.demo_data OUT [--rows N]

writes into OUT:

- ``chats.jsonl``: chat rows (``format=messages``): questions about this project's documentation pages and its
  functions' docstrings, answered with their text; one to three turns, a system prompt on some;
- ``prompt_completion.parquet``: the same questions and answers as ``prompt`` / ``completion`` strings;
- ``text.jsonl``: the answers alone (``format=text``);
- ``tokenizer/``: a byte-level BPE of 2,048 ids (the tiny model's vocabulary) trained on that text, with a
  ChatML chat template (``<|im_start|>role ... <|im_end|>``) and ``<|im_end|>`` as end of sequence.

The text is this package's docstrings and, next to a source checkout, its README and docs/: nothing is downloaded,
and the same sources give the same files.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import shlex
import sys
from pathlib import Path
from typing import Iterator, Optional

PACKAGES = ("harness", "backends", "reports")
ROOT = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 2048  # backends.model.configs.TINY_CONFIG["vocab_size"]
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# What Hydra reads as a plain value (its grammar's unquoted characters, less the ones with a meaning: $, \, spaces).
_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_\-/+.%*@?|~]+")
SYSTEM_PROMPTS = (
    "You are a helpful assistant for ML infrastructure engineers.",
    "Answer questions about the balance-batch harness precisely, in the project's own words.",
)


def docstrings(root: Path = ROOT) -> Iterator[tuple[str, str, str]]:
    """(module, qualified name, docstring) of every documented module, class and function, in path order."""
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            doc = ast.get_docstring(tree)
            if doc:
                yield module, module, doc
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 40:
                        yield module, node.name, doc


def readme_sections(readme: Path) -> Iterator[tuple[str, str]]:
    """(heading, prose) of each section of a markdown page: its paragraphs without code blocks or tables."""
    if not readme.is_file():
        return
    text = re.sub(r"```.*?```", "", readme.read_text(encoding="utf-8"), flags=re.S)
    heading, lines = None, []
    for line in text.splitlines() + ["# end"]:
        if line.startswith("#"):
            prose = "\n".join(row for row in lines if not row.lstrip().startswith("|")).strip()
            if heading and len(prose) > 80:
                yield heading, re.sub(r"\n{3,}", "\n\n", prose)
            heading, lines = line.lstrip("#").strip(), []
        else:
            lines.append(line)


def qa_pairs(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(group, question, answer): a group is a module or a documentation page (the README or one of docs/), whose
    questions can share a conversation."""
    pages = [root / "README.md", *sorted((root / "docs").glob("**/*.md"))]
    pairs = [(page.stem, f"What does the {page.relative_to(root)} page of balance-batch say under \"{h}\"?", prose)
             for page in pages for h, prose in readme_sections(page)]
    for module, name, doc in docstrings(root):
        q = f"What does the module `{module}` do?" if name == module else f"What does `{name}` in `{module}` do?"
        pairs.append((module, q, doc))
    return pairs


def chat_rows(pairs: list[tuple[str, str, str]], rows: int, seed: int = 0) -> list[dict]:
    """Conversations of one to three consecutive questions of a group, a system prompt on about a third."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(pairs) and len(out) < rows:
        turns = rng.choice((1, 1, 2, 3))
        group = [p for p in pairs[i:i + turns] if p[0] == pairs[i][0]]
        i += len(group)
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.33 else []
        for _, question, answer in group:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    return out


def byte_level_bpe(texts, vocab_size: int, special_tokens):
    """A byte-level BPE (a ``tokenizers.Tokenizer``) of ``vocab_size`` ids, the special tokens first, learned from
    ``texts`` (an iterable of strings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return bpe


def train_tokenizer(texts: list[str], out: Path) -> None:
    """A byte-level BPE of ``VOCAB_SIZE`` ids with the ChatML template, saved as a transformers tokenizer folder."""
    from transformers import PreTrainedTokenizerFast

    bpe = byte_level_bpe(texts, VOCAB_SIZE, SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))


def write(out: Path, rows: int = 300, root: Path = ROOT) -> dict[str, Path]:
    """Write the dataset files and the tokenizer into ``out``; returns what was written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = qa_pairs(root)
    chats = chat_rows(pairs, rows)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"chats": out / "chats.jsonl", "prompt_completion": out / "prompt_completion.parquet",
             "text": out / "text.jsonl", "tokenizer": out / "tokenizer"}
    paths["chats"].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chats), encoding="utf-8")
    used = pairs[:rows]
    pq.write_table(pa.table({"prompt": [f"Question: {q}\nAnswer: " for _, q, _ in used],
                             "completion": [a for _, _, a in used]}), paths["prompt_completion"])
    paths["text"].write_text("".join(json.dumps({"text": a}, ensure_ascii=False) + "\n" for _, _, a in used),
                             encoding="utf-8")
    train_tokenizer([t for _, q, a in pairs for t in (q, a)] + list(SYSTEM_PROMPTS), paths["tokenizer"])
    return paths


def follow_up(paths: dict[str, Path]) -> str:
    """The command that runs the benchmark on what was written, pasteable into a shell as it is: absolute paths,
    quoted for Hydra where it would read a character otherwise (a comma as a list, a quote, a space), and for the
    shell where it would split or expand one."""
    def arg(key: str, path: Path) -> str:
        value = str(path.resolve())
        if not _HYDRA_PLAIN.fullmatch(value):
            value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        text = f"{key}={value}"
        if shlex.quote(text) == text:
            return text
        return f'"{text}"' if not re.search(r'[$`"\\!]', text) else shlex.quote(text)

    return (f"python -m harness workload=dataset {arg('workload.path', paths['chats'])} "
            f"{arg('workload.tokenizer', paths['tokenizer'])}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.demo_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write (created; its files are replaced)")
    ap.add_argument("--rows", type=int, default=300, help="chat rows to write (default 300)")
    args = ap.parse_args(argv)
    if args.rows <= 0:
        print(f"--rows: must be a positive integer, got {args.rows}", file=sys.stderr)
        return 2
    try:
        paths = write(args.out, args.rows)
    except OSError as exc:
        print(f"{exc.filename or args.out}: cannot write ({exc.strerror or exc})", file=sys.stderr)
        return 2
    n = sum(1 for _ in paths["chats"].open(encoding="utf-8"))
    print(f"wrote {n} chat rows to {paths['chats']}, {paths['prompt_completion'].name}, {paths['text'].name} and a "
          f"{VOCAB_SIZE}-id tokenizer to {paths['tokenizer']}")
    print(follow_up(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
