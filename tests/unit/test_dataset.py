"""workload=dataset: rows read from JSONL / JSON / Parquet, tokenized with a local tokenizer, trainer-style weights,
the cache, and one line for every bad input (harness/data/dataset.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from backends.errors import UserError
from harness.data.dataset import dataset_examples, example_weights, load_dataset, tokenizer_fingerprint
from harness.data.demo_data import CHAT_TEMPLATE, VOCAB_SIZE
from harness.data.workload import WorkloadSpec, load_workload
from harness.point.results import workload_record

pytestmark = pytest.mark.unit


def spec(path, tokenizer, cache_dir, **kw) -> WorkloadSpec:
    base = dict(name="dataset", kind="dataset", path=str(path), tokenizer=None if tokenizer is None else str(tokenizer),
                cache_dir=None if cache_dir is None else str(cache_dir),
                truncate_to=None, n_examples=None, shuffle=False)
    return WorkloadSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def tok(demo_data):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_data["tokenizer"]), local_files_only=True)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a budget?"},
        {"role": "assistant", "content": "Tokens per micro-batch."}, {"role": "user", "content": "And packed?"},
        {"role": "assistant", "content": "Sequences end to end, no padding."}]


def test_chat_rows_train_on_the_assistant_turns_and_their_end_of_turn(tmp_path, demo_data, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    d = load_dataset(spec(f, demo_data["tokenizer"], tmp_path / "cache"), None)
    ids, trained = d.ids[0], d.trained[0]
    assert ids.tolist() == tok.apply_chat_template(CHAT, tokenize=True, return_dict=False)  # what the template gives
    assert (
        tok.decode(ids[trained]) == "Tokens per micro-batch.<|im_end|>\nSequences end to end, no padding.<|im_end|>\n"
    )
    assert "What is a budget?" in tok.decode(ids[~trained]) and "Tokens" not in tok.decode(ids[~trained])
    (ex,) = dataset_examples(d)
    # position t predicts token t + 1: weighted exactly where the next token is an assistant token
    assert ex.target_tokens[:-1].tolist() == ids[1:].tolist() and ex.weights[-1] == 0
    assert np.array_equal(ex.weights[:-1] > 0, trained[1:])
    all_tokens = load_dataset(spec(f, demo_data["tokenizer"], tmp_path / "cache", train_on="all"), None)
    assert dataset_examples(all_tokens)[0].weights.sum() == len(ids) - 1


def test_prompt_completion_strings_and_lists_and_text(tmp_path, demo_data, tok):
    f = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "Question: why pack?\nAnswer: ", "completion": "No padding."},
        {"prompt": CHAT[:2], "completion": CHAT[2:3]},
    ])
    d = load_dataset(spec(f, demo_data["tokenizer"], tmp_path / "cache", format="prompt_completion"), None)
    # the completion, then end of sequence; the token " N" that spans the boundary belongs to the completion
    assert tok.decode(d.ids[0][d.trained[0]]) == " No padding.<|im_end|>"
    assert tok.decode(d.ids[0][~d.trained[0]]) == "Question: why pack?\nAnswer:"
    assert tok.decode(d.ids[1][d.trained[1]]) == "Tokens per micro-batch.<|im_end|>\n"
    t = load_dataset(spec(demo_data["text"], demo_data["tokenizer"], tmp_path / "cache", format="text"), None)
    assert all(tr.all() for tr in t.trained) and all(ids[-1] == tok.eos_token_id for ids in t.ids)
    p = load_dataset(spec(demo_data["prompt_completion"], demo_data["tokenizer"], tmp_path / "cache",
                          format="prompt_completion"), None)
    assert p.record["rows"] == t.record["rows"] and all(0 < tr.sum() < tr.size for tr in p.trained)


def test_json_array_json_lines_in_a_json_file_and_a_folder_of_mixed_files(tmp_path, demo_data):
    rows = [{"text": "one two three"}, {"text": "four five"}]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.json").write_text(json.dumps(rows))
    write_jsonl(tmp_path / "d" / "b.json", rows)  # JSON Lines with a .json name, as datasets reads it
    shutil.copy(demo_data["text"], tmp_path / "d" / "c.jsonl")
    d = load_dataset(spec(tmp_path / "d", demo_data["tokenizer"], tmp_path / "cache", format="text"), None)
    n_demo = sum(1 for _ in open(demo_data["text"]))
    assert d.record["rows"] == 4 + n_demo and len(d.record["files"]) == 3
    assert d.ids[0].tolist() == d.ids[2].tolist()  # a.json's row 0 is b.json's line 1


def test_the_cache_is_read_on_a_second_run_and_invalidated_by_a_change(tmp_path, demo_data):
    f = tmp_path / "c.jsonl"
    shutil.copy(demo_data["chats"], f)
    s = spec(f, demo_data["tokenizer"], tmp_path / "cache")
    first = load_dataset(s, None)
    second = load_dataset(s, None)
    assert (first.record["cache"]["hit"], second.record["cache"]["hit"]) == (False, True)
    assert first.record["cache"]["key"] == second.record["cache"]["key"]
    assert all(np.array_equal(a, b) for a, b in zip(first.ids, second.ids))
    assert all(np.array_equal(a, b) for a, b in zip(first.trained, second.trained))
    # options applied after tokenizing reuse the cache; train_on=all needs no masks, so it has a key of its own
    again = load_dataset(spec(f, demo_data["tokenizer"], tmp_path / "cache", truncate_to=64, n_examples=10,
                              shuffle=True), None)
    assert again.record["cache"]["hit"] and again.record["cache"]["key"] == first.record["cache"]["key"]
    every = spec(f, demo_data["tokenizer"], tmp_path / "cache", train_on="all")
    assert [load_dataset(every, None).record["cache"]["hit"] for _ in range(2)] == [False, True]
    assert load_dataset(every, None).ids[5].tolist() == first.ids[5].tolist()
    # the file changed: tokenized again
    with f.open("a") as out:
        out.write(json.dumps({"messages": CHAT}) + "\n")
    changed = load_dataset(s, None)
    assert not changed.record["cache"]["hit"] and changed.record["rows"] == first.record["rows"] + 1
    # the chat template changed: another key
    tok2 = tmp_path / "tok2"
    shutil.copytree(demo_data["tokenizer"], tok2)
    (tok2 / "chat_template.jinja").write_text(CHAT_TEMPLATE + "{#- the same rendering, another template -#}")
    other = load_dataset(spec(f, tok2, tmp_path / "cache"), None)
    assert other.record["cache"]["key"] != changed.record["cache"]["key"] and not other.record["cache"]["hit"]
    # a cache file cut short is tokenized again, not an error
    path = Path(changed.record["cache"]["path"])
    path.write_bytes(path.read_bytes()[:100])
    assert not load_dataset(s, None).record["cache"]["hit"]
    assert (
        load_dataset(spec(f, demo_data["tokenizer"], None, cache=False), None).record["cache"]["path"]
        is None
    )


def test_truncation_sampling_and_order_are_recorded(tmp_path, demo_data):
    s = dict(path=demo_data["chats"], tokenizer=demo_data["tokenizer"], cache_dir=tmp_path / "cache")
    whole = load_dataset(spec(**s), None)
    lengths = np.array(whole.lengths)
    cut = load_dataset(spec(**s, truncate_to=128), None)
    assert max(cut.lengths) == 128
    assert cut.record["truncated"] == int((lengths > 128).sum()) > 0 and cut.record["truncate_to"] == 128
    assert cut.record["tokens_cut"] == int(np.maximum(lengths - 128, 0).sum())
    a = load_dataset(spec(**s, n_examples=20, seed=3), None)
    b = load_dataset(spec(**s, n_examples=20, seed=3), None)
    c = load_dataset(spec(**s, n_examples=20, seed=4), None)
    assert a.lengths == b.lengths and a.lengths != c.lengths and a.record["sampled"] == 20
    assert a.record["order"] == "file order" and set(a.lengths) <= set(whole.lengths)
    shuffled = load_dataset(spec(**s, shuffle=True), None)
    assert sorted(shuffled.lengths) == sorted(whole.lengths) and shuffled.lengths != whole.lengths
    # sized in tokens: the examples in the order drawn, each cut to truncate_to, while their tokens stay within it
    cut_order = load_dataset(spec(**s, shuffle=True, truncate_to=128), None).lengths
    tokens = load_dataset(spec(**s, shuffle=True, truncate_to=128, n_tokens=5000, n_examples=20), None)
    k = len(tokens.lengths)
    assert tokens.lengths == cut_order[:k] and sum(cut_order[:k]) <= 5000 < sum(cut_order[: k + 1])
    assert tokens.record["sampled"] == k and tokens.record["order"] == "shuffled"
    rec = workload_record(spec(**s), whole.lengths, None, whole)
    assert rec["dataset"]["rows"] == 300 and rec["median_len"] == int(np.quantile(lengths, 0.5, method="lower"))
    assert rec["dataset"]["trained_tokens"] == sum(int((e.weights > 0).sum()) for e in dataset_examples(whole))


def test_weights_of_a_one_token_example_and_of_all_tokens():
    assert example_weights(np.array([True]), "completion").tolist() == [0.0]
    assert example_weights(np.array([False, False, True, True]), "completion").tolist() == [0, 1, 1, 0]
    assert example_weights(np.array([False, False, True]), "all").tolist() == [1, 1, 0]


def test_the_vocabulary_is_checked_against_the_model(tmp_path, demo_data):
    from backends.specs import ModelSpec

    s = spec(demo_data["chats"], demo_data["tokenizer"], tmp_path / "cache")
    ok = load_workload(s, ModelSpec())  # the tiny model's 2,048 ids: the demo tokenizer's
    largest = ok.dataset.record["largest_id"]  # the demo text is the checkout's docs: the largest id follows them
    assert 1024 <= largest < VOCAB_SIZE
    with pytest.raises(UserError, match=rf"token id {largest:,} .* vocabulary of model tiny, 1,024 ids .* at least "
                                        rf"{largest + 1:,}"):
        load_workload(s, ModelSpec(vocab_size=1024))
    with pytest.raises(UserError, match="vocabulary of the server"):
        ok.examples(1000, 0, "the server")
    assert len(ok.examples(VOCAB_SIZE, 0)) == 300


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("case, match", [
    ("missing", r"workload.path: no such file or folder '.*nope.jsonl'"),
    ("suffix", r"workload.path: '.*rows.csv' is not a .jsonl, .json or .parquet file"),
    ("empty_folder", r"the folder '.*empty' holds no .jsonl"),
    ("bad_line", r"workload.path: .*bad.jsonl:2: not a JSON object"),
    ("no_key", r"workload.path: .*nokey.jsonl:1: no 'messages' key .*keys here: conversation"),
    ("not_messages", r"nomsg.jsonl:1: messages\[1\].content is a number \(3\), not a string"),
    ("content_parts", (r"parts.jsonl:1: messages\[0\].content is a list \(\[\{\"type\": \"text\", .*…\), not a "
                       r"string \(a list of content parts")),
    ("no_role", r"norole.jsonl:1: messages\[0\] has no 'role' \(keys content; "),
    ("empty_file", r"workload.path: .*empty.jsonl holds no rows"),
    ("not_parquet", r"workload.path: .*fake.parquet is not a readable Parquet file"),
    ("array", r"holds a JSON dict, not an array of rows"),
    ("pc_missing", r"pc.jsonl:1: no 'completion' key"),
    ("latin1", r"workload.path: .*latin1.jsonl is not UTF-8 text \(byte 0xe9 on line 2; JSON rows are UTF-8\)"),
])
def test_bad_data_is_one_line_naming_the_file_and_row(tmp_path, demo_data, case, match):
    fmt = "prompt_completion" if case == "pc_missing" else "messages"
    path = {
        "missing": tmp_path / "nope.jsonl",
        "suffix": tmp_path / "rows.csv",
        "empty_folder": tmp_path / "empty",
        "bad_line": tmp_path / "bad.jsonl",
        "no_key": write_jsonl(tmp_path / "nokey.jsonl", [{"conversation": CHAT}]),
        "not_messages": write_jsonl(
            tmp_path / "nomsg.jsonl", [{"messages": [CHAT[0], {"role": "user", "content": 3}]}]
        ),
        "content_parts": write_jsonl(
            tmp_path / "parts.jsonl",
            [
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": "What is a budget, in tokens per micro-batch?"}],
                        }
                    ]
                }
            ],
        ),
        "no_role": write_jsonl(tmp_path / "norole.jsonl", [{"messages": [{"content": "hi"}]}]),
        "empty_file": tmp_path / "empty.jsonl",
        "not_parquet": tmp_path / "fake.parquet",
        "array": tmp_path / "obj.json",
        "pc_missing": write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "x"}]),
        "latin1": tmp_path / "latin1.jsonl",
    }[case]
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "rows.csv").write_text("a,b\n")
    (tmp_path / "empty").mkdir(exist_ok=True)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n{not json\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "fake.parquet").write_text("not parquet")
    (tmp_path / "obj.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(UserError, match=match) as exc:
        load_dataset(spec(path, demo_data["tokenizer"], tmp_path / "cache", format=fmt), None)
    _one_line(exc)


def test_bad_tokenizers_and_options_are_one_line(tmp_path, demo_data):
    chats = demo_data["chats"]
    cases = []
    with pytest.raises(UserError, match=r"workload.tokenizer: no such folder '.*nowhere'") as e:
        load_dataset(spec(chats, tmp_path / "nowhere", tmp_path / "cache"), None)
    cases.append(e)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(UserError, match=r"workload.tokenizer: '.*broken' does not load as a tokenizer") as e:
        load_dataset(spec(chats, broken, tmp_path / "cache"), None)
    cases.append(e)
    no_template = tmp_path / "no_template"
    shutil.copytree(demo_data["tokenizer"], no_template)
    (no_template / "chat_template.jinja").unlink()
    with pytest.raises(UserError, match=r"'.*no_template' has no chat template, and workload.format=messages renders "
                                        r".*chats.jsonl:1 with one") as e:
        load_dataset(spec(chats, no_template, tmp_path / "cache"), None)
    cases.append(e)
    assert load_dataset(spec(demo_data["text"], no_template, tmp_path / "cache", format="text"), None).record["rows"]
    with pytest.raises(UserError, match=r"workload.tokenizer: not set, and the model has no folder") as e:
        load_dataset(spec(chats, None, tmp_path / "cache"), None)
    cases.append(e)
    for key, value, match in (("format", "chatml", r"workload.format: 'chatml' is not a format \(valid: messages, "),
                              ("train_on", "prompt", r"workload.train_on: 'prompt' is not valid"),
                              ("n_examples", 10_000, r"workload.n_examples: 10,000, but .* has 300 examples"),
                              ("n_tokens", 10**9, r"workload.n_tokens: 1,000,000,000, but .* holds [\d,]+ tokens"),
                              ("truncate_to", -1, r"workload.truncate_to: must be a positive integer")):
        with pytest.raises(UserError, match=match) as e:
            load_dataset(spec(chats, demo_data["tokenizer"], tmp_path / "cache", **{key: value}), None)
        cases.append(e)
    for e in cases:
        _one_line(e)


def test_a_template_that_renders_a_turn_differently_in_context_is_named(tmp_path, demo_data):
    tok = tmp_path / "tok"
    shutil.copytree(demo_data["tokenizer"], tok)
    # earlier assistant turns are shortened inside the whole conversation (as some reasoning templates drop thoughts)
    (tok / "chat_template.jinja").write_text(
        "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not loop.last "
        "-%}<|im_start|>assistant\n...<|im_end|>\n"
        "{%- else -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(UserError, match=r"c.jsonl:1: the chat template renders turn 2 differently "
                                        r".*workload.train_on=all"):
        load_dataset(spec(f, tok, tmp_path / "cache"), None)
    every = load_dataset(spec(f, tok, tmp_path / "cache", train_on="all"), None)  # what the message offers works
    assert dataset_examples(every)[0].weights.sum() == every.lengths[0] - 1
    with pytest.raises(UserError, match=r"train_on: completion, but none of the 1 examples has a completion"):
        load_dataset(spec(write_jsonl(tmp_path / "u.jsonl", [{"messages": CHAT[:2]}]), demo_data["tokenizer"],
                          tmp_path / "cache"), None)


def test_examples_with_nothing_to_train_name_the_setting_that_trains_some(tmp_path, demo_data):
    """train_on=all truncate_to=1 once advised "use train_on=all"; the advice now names what works, checked here."""
    import re

    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    at = lambda **kw: spec(f, demo_data["tokenizer"], tmp_path / "cache", **kw)  # noqa: E731
    with pytest.raises(UserError) as one_token:
        load_dataset(at(train_on="all", truncate_to=1), None)
    line = str(one_token.value)
    assert line.startswith("workload.train_on: all, but each of the 1 examples is one token long") and "\n" not in line
    assert line.endswith("; set workload.truncate_to=2 or more (0: no truncation)"), line
    assert load_dataset(at(train_on="all", truncate_to=2), None).record["trained_tokens"] == 1
    # completion, cut before the first assistant token: the least truncate_to that keeps one, or train_on=all
    with pytest.raises(UserError) as cut:
        load_dataset(at(truncate_to=3), None)
    need = int(re.search(r"set workload.truncate_to=(\d+) or more \(0: no truncation\) or workload.train_on=all$",
                         str(cut.value)).group(1))
    assert load_dataset(at(truncate_to=need), None).record["trained_tokens"] == 1
    with pytest.raises(UserError, match=f"truncate_to={need} or more"):
        load_dataset(at(truncate_to=need - 1), None)


def test_the_demo_data_is_made_the_same_way_twice_and_fits_the_tiny_model(tmp_path, demo_data, tok):
    from harness.data.demo_data import write

    again = write(tmp_path / "again")
    for name in ("chats", "text", "prompt_completion"):
        assert Path(again[name]).read_bytes() == Path(demo_data[name]).read_bytes()
    assert tokenizer_fingerprint(again["tokenizer"], tok) == tokenizer_fingerprint(Path(demo_data["tokenizer"]), tok)
    assert len(tok) == VOCAB_SIZE and tok.chat_template == CHAT_TEMPLATE
    rows = [json.loads(line) for line in open(demo_data["chats"])]
    assert len(rows) == 300 and {m["role"] for r in rows for m in r["messages"]} == {"system", "user", "assistant"}


def test_an_edit_that_keeps_the_size_and_time_is_tokenized_again(tmp_path, demo_data):
    # cp -p, rsync, tar and touch -r give an edited file its old time: the cache is keyed on the bytes
    import os

    f = tmp_path / "t.jsonl"
    write_jsonl(f, [{"text": "the budget is small"}, {"text": "pad nothing"}])
    s = spec(f, demo_data["tokenizer"], tmp_path / "cache", format="text")
    first = load_dataset(s, None)
    stat = f.stat()
    write_jsonl(f, [{"text": "the budget is large"}, {"text": "pad nothing"}])  # same size
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert f.stat().st_size == stat.st_size and f.stat().st_mtime_ns == stat.st_mtime_ns
    edited = load_dataset(s, None)
    assert not edited.record["cache"]["hit"] and edited.record["cache"]["key"] != first.record["cache"]["key"]
    assert edited.ids[0].tolist() != first.ids[0].tolist()
    assert load_dataset(s, None).record["cache"]["hit"]  # and read back from the cache next time


def test_an_opening_assistant_turn_trains_its_reply_not_its_role_header(tmp_path, demo_data, tok):
    chat = [{"role": "assistant", "content": "Hello, ask me about budgets."}, *CHAT[1:]]
    d = load_dataset(spec(write_jsonl(tmp_path / "a.jsonl", [{"messages": chat}]), demo_data["tokenizer"],
                          tmp_path / "cache"), None)
    ids, trained = d.ids[0], d.trained[0]
    # every assistant turn alike: its content and end of turn, never "<|im_start|>assistant\n"
    assert tok.decode(ids[trained]) == ("Hello, ask me about budgets.<|im_end|>\nTokens per micro-batch.<|im_end|>\n"
                                        "Sequences end to end, no padding.<|im_end|>\n")
    assert tok.decode(ids[~trained]).startswith("<|im_start|>assistant\n")


def test_a_cache_dir_that_is_a_file_is_one_line_before_anything_is_tokenized(tmp_path, demo_data):
    blocker = tmp_path / "cache_file"
    blocker.write_text("")
    for cache_dir, where in ((blocker, "is a file"), (blocker / "sub", "lies under the file")):
        with pytest.raises(UserError, match=rf"workload.cache_dir: '.*' {where}.* not a folder .*workload.cache=false"
                           ) as e:
            load_dataset(spec(demo_data["text"], demo_data["tokenizer"], cache_dir, format="text"), None)
        _one_line(e)
        # with no cache a cache_dir would be ignored: refused whatever it is (it was taken, and did nothing)
        with pytest.raises(UserError, match=r"workload.cache_dir: '.*' is set, and workload.cache=false reads and "
                                            r"writes no cache, so it would be ignored") as e:
            load_dataset(spec(demo_data["text"], demo_data["tokenizer"], cache_dir, format="text", cache=False), None)
        _one_line(e)
    uncached = spec(demo_data["text"], demo_data["tokenizer"], None, format="text", cache=False)
    assert load_dataset(uncached, None).record["cache"]["path"] is None


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\u0085"])
def test_json_lines_split_at_newlines_only(tmp_path, demo_data, tok, sep):
    # json.dumps(ensure_ascii=False) leaves these raw inside a string; they end no line
    f = tmp_path / "u.jsonl"
    f.write_text(json.dumps({"text": f"one{sep}two"}, ensure_ascii=False) + "\n\n{broken\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"u.jsonl:3: not a JSON object"):
        load_dataset(spec(f, demo_data["tokenizer"], tmp_path / "cache", format="text"), None)
    f.write_text(json.dumps({"text": f"one{sep}two"}, ensure_ascii=False) + "\r\n", encoding="utf-8")
    d = load_dataset(spec(f, demo_data["tokenizer"], tmp_path / "cache", format="text"), None)
    assert d.record["rows"] == 1 and tok.decode(d.ids[0]) == f"one{sep}two<|im_end|>"


def test_a_miscased_assistant_role_and_a_truncation_that_cuts_every_trained_token_are_warned_once(
        tmp_path, demo_data, caplog):
    import logging

    rows = [{"messages": CHAT}, {"messages": [CHAT[1], {"role": "Assistant", "content": "Tokens."}]}]
    s = spec(write_jsonl(tmp_path / "r.jsonl", rows), demo_data["tokenizer"], tmp_path / "cache")
    for _ in range(2):  # tokenized, then read from the cache: warned both times
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="harness"):
            load_dataset(s, None)
        (line,) = [r.getMessage() for r in caplog.records]
        assert "1 turns in 1 of 2 rows have the role 'Assistant'" in line and "write 'assistant'" in line
    # roles of another convention (human/bot): those rows train nothing, said once
    other = [{"messages": [{"role": "human", "content": "Hi?"}, {"role": "bot", "content": "Hello."}]}]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="harness"):
        load_dataset(spec(write_jsonl(tmp_path / "o.jsonl", [{"messages": CHAT}, *other]), demo_data["tokenizer"],
                          tmp_path / "cache"), None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "1 of 2 rows have no turn with the role 'assistant' (roles there include 'bot', 'human'" in line, line
    whole = load_dataset(spec(demo_data["chats"], demo_data["tokenizer"], tmp_path / "cache"), None)
    limit = 64
    emptied = sum(1 for t in whole.trained if t.size > limit and t[1:].any() and not t[1:limit].any())
    assert emptied > 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="harness"):
        load_dataset(spec(demo_data["chats"], demo_data["tokenizer"], tmp_path / "cache", truncate_to=limit), None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"workload.truncate_to=64 cut every trained token from {emptied} of the 300 examples" in line


def test_relative_paths_are_recorded_absolute(tmp_path, demo_data, monkeypatch):
    import os

    monkeypatch.chdir(demo_data["chats"].parent)
    d = load_dataset(spec("chats.jsonl", "tokenizer", "cache_rel"), None)
    rec = d.record
    assert rec["path"] == rec["files"][0] == str(demo_data["chats"]) and os.path.isabs(rec["tokenizer"]["path"])
    assert rec["tokenizer"]["path"] == str(demo_data["tokenizer"]) and os.path.isabs(rec["cache"]["path"])


@pytest.mark.parametrize("folder", ["plain", "my data, v2", "it's here", "a~b$HOME"])
def test_the_demo_datas_follow_up_command_pastes_into_a_shell_as_it_is(tmp_path, folder):
    import shlex

    from harness.data.demo_data import follow_up
    from tests.conftest import compose_config

    out = tmp_path / folder
    line = follow_up({"chats": out / "chats.jsonl", "tokenizer": out / "tokenizer"})
    argv = shlex.split(line)  # what the shell passes
    assert argv[:4] == ["python", "-m", "harness", "workload=dataset"]
    cfg = compose_config(*argv[3:])
    assert (cfg.workload.path, cfg.workload.tokenizer) == (str(out / "chats.jsonl"), str(out / "tokenizer"))
    assert ("'" not in line) == (folder == "plain")
