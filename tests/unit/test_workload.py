"""Workloads: the published generator exactly, lengths files, and the examples built from them."""

from __future__ import annotations

import numpy as np
import pytest

from backends.errors import UserError
from harness.workload import WorkloadSpec, make_examples, mixed_lengths, read_lengths_file, workload_lengths


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
    spec = WorkloadSpec(name="lengths_file", kind="lengths_file", path=str(f))
    assert workload_lengths(spec) == [12, 700, 3]


@pytest.mark.parametrize(
    "content, needle",
    [("10\n0\n", "length 0 is not positive"), ("10\nabc\n", "'abc' is not an integer"), ("\n# nothing\n", "holds no lengths")],
)
def test_bad_lengths_file_names_the_line(tmp_path, content, needle):
    f = tmp_path / "lengths.txt"
    f.write_text(content)
    with pytest.raises(UserError, match=needle) as info:
        read_lengths_file(str(f))
    assert str(info.value).startswith("workload.path:")


def test_bad_generator_values_name_the_key():
    with pytest.raises(UserError, match="workload.n_examples"):
        workload_lengths(WorkloadSpec(name="x", n_examples=0))
    with pytest.raises(UserError, match="workload.max_len"):
        workload_lengths(WorkloadSpec(name="x", min_len=100, max_len=50))
    with pytest.raises(UserError, match="workload.max_len: .* needs max_len >= 344"):
        workload_lengths(WorkloadSpec(name="x", min_len=64, max_len=300))
    with pytest.raises(UserError, match="workload.min_len"):
        workload_lengths(WorkloadSpec(name="x", min_len=300, max_len=5000))
    for max_len in (344, 345, 1000):  # the smallest valid workloads really generate
        assert len(workload_lengths(WorkloadSpec(name="x", n_examples=10, min_len=64, max_len=max_len))) == 10


def test_a_lengths_file_that_is_not_utf8_is_one_line_naming_the_path(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_bytes(b"100\n\xff\xfe200\n")
    with pytest.raises(UserError) as info:
        read_lengths_file(str(f))
    message = str(info.value)
    assert message.startswith("workload.path: ") and str(f) in message and "UTF-8" in message and "\n" not in message
    assert "line 2" in message  # where the first bad byte is


def test_a_lengths_file_with_a_utf8_bom_is_read(tmp_path):
    """Windows editors write a byte-order mark first; it is not part of the first length."""
    f = tmp_path / "lengths.txt"
    f.write_bytes("\ufeff100\n200\n".encode("utf-8"))
    assert read_lengths_file(str(f)) == [100, 200]


def test_a_folder_as_lengths_file_says_it_is_a_folder(tmp_path):
    with pytest.raises(UserError, match=r"workload.path: '.*' is a folder, not a file") as info:
        read_lengths_file(str(tmp_path))
    assert "no such file" not in str(info.value)
    with pytest.raises(UserError, match=r"workload.path: no such file"):
        read_lengths_file(str(tmp_path / "absent.txt"))


@pytest.mark.parametrize("text", ["1_000", "\uff11\uff10\uff10", "\u0661\u0660", "1e3", "0x10", "12.0"])
def test_only_plain_ascii_digits_are_lengths(tmp_path, text):
    """Python's int() takes 1_000, full-width and Arabic-Indic digits; a lengths file takes 0-9 only."""
    f = tmp_path / "lengths.txt"
    f.write_text(f"100\n{text}\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"workload.path: .*lengths.txt:2: .* is not an integer .*0-9") as info:
        read_lengths_file(str(f))
    assert repr(text) in str(info.value)  # shown as Python writes it: invisible or look-alike characters show


def test_signs_and_spaces_around_a_length(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text(" 12 \n+7\n\t30\t# tab\n")
    assert read_lengths_file(str(f)) == [12, 7, 30]
    f.write_text("12\n-3\n")
    with pytest.raises(UserError, match=r"lengths.txt:2: length -3 is not positive"):
        read_lengths_file(str(f))
