"""``balance_batch.pack``: every index once, the capacity held, an oversize sequence alone, the same rows as
best-fit decreasing done one sequence at a time, never fewer than the optimum a brute force finds on small cases;
oversize sequences truncated or split into pieces, the wrapped layout, 0-token sequences in no row; the peers'
corpus packers valid; the command line on each input it reads."""

from __future__ import annotations

import functools
import math
import runpy
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from balance_batch.corpus import Packing, pack
from balance_batch.stats import lower_bound_bins
from harness.peers.corpus_packers import histogram_packer, rows_of, torchtune_greedy, trl_bfd


def check_packing(p: Packing, lengths, capacity: int, max_seqs=None) -> None:
    """Every index exactly once, each row within the capacity (or one oversize sequence alone), longest first."""
    lengths = np.asarray(lengths, dtype=np.int64)
    assert p.indices.dtype == np.int64 and p.offsets.dtype == np.int64
    assert p.offsets[0] == 0 and p.offsets[-1] == len(lengths) and np.all(np.diff(p.offsets) >= 1)
    assert np.array_equal(np.sort(p.indices), np.arange(len(lengths)))
    if not p.rows:
        return
    laid = lengths[p.indices]
    tokens, widths = np.add.reduceat(laid, p.offsets[:-1]), np.diff(p.offsets)
    lone = (widths == 1) & (tokens > capacity)
    assert np.all((tokens <= capacity) | lone)
    assert max_seqs is None or np.all(widths <= max_seqs)
    inside = np.ones(len(laid) - 1, dtype=bool)
    inside[p.offsets[1:-1] - 1] = False  # the step from a row's last sequence to the next row's first
    assert np.all(np.diff(laid)[inside] <= 0), "longest first within a row"
    assert p.rows >= p.lower_bound


def optimum(lengths, capacity: int, max_seqs=None) -> int:
    """The fewest rows, by brute force over subsets (a few sequences only): oversize ones alone."""
    small = [n for n in lengths if n <= capacity]
    over = len(lengths) - len(small)
    k = len(small)
    fits = [sum(small[i] for i in range(k) if m >> i & 1) <= capacity
            and (max_seqs is None or bin(m).count("1") <= max_seqs) for m in range(1 << k)]

    @functools.lru_cache(maxsize=None)
    def best(mask: int) -> int:
        if not mask:
            return 0
        low = mask & -mask  # the row of the lowest sequence left: any subset of the rest that holds it
        rest, sub, out = mask ^ low, mask ^ low, math.inf
        while True:
            if fits[sub | low]:
                out = min(out, 1 + best(rest ^ sub))
            if not sub:
                return out
            sub = (sub - 1) & rest

    return over + best((1 << k) - 1)


small_cases = st.integers(1, 40).flatmap(
    lambda c: st.tuples(st.lists(st.integers(1, c + 10), max_size=9), st.just(c), st.sampled_from([None, 1, 2, 3])))


@settings(max_examples=150, deadline=None)
@given(small_cases)
def test_small_cases_against_brute_force(case):
    lengths, capacity, max_seqs = case
    p = pack(lengths, capacity, max_seqs_per_row=max_seqs)
    check_packing(p, lengths, capacity, max_seqs)
    best = optimum(lengths, capacity, max_seqs)
    assert p.lower_bound <= best <= p.rows
    assert p.lower_bound == lower_bound_bins(lengths, capacity, max_seqs=max_seqs)
    # best-fit decreasing's own guarantee (11/9 of the optimum, plus one)
    assert p.rows <= math.floor(11 * best / 9) + 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 600).flatmap(lambda c: st.tuples(st.lists(st.integers(1, 2 * c), max_size=400), st.just(c))))
@example(([67, 67, 105, 105, 106, 106, 172], 382))  # best-fit decreasing takes 3 rows; 2 hold them
def test_never_more_rows_than_best_fit_decreasing_one_at_a_time(case):
    """Planning on the histogram loses nothing against placing each sequence in turn (TRL's way); where few rows
    are enough, the exact search may find fewer (the rows themselves may differ where two rows tie for the best
    fit)."""
    lengths, capacity = case
    p = pack(np.asarray(lengths, dtype=np.int32), capacity)
    check_packing(p, lengths, capacity)
    assert p.rows <= len(trl_bfd(lengths, capacity))


def test_a_large_skewed_corpus_is_exact_and_near_its_bound():
    """10^5 sequences, a fifth at the capacity (the bench's pre-training stand-in): every index once, within 0.1% of
    the bound."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(160), 0.9, 100_000)), 1, 511).astype(np.int64)
    lengths[rng.random(lengths.size) < 0.2] = 512
    p = pack(lengths, 512)
    check_packing(p, lengths, 512)
    assert p.lower_bound == math.ceil(lengths.sum() / 512)
    assert p.bound_ratio >= 0.999
    assert [int(t) for t in p.row_tokens()[:500]] == [int(lengths[p.row(r)].sum()) for r in range(500)]


def test_oversize_alone_first_or_refused_and_bad_arguments():
    p = pack([5, 600, 3, 700, 512, 1], 512)
    assert [p.row(r).tolist() for r in range(p.rows)] == [[3], [1], [4], [0, 2, 5]]
    assert p.efficiency == pytest.approx((5 + 600 + 3 + 700 + 512 + 1) / (700 + 600 + 512 + 512))
    with pytest.raises(ValueError, match=r"lengths\[1\] = 600 is over the capacity 512"):
        pack([5, 600], 512, oversize="error")
    for bad, match in [(dict(capacity=0), "capacity must be a positive integer"),
                       (dict(capacity=2.5), "capacity must be a positive integer"),
                       (dict(capacity=8, max_seqs_per_row=0), "max_seqs_per_row"),
                       (dict(capacity=8, oversize="drop"), "oversize must be one of alone, error")]:
        with pytest.raises(ValueError, match=match):
            pack([1, 2], **bad)
    with pytest.raises(ValueError, match=r"lengths\[1\] = -2: a length is a count of tokens, 0 or more"):
        pack([3, -2], 8)
    with pytest.raises(ValueError, match="pack: lengths must be a flat sequence of token counts"):
        pack([[1, 2]], 8)
    empty = pack([], 8)
    assert empty.rows == 0 and empty.indices.size == 0 and empty.offsets.tolist() == [0]


def test_the_peers_corpus_packers_pack_every_sequence_once():
    rng = np.random.default_rng(3)
    for _ in range(40):
        capacity = int(rng.integers(1, 50))
        lengths = rng.integers(1, capacity + 10, int(rng.integers(0, 80))).tolist()
        for packer in (trl_bfd, torchtune_greedy):
            rows = packer(lengths, capacity)
            assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
            assert all(len(row) == 1 or sum(lengths[i] for i in row) <= capacity for row in rows)
        for fullest in (True, False):
            for max_seqs in (3, None):
                strategies = histogram_packer(lengths, capacity, fullest, max_seqs)
                held = Counter()
                for count, row in strategies:
                    assert count > 0 and sum(row) <= capacity and (max_seqs is None or len(row) <= max_seqs)
                    held.update({n: count * k for n, k in Counter(row).items()})
                assert held == Counter(n for n in lengths if n <= capacity)
                assert rows_of(strategies) >= pack(lengths, capacity).lower_bound


def run_cli(*args: str) -> int:
    saved = sys.argv
    sys.argv = ["balance_batch.pack", *args]
    try:
        runpy.run_module("balance_batch.pack", run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = saved
    return 0


def test_command_line_packs_each_input_and_refuses_in_one_line(tmp_path, capsys):
    lengths = np.array([100] * 30 + [400] * 7)
    (tmp_path / "hist.txt").write_text("length,count\n100,30\n400,7\n")
    np.save(tmp_path / "lengths.npy", lengths)
    np.savez(tmp_path / "cache.npz", offsets=np.concatenate([[0], np.cumsum(lengths)]), key=np.asarray("k"))
    for name in ("hist.txt", "lengths.npy", "cache.npz"):
        assert run_cli(str(tmp_path / name), "--capacity", "512") == 0
        out = capsys.readouterr()
        written = tmp_path / f"{name}.packed512.npz"  # the input's whole name: x.txt and x.npy never clash
        assert "37 sequences into 12 rows of 512 tokens" in out.out and str(written) in out.out
        assert "reading" in out.err and "packing into rows of 512" in out.err
        with np.load(written) as z:
            assert int(z["capacity"]) == 512
            p = Packing(z["indices"], z["offsets"], 512, lengths, 12)
            check_packing(p, lengths, 512)
    assert run_cli(str(tmp_path / "missing.txt"), "--capacity", "512") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"python -m balance_batch.pack: no such file '{tmp_path / 'missing.txt'}' (expected a lengths file, a .npy "
        "array or a tokenized cache .npz)")
    assert run_cli(str(tmp_path / "lengths.npy"), "--capacity", "300", "--oversize", "error") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "lengths[30] = 400 is over the capacity 300 (--oversize alone gives it a row of its own, truncate cuts it, "
        "split packs its pieces)")
    assert run_cli(str(tmp_path / "lengths.npy"), "--capacity", "0") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--capacity: 0 is not positive" in err[0]
    (tmp_path / "bad.txt").write_text("12\nx\n")
    assert run_cli(str(tmp_path / "bad.txt"), "--capacity", "8") == 2
    assert f"{tmp_path / 'bad.txt'}:2: 'x' is not an integer" in capsys.readouterr().err


def covered(p: Packing) -> dict[int, list[tuple[int, int]]]:
    """Each sequence's pieces as (first token, tokens), in the order the rows hold them."""
    out: dict[int, list[tuple[int, int]]] = {}
    for r in range(p.rows):
        for i, start, size in zip(*(a.tolist() for a in p.pieces(r))):
            out.setdefault(i, []).append((start, size))
    return out


pieces_cases = st.integers(1, 30).flatmap(lambda c: st.tuples(st.lists(st.integers(0, 4 * c), max_size=40),
                                                                st.just(c), st.sampled_from([None, 2])))


@settings(max_examples=80, deadline=None)
@given(pieces_cases)
def test_truncate_split_and_wrapped_place_each_token_once_and_0_tokens_nowhere(case):
    lengths, capacity, max_seqs = case
    arr = np.asarray(lengths, dtype=np.int64)
    empty = [i for i, n in enumerate(lengths) if n == 0]
    over = [i for i, n in enumerate(lengths) if n > capacity]
    for how in ("alone", "truncate", "split", "wrapped"):
        p = pack(lengths, capacity, **(dict(strategy="wrapped") if how == "wrapped" else
                                       dict(oversize=how, max_seqs_per_row=max_seqs)))
        assert p.empty.tolist() == empty and p.truncated.tolist() == (over if how == "truncate" else [])
        pieces, tokens = covered(p), p.row_tokens()
        assert sorted(pieces) == [i for i, n in enumerate(lengths) if n]  # every sequence with tokens, none without
        assert tokens.sum() == p.tokens == sum(min(n, capacity) if how == "truncate" else n for n in lengths)
        assert p.rows >= p.lower_bound and np.all(np.diff(p.offsets) >= 1)
        for i, parts in pieces.items():
            if how == "truncate":  # the first capacity tokens, once
                assert parts == [(0, min(lengths[i], capacity))]
                continue
            # pieces that tile the sequence: split's in rows longest first (its full pieces first), wrapped's in order
            parts = sorted(parts)
            assert [s for s, _ in parts] == [0, *np.cumsum([n for _, n in parts])[:-1].tolist()]
            assert sum(n for _, n in parts) == lengths[i]
            if how == "split":
                assert all(n == capacity for _, n in parts[:-1]) and len(parts) == -(-lengths[i] // capacity)
            elif how == "alone":
                assert len(parts) == 1
        if how == "wrapped":  # every row exactly the capacity but the last; the corpus in order
            assert np.all(tokens[:-1] == capacity) and 0 < tokens[-1] <= capacity if p.rows else arr.sum() == 0
            assert p.rows == p.lower_bound == -(-arr.sum() // capacity)
            assert np.all(np.diff(p.indices) >= 0)
        else:
            assert np.all(tokens <= capacity) or how == "alone"
            assert max_seqs is None or np.all(np.diff(p.offsets) <= max_seqs)


def test_oversize_truncated_or_split_and_the_wrapped_layout_by_hand():
    p = pack([5, 1100, 0, 3, 700, 512, 1], 512, oversize="split")
    rows = [[t.tolist() for t in p.pieces(r)] for r in range(p.rows)]
    # the full pieces and the 512 alone; the remainders 188 (of 700) and 76 (of 1100) packed with the short ones
    assert rows == [[[1], [0], [512]], [[1], [512], [512]], [[4], [0], [512]], [[5], [0], [512]],
                    [[4, 1, 0, 3, 6], [512, 1024, 0, 0, 0], [188, 76, 5, 3, 1]]]
    assert p.empty.tolist() == [2] and p.rows == p.lower_bound == 5
    t = pack([5, 1100, 0, 3, 700, 512, 1], 512, oversize="truncate")
    assert t.truncated.tolist() == [1, 4] and t.piece_lengths[t.indices == 1].tolist() == [512]
    assert t.tokens == 5 + 512 + 3 + 512 + 512 + 1 and t.rows == 4
    w = pack([5, 1100, 0, 3, 700, 512, 1], 512, strategy="wrapped")
    assert [[a.tolist() for a in w.pieces(r)] for r in range(w.rows)] == [
        [[0, 1], [0, 0], [5, 507]], [[1], [507], [512]], [[1, 3, 4], [1019, 0, 0], [81, 3, 428]],
        [[4, 5], [428, 0], [272, 240]], [[5, 6], [240, 0], [272, 1]]]
    assert w.row_tokens().tolist() == [512, 512, 512, 512, 273] and w.empty.tolist() == [2]
    whole = pack([0, 4, 0, 3], 8)  # no piece anywhere: the whole-sequence arrays only
    assert whole.piece_starts is None and whole.indices.tolist() == [1, 3] and whole.empty.tolist() == [0, 2]
    assert pack([0, 0], 8).rows == 0 and pack([0, 0], 8, strategy="wrapped").rows == 0
    for bad, match in [(dict(strategy="greedy"), "pack: strategy must be one of bfd, wrapped, got 'greedy'"),
                       (dict(strategy="wrapped", oversize="split"),
                        "pack: oversize='split' does not apply to strategy='wrapped'"),
                       (dict(strategy="wrapped", max_seqs_per_row=2, oversize="error"),
                        "oversize='error' and max_seqs_per_row=2 do not apply")]:
        with pytest.raises(ValueError, match=match):
            pack([1, 2], 8, **bad)


def test_command_line_names_refusals_and_the_new_options(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.array([100, 0, 900, 300]))
    (tmp_path / "x.txt").write_text("100\n900\n300\n")
    for name in ("x.npy", "x.txt"):
        assert run_cli(str(tmp_path / name), "--capacity", "512") == 0
    assert (tmp_path / "x.npy.packed512.npz").is_file() and (tmp_path / "x.txt.packed512.npz").is_file()
    assert run_cli(str(tmp_path / "x.npy"), "--capacity", "512", "--oversize", "split") == 0
    assert "4 sequences, 1 empty (in no row) into 3 rows" in capsys.readouterr().out
    with np.load(tmp_path / "x.npy.packed512.npz") as z:
        assert z["empty"].tolist() == [1] and z["piece_lengths"].tolist() == [512, 388, 100, 300]
        assert z["indices"].tolist() == [2, 2, 0, 3] and z["piece_starts"].tolist() == [0, 512, 0, 0]
    assert run_cli(str(tmp_path / "x.npy"), "--capacity", "512", "--strategy", "wrapped") == 0
    with np.load(tmp_path / "x.npy.wrapped512.npz") as z:
        assert z["offsets"].tolist() == [0, 2, 4, 5] and z["piece_lengths"].tolist() == [100, 412, 488, 24, 276]
    for args, line in [
        ([str(tmp_path), "--capacity", "8"], f"'{tmp_path}' is a folder, not a file"),
        (["x.npy", "--capacity", "8", "--out", str(tmp_path / "rows.npy")],
         f"--out: '{tmp_path / 'rows.npy'}' must end in .npz (the rows are several arrays"),
        (["x.npy", "--capacity", "8", "--strategy", "wrapped", "--oversize", "truncate"],
         "--oversize truncate does not apply to --strategy wrapped"),
    ]:
        args[0] = args[0] if args[0] == str(tmp_path) else str(tmp_path / args[0])
        assert run_cli(*args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("python -m balance_batch.pack: ") and line in err[-1], err
        assert not any("Traceback" in e for e in err)
    assert run_cli(".", "--capacity", "8") == 2  # as typed: once a traceback (no name to write '.packed8.npz' to)
    assert capsys.readouterr().err.strip() == ("python -m balance_batch.pack: '.' is a folder, not a file (expected "
                                               "a lengths file, a .npy array or a tokenized cache .npz)")


def test_command_line_takes_a_0_length_from_every_input_and_refuses_a_negative_one_in_one_line(tmp_path, capsys):
    lengths = np.array([100, 0, 900, 0, 0, 300])
    np.save(tmp_path / "x.npy", lengths)
    (tmp_path / "x.txt").write_text("100\n0\n900\n0\n0\n300\n")
    (tmp_path / "h.txt").write_text("length,count\n100,1\n0,1\n900,1\n0,2\n300,1\n")  # the same, as a histogram
    np.savez(tmp_path / "x.npz", offsets=np.concatenate([[0], np.cumsum(lengths)]))
    for name in ("x.npy", "x.txt", "h.txt", "x.npz"):
        assert run_cli(str(tmp_path / name), "--capacity", "512") == 0
        assert "6 sequences, 3 empty (in no row) into 2 rows" in capsys.readouterr().out
        with np.load(tmp_path / f"{name}.packed512.npz") as z, np.load(tmp_path / "x.npy.packed512.npz") as npy:
            assert {k: z[k].tolist() for k in z.files} == {k: npy[k].tolist() for k in npy.files}
            assert z["empty"].tolist() == [1, 3, 4]
    np.save(tmp_path / "neg.npy", np.array([100, 0, -3, 7]))
    (tmp_path / "neg.txt").write_text("100\n0\n-3\n7\n")
    (tmp_path / "neg-h.txt").write_text("length,count\n100,1\n-3,2\n")
    np.savez(tmp_path / "neg.npz", offsets=np.array([0, 100, 100, 97, 104]))
    for name, line in [
        ("neg.npy", (f"{tmp_path / 'neg.npy'}: lengths[2] = -3 is negative (valid: 0 or more tokens; 0 is a "
                     "sequence of no tokens)")),
        ("neg.txt", (f"{tmp_path / 'neg.txt'}:3: length -3 is negative (valid: 0..16,777,216 tokens; 0 is a "
                     "sequence of no tokens)")),
        ("neg-h.txt", f"{tmp_path / 'neg-h.txt'}:3: length -3 is negative (valid: 0..16,777,216 tokens"),
        ("neg.npz", (f"{tmp_path / 'neg.npz'}: offsets[3] = 97 is below offsets[2] = 100, a negative length for "
                     "sequence 2 (valid: offsets that never decrease)")),
    ]:
        assert run_cli(str(tmp_path / name), "--capacity", "512") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"python -m balance_batch.pack: {line}"), err
        assert not any("Traceback" in e for e in err) and not (tmp_path / f"{name}.packed512.npz").exists()
    (tmp_path / "zero-count.txt").write_text("0,0\n")  # a count still says how many: at least 1
    assert run_cli(str(tmp_path / "zero-count.txt"), "--capacity", "512") == 2
    assert "zero-count.txt:1: count 0 is not positive" in capsys.readouterr().err
