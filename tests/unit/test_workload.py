"""Workloads: the published generator exactly, lengths files, and the examples built from them."""

from __future__ import annotations

import numpy as np
import pytest

from backends.errors import UserError
from balance_batch.lengths import load_lengths_file, read_lengths_file
from harness.data.workload import WorkloadSpec, load_workload, make_examples, mixed_lengths, workload_lengths


def test_seed_workload_is_the_published_one():
    lengths = mixed_lengths(128, 64, 32768, 42)
    assert len(lengths) == 128
    assert sum(lengths) == 1_669_550
    assert min(lengths) >= 64 and max(lengths) <= 32768


def test_generator_mix_of_short_middle_and_long():
    lengths = mixed_lengths(100, 64, 8192, 1)
    assert sum(n <= 256 for n in lengths) == 15
    assert sum(n >= 3 * 8192 // 4 for n in lengths) == 15


def test_overrides_change_the_workload():
    base = workload_lengths(WorkloadSpec(name="x", n_examples=16, min_len=64, max_len=512, seed=42))
    assert len(workload_lengths(WorkloadSpec(name="x", n_examples=5, min_len=64, max_len=512, seed=42))) == 5
    assert base != workload_lengths(WorkloadSpec(name="x", n_examples=16, min_len=64, max_len=512, seed=7))
    assert max(workload_lengths(WorkloadSpec(name="x", n_examples=16, min_len=64, max_len=400, seed=42))) <= 400


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_example_counts(n):
    lengths = mixed_lengths(n, 64, 512, 42)
    assert len(lengths) == n and all(64 <= x <= 512 for x in lengths)


def test_examples_targets_and_weights():
    ex = make_examples([5, 8], vocab_size=50, seed=0)
    for e, n in zip(ex, [5, 8]):
        assert len(e) == n and e.target_tokens.shape == (n,) and e.weights.shape == (n,)
        assert (e.input_ids >= 0).all() and (e.input_ids < 50).all()
        assert np.array_equal(e.target_tokens[:-1], e.input_ids[1:])
        assert e.target_tokens[-1] == 0
        assert (e.weights[: n // 2] == 0).all() and (e.weights[n // 2 :] == 1).all()
    again = make_examples([5, 8], vocab_size=50, seed=0)
    assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(ex, again))


def test_lengths_file(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# my data\n12\n\n700  # a long one\n3\n")
    assert read_lengths_file(str(f)) == [12, 700, 3]
    spec = WorkloadSpec(name="lengths_file", kind="lengths_file", path=str(f), n_examples=0)  # as the preset has it
    assert workload_lengths(spec) == [12, 700, 3]
    assert workload_lengths(WorkloadSpec(name="lengths_file", kind="lengths_file", path=str(f), n_examples=None)) == [
        12,
        700,
        3,
    ]


@pytest.mark.parametrize(
    "content, needle",
    [
        ("10\n0\n", "length 0 is not positive"),
        ("10\n100000000000\n", (r"lengths.txt:2: length 100,000,000,000 is longer than any workload may hold "
                                r"\(valid: 1..16,777,216 tokens\)")),  # was an out of memory of 745 GiB
        ("10\nabc\n", "'abc' is not an integer"),
        ("\n# nothing\n", "holds no lengths"),
    ],
)
def test_bad_lengths_file_names_the_line(tmp_path, content, needle):
    f = tmp_path / "lengths.txt"
    f.write_text(content)
    with pytest.raises(UserError, match=needle) as info:
        read_lengths_file(str(f))
    assert str(info.value).startswith(str(f)) or "holds no lengths" in str(info.value)  # the library's own words
    with pytest.raises(UserError, match=needle) as info:
        read_lengths_file(str(f), key="workload.path")
    assert str(info.value).startswith("workload.path: ")  # the harness names the setting first


def test_bad_generator_values_name_the_key():
    with pytest.raises(UserError, match="workload.n_examples"):
        workload_lengths(WorkloadSpec(name="x", n_examples=0))
    with pytest.raises(UserError, match="workload.max_len"):
        workload_lengths(WorkloadSpec(name="x", min_len=100, max_len=50))
    with pytest.raises(UserError, match="workload.max_len: .* needs max_len >= 344"):
        workload_lengths(WorkloadSpec(name="x", min_len=64, max_len=300))
    with pytest.raises(UserError, match="workload.min_len"):
        workload_lengths(WorkloadSpec(name="x", min_len=300, max_len=5000))
    with pytest.raises(UserError, match="workload.max_len: must be at most 16,777,216 tokens"):
        workload_lengths(WorkloadSpec(name="x", max_len=10**11))
    for max_len in (344, 345, 1000):  # the smallest valid workloads really generate
        assert len(workload_lengths(WorkloadSpec(name="x", n_examples=10, min_len=64, max_len=max_len))) == 10


def test_a_lengths_file_that_is_not_utf8_is_one_line_naming_the_path(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_bytes(b"100\n\xff\xfe200\n")
    with pytest.raises(UserError) as info:
        read_lengths_file(str(f), key="workload.path")
    message = str(info.value)
    assert message.startswith("workload.path: ") and str(f) in message and "UTF-8" in message and "\n" not in message
    assert "line 2" in message  # where the first bad byte is


def test_a_lengths_file_with_a_utf8_bom_is_read(tmp_path):
    """Windows editors write a byte-order mark first; it is not part of the first length."""
    f = tmp_path / "lengths.txt"
    f.write_bytes("\ufeff100\n200\n".encode("utf-8"))
    assert read_lengths_file(str(f)) == [100, 200]


def test_a_folder_as_lengths_file_says_it_is_a_folder(tmp_path):
    with pytest.raises(UserError, match=r"^'.*' is a folder, not a file") as info:
        read_lengths_file(str(tmp_path))
    assert "no such file" not in str(info.value)
    with pytest.raises(UserError, match=r"^workload.path: no such file"):
        read_lengths_file(str(tmp_path / "absent.txt"), key="workload.path")


@pytest.mark.parametrize("text", ["1_000", "\uff11\uff10\uff10", "\u0661\u0660", "1e3", "0x10", "12.0"])
def test_only_plain_ascii_digits_are_lengths(tmp_path, text):
    """Python's int() takes 1_000, full-width and Arabic-Indic digits; a lengths file takes 0-9 only."""
    f = tmp_path / "lengths.txt"
    f.write_text(f"100\n{text}\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"^.*lengths.txt:2: .* is not an integer .*0-9") as info:
        read_lengths_file(str(f))
    assert repr(text) in str(info.value)  # shown as Python writes it: invisible or look-alike characters show


def test_signs_and_spaces_around_a_length(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text(" 12 \n+7\n\t30\t# tab\n")
    assert read_lengths_file(str(f)) == [12, 7, 30]
    f.write_text("12\n-3\n")
    with pytest.raises(UserError, match=r"lengths.txt:2: length -3 is not positive"):
        read_lengths_file(str(f))


# --- histograms: length,count lines ---------------------------------------------------------------------------------

HISTOGRAM = "# my corpus\nlength, count\n64 , 10\n\n128,5  # a comment\n4096,1\n"


def _file_spec(path, n_examples=0, seed=42) -> WorkloadSpec:
    return WorkloadSpec(name="lengths_file", kind="lengths_file", path=str(path), n_examples=n_examples, seed=seed)


def test_a_histogram_is_read_as_its_lines(tmp_path):
    f = tmp_path / "lengths.csv"
    f.write_text(HISTOGRAM)
    table = load_lengths_file(str(f))
    assert (
        table.format == "histogram"
        and table.lengths.tolist() == [64, 128, 4096]
        and table.counts.tolist() == [10, 5, 1]
    )
    assert (table.sequences, table.distinct_lengths) == (16, 3)
    assert read_lengths_file(str(f)) == [64] * 10 + [128] * 5 + [4096]  # expanded as listed
    f.write_text("100,2\n100,3\n")  # a length listed twice counts twice
    assert load_lengths_file(str(f)).sequences == 5 and load_lengths_file(str(f)).distinct_lengths == 1
    plain = tmp_path / "plain.txt"
    plain.write_text("5\n5\n7\n")
    table = load_lengths_file(str(plain))
    assert (table.format, table.sequences, table.distinct_lengths, table.counts.tolist()) == (
        "lengths",
        3,
        2,
        [1, 1, 1],
    )


def test_the_whole_histogram_is_every_sequence_once_in_a_seeded_shuffle(tmp_path):
    f = tmp_path / "lengths.csv"
    f.write_text(HISTOGRAM)
    workload = load_workload(_file_spec(f))
    assert sorted(workload.lengths) == sorted(read_lengths_file(str(f)))  # every sequence, once
    assert workload.lengths != sorted(workload.lengths)  # not the sorted order the file lists
    assert workload.lengths == load_workload(_file_spec(f, n_examples=None)).lengths  # null is 0: the whole file
    assert workload.lengths == load_workload(_file_spec(f)).lengths  # the same seed, the same order
    assert workload.lengths != load_workload(_file_spec(f, seed=7)).lengths
    assert workload.file == {"path": str(f), "format": "histogram", "distinct_lengths": 3, "sequences": 16,
                             "sampled": None, "order": "shuffled"}


@pytest.mark.parametrize("content", [HISTOGRAM, "64\n128\n4096\n64\n"], ids=["histogram", "plain"])
def test_n_examples_draws_from_the_file_by_count_with_the_seed(tmp_path, content):
    f = tmp_path / "lengths.csv"
    f.write_text(content)
    drawn = load_workload(_file_spec(f, n_examples=5000))
    assert len(drawn.lengths) == 5000 and set(drawn.lengths) <= {64, 128, 4096}
    assert drawn.lengths == load_workload(_file_spec(f, n_examples=5000)).lengths  # deterministic
    assert drawn.lengths != load_workload(_file_spec(f, n_examples=5000, seed=1)).lengths
    table = load_lengths_file(str(f))
    weights = {
        int(n): int(table.counts[table.lengths == n].sum()) / table.sequences for n in set(table.lengths.tolist())
    }
    for n, p in weights.items():  # weighted by count: 5000 draws land within a few standard deviations
        assert abs(drawn.lengths.count(n) / 5000 - p) < 4 * (p * (1 - p) / 5000) ** 0.5 + 1e-9, (n, p)
    assert drawn.file["sampled"] == 5000 and drawn.file["order"] == "sampled"
    assert drawn.file["format"] == ("histogram" if "," in content else "lengths")


def test_a_million_sequence_histogram_loads_and_draws_in_well_under_a_second(tmp_path):
    import time

    counts = np.full(400, 2500)  # 400 lines, 1,000,000 sequences
    f = tmp_path / "big.csv"
    f.write_text("length,count\n" + "".join(f"{64 + 80 * i},{c}\n" for i, c in enumerate(counts)))
    started = time.perf_counter()
    whole = load_workload(_file_spec(f))
    drawn = load_workload(_file_spec(f, n_examples=100_000))
    elapsed = time.perf_counter() - started
    assert len(whole.lengths) == 1_000_000 and whole.file["sequences"] == 1_000_000 and len(drawn.lengths) == 100_000
    assert elapsed < 1.0, elapsed  # numpy repeat and permutation, never a Python loop per sequence


@pytest.mark.parametrize(
    "content, line, needle",
    [
        ("100,3\n200,0\n", 2, "count 0 is not positive"),
        ("100,3\n200,-4\n", 2, "count -4 is not positive"),
        ("100,3\n200,1.5\n", 2, "count '1.5' is not an integer"),
        ("100,3\n200,x\n", 2, "count 'x' is not an integer"),
        ("length,count\n0,3\n", 2, "length 0 is not positive"),
        ("100,3\n100000000000,2\n", 2, "length 100,000,000,000 is longer than any workload may hold (valid: 1.."),
        ("100,3\n1_000,2\n", 2, "length '1_000' is not an integer"),
        ("100,3\n200,1,7\n", 2, "'200,1,7' has 3 fields (expected length,count"),
        ("100,3\n# fine\n200,\n", 3, "count '' is not an integer"),
        ("100,3\n200\n", 2, "'200' has no count (length,count) in a file of length,count lines (as line 1 is)"),
        ("length,count\n200\n", 2, "in a file of length,count lines (as its header on line 1 says)"),
        ("100\n200,3\n", 2, "'200,3' has a comma (length,count) in a file of one length per line (as line 1 is)"),
        ("100\nabc\n", 2, "'abc' is not an integer (expected a positive length in ASCII digits 0-9: this file is one"),
        ("abc\n", 1, ("'abc' is not an integer (expected one positive length per line, "
                      "in ASCII digits 0-9, or length,count")),
        ("length,count\n", None, "holds no lengths"),
    ],
)
def test_a_bad_line_of_a_histogram_is_one_line_naming_it(tmp_path, content, line, needle):
    f = tmp_path / "lengths.csv"
    f.write_text(content)
    with pytest.raises(UserError) as info:
        load_lengths_file(str(f), key="workload.path")
    message = str(info.value)
    assert message.startswith(f"workload.path: {f}" + (f":{line}: " if line else " ")) and "\n" not in message, message
    assert needle in message, message
    if "fields" in needle or "comma" in needle or "no count" in needle:
        assert "length,count" in message  # what is valid


def test_a_negative_n_examples_for_a_lengths_file_names_the_key(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("100\n")
    with pytest.raises(UserError, match=r"^workload.n_examples: must be >= 0 or null for a lengths file .* got -3$"):
        load_workload(_file_spec(f, n_examples=-3))
    with pytest.raises(UserError, match=r"^workload.n_examples: must be a positive integer, got null$"):
        load_workload(WorkloadSpec(name="x", n_examples=None))


def test_a_relative_lengths_file_is_recorded_absolute(tmp_path, monkeypatch):
    (tmp_path / "lengths.txt").write_text("100\n200\n")
    monkeypatch.chdir(tmp_path)
    workload = load_workload(WorkloadSpec(name="lengths_file", kind="lengths_file", path="lengths.txt", n_examples=0,
                                          min_len=0, max_len=0))
    assert workload.file["path"] == str(tmp_path / "lengths.txt")


def test_a_lengths_files_lines_are_counted_at_newlines_only(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# from a doc\u2028with a line separator\u0085in the comment\n100\nabc\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"lengths.txt:3: 'abc' is not an integer"):
        read_lengths_file(str(f))
    f.write_text("# note\u2029\n100\r\n200\n", encoding="utf-8")
    assert read_lengths_file(str(f)) == [100, 200]


@pytest.mark.parametrize("kind, max_len", [("mixed", 32768), ("chat", 4096)])
def test_a_batch_sized_in_tokens_takes_the_generators_examples_while_they_fit(kind, max_len):
    spec = dict(name="x", kind=kind, n_examples=128, min_len=64, max_len=max_len, seed=42)
    for target in (200_000, 1_000_000):
        lengths = workload_lengths(WorkloadSpec(**spec, n_tokens=target))
        assert target - max_len < sum(lengths) <= target  # the next example would not have fitted
        assert all(64 <= n <= max_len for n in lengths) and len(lengths) != 128  # the preset's count gave way
        assert lengths == workload_lengths(WorkloadSpec(**spec, n_tokens=target))
    assert workload_lengths(WorkloadSpec(**{**spec, "seed": 7}, n_tokens=1_000_000)) != lengths
    alone = workload_lengths(WorkloadSpec(**spec, n_tokens=10))  # a first example over the target runs alone
    assert len(alone) == 1 and alone[0] > 10


def test_a_lengths_file_sized_in_tokens_draws_by_count_until_the_target(tmp_path):
    f = tmp_path / "lengths.csv"
    f.write_text("length,count\n100,5\n2000,3\n")
    w = load_workload(WorkloadSpec(name="lengths_file", kind="lengths_file", path=str(f), n_examples=0,
                                   n_tokens=50_000))
    assert 50_000 - 2000 < sum(w.lengths) <= 50_000 and set(w.lengths) == {100, 2000}
    assert (w.file["sampled"], w.file["order"]) == (len(w.lengths), "sampled")


def test_a_batch_is_sized_once_and_results_json_records_the_target(tmp_path):
    """A dry run in-process as the CLI runs it: the preset's n_examples gives way to a typed n_tokens, recorded
    beside what ran; both typed, or a target that is no positive integer, is one line and exit 2."""
    import json

    from harness.point.point import Point
    from harness.point.results import workload_record
    from harness.point.setup import HydraRun
    from tests.conftest import compose_config, config_error

    def point(name, *typed):
        overrides = ["dry_run=true", "workload=smoke", "logger=none", *typed]
        run = HydraRun(out_dir=tmp_path / name, overrides=overrides, folder_key="hydra.run.dir", group=None)
        code = Point(compose_config(*overrides), run).run()
        return code, json.loads((tmp_path / name / "results.json").read_text())

    code, doc = point("tokens", "workload.n_tokens=3000")
    wl = doc["workload"]
    assert code == 0 and wl["n_tokens"] == 3000 and 3000 - 512 < wl["total_tokens"] <= 3000
    assert wl["n_examples"] == len(json.loads((tmp_path / "tokens" / "plan.json").read_text())["lengths"]) < 16
    assert workload_record(WorkloadSpec(name="smoke"), [300, 200])["n_tokens"] is None  # sized by count
    code, doc = point("both", "workload.n_examples=8", "workload.n_tokens=3000")
    assert code == 2 and doc["error"] == ("workload.n_examples: 8 and workload.n_tokens: 3000 both size the batch "
                                          "(n_examples counts examples; n_tokens takes them until that many tokens); "
                                          "keep one")
    assert config_error("workload.n_tokens=0").startswith("workload.n_tokens: must be a positive integer")
    assert config_error("workload.n_examples=8", "workload.n_tokens=3000") == doc["error"]
