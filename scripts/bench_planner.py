"""Planner benchmark (a script, not a test): the published workload's plans, and how planning time grows with the
corpus.

    PYTHONPATH=. python scripts/bench_planner.py [--out reports/planner_benchmark.md]
    PYTHONPATH=. python scripts/bench_planner.py --sizes 10000,100000 --ranks 1,8   # a quicker look

Part 1 (the published workload, as every earlier version of this file printed
it): per planner, layout, ranks and budget, lock-step steps against the lower
bound, pad efficiency, per-rank modeled cost max/mean, the critical path (sum
over steps of the costliest rank's micro-batch / mean per-rank cost) and,
packed, the critical path no plan can beat (``critical_path_lower_bound``),
micro-batches over budget and planning time; then the large case (the
original workload generator with N lengths, 8 ranks). Cost model:
Qwen3.5-35B-A3B's shipped config.

Part 2 (scaling): ``DISTRIBUTIONS`` x budgets x ranks x sizes, each planner and
layout: planning time (``plan_step``, statistics included: what a pass pays)
at every size, its growth per x10 sequences, and at the largest size the steps
against their lower bound, packing efficiency (real tokens / (micro-batches x
budget), over all ranks) as a share of the bound's, and the per-rank cost
max/mean. Timings are wall-clock on whatever machine runs it: upper bounds on
a busy one. Part 2 uses the token cost model (cost = tokens), so it measures
the planner, not a model.

Part 3 (a million): each distribution at its usual budget (``MILLION_CASES``)
with 1,000,000 sequences on 1 and 8 ranks, every planner and layout, and the
growth from 100,000 (the full grid at a million is ``--sizes
10000,100000,1000000``: hours on 2 cores).

Part 4 (the peers, harness/peers/): every peer planner in its own
layout beside the balanced and greedy ones, on the published workload (4 and
8 ranks, the four budgets, Qwen3.5's cost model) and on each distribution
(``--peers-size`` sequences at its usual budget, 1 and 8 ranks, cost = tokens):
steps against the lower bound, pad efficiency, per-rank cost max/mean, the
critical path, micro-batches over budget and planning time; a peer that
refuses the input (a sequence over its budget, say) says so in the row.

Part 5 (packing a corpus): ``balance_batch.pack`` beside the corpus packers of
other projects (harness/peers/corpus_packers.py, NeMo-RL's in
harness/peers/nemo_rl.py) on the pre-training stand-in (``short``) at 512
and the QA set at 384, at ``--packing-sizes`` sequences: rows against the lower
bound, efficiency, and the time of one call with the lengths in memory (wall
and CPU seconds). A packer whose time grows with sequences × rows is run at
``NAIVE_SIZE`` only, its time at the larger sizes extrapolated and marked so.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from backends.model.configs import cost_model_for
from backends.specs import ModelSpec
from balance_batch import plan_step
from balance_batch.corpus import pack
from balance_batch.planners import planner_names
from balance_batch.stats import critical_path_lower_bound, lower_bound_bins
from harness.data.workload import mixed_lengths
from harness.peers import PEER_NAMES, PeerRefusal, peer_layout  # importing harness.peers registers the peers
from harness.peers.corpus_packers import histogram_packer, rows_of, torchtune_greedy, trl_bfd
from harness.peers.nemo_rl import first_fit_decreasing, modified_first_fit_decreasing

BUDGETS = (16384, 32768, 65536, 131072)
RANKS = (1, 4, 8)
CASES = [("greedy", "padded"), ("greedy", "packed"), ("balanced", "padded"), ("balanced", "packed")]

SCALE_BUDGETS = (256, 512, 2048, 8192, 32768, 131072)
SCALE_RANKS = (1, 8, 64)
SCALE_SIZES = (10_000, 100_000)
MILLION = 1_000_000
# Part 3: a million sequences of each distribution at the budget it is usually trained with
MILLION_CASES = (("short", 512), ("qa", 384), ("mixed", 32768), ("heavy", 8192), ("equal", 2048), ("ones", 131072))
MILLION_RANKS = (1, 8)
# Part 4: every planner in its own layout (ours: balanced packed, greedy padded), the peers after them
PEER_CASES = [(p, peer_layout(p) or ("packed" if p == "balanced" else "padded")) for p in planner_names()]
PEER_RANKS = (4, 8)
# Part 5: packing a corpus, the full Wikipedia histogram's size last (16.3M sequences, Krell et al. 2021)
PACKING_CASES = (("short", 512), ("qa", 384))
PACKING_SIZES = (100_000, 1_000_000, 16_300_000)
NAIVE_SIZE = 10_000  # first-fit scanning every row per sequence: quadratic, run at this size only
PEER_SIZE = 1_000  # verl's Karmarkar–Karp keeps k partitions per item: memory and time grow as n × k


def short_lengths(n: int, seed: int = 0) -> list[int]:
    """A BERT-style pre-training corpus, 1-512 tokens: a fifth of the documents fill the 512 cap, the rest log-normal
    around 160."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(160), 0.9, n)), 1, 511).astype(np.int64)
    lengths[rng.random(n) < 0.2] = 512
    return lengths.tolist()


def qa_lengths(n: int, seed: int = 0) -> list[int]:
    """A question-answering fine-tuning set, 32-384 tokens around 170: about two per micro-batch at budget 384."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.normal(170, 60, n)), 32, 384).astype(np.int64).tolist()


def heavy_tailed_lengths(n: int, seed: int = 0) -> list[int]:
    """Log-normal with a long tail (median 400, sigma 1.4, up to 262,144): chat logs with the odd huge document."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(400), 1.4, n)), 1, 262_144).astype(np.int64).tolist()


DISTRIBUTIONS: dict[str, tuple[Callable[[int], list[int]], str]] = {
    "mixed": (lambda n: mixed_lengths(n, 64, 32768, 42), "the published generator (64-32,768, seed 42)"),
    "short": (short_lengths, short_lengths.__doc__),
    "qa": (qa_lengths, qa_lengths.__doc__),
    "heavy": (heavy_tailed_lengths, heavy_tailed_lengths.__doc__),
    "equal": (lambda n: [300] * n, "every sequence 300 tokens"),
    "ones": (lambda n: [1] * n, "every sequence 1 token"),
}


def row(lengths, planner, layout, world, budget, cost_model) -> list[str]:
    t0 = time.perf_counter()
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout=layout, planner=planner,
                     cost_model=cost_model)
    elapsed_ms = 1000 * (time.perf_counter() - t0)
    st = plan.stats
    return [
        planner,
        layout,
        str(world),
        f"{budget:,}",
        f"{st.steps} / {st.lower_bound_steps}",
        f"{st.pad_efficiency:.3f}",
        f"{st.cost_imbalance:.4f}",
        f"{st.critical_path:.4f}",
        f"{critical_path_lower_bound(lengths, world, budget, cost_model):.4f}" if layout == "packed" else "—",
        str(st.over_budget),
        f"{elapsed_ms:,.1f}",
    ]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def timed_plan(lengths, world, budget, planner, layout):
    t0 = time.perf_counter()
    plan = plan_step(lengths, world_size=world, max_tokens_per_microbatch=budget, layout=layout, planner=planner)
    return time.perf_counter() - t0, plan


def scaling_rows(name: str, sizes, budgets, ranks, cases, log) -> tuple[list[list[str]], list[float]]:
    """One distribution's rows, and every growth ratio t(10x) / t(x) it measured."""
    make = DISTRIBUTIONS[name][0]
    corpora = {n: make(n) for n in sizes}
    rows, ratios = [], []
    for budget in budgets:
        for world in ranks:
            for planner, layout in cases:
                times, plan = [], None
                for n in sizes:
                    elapsed, plan = timed_plan(corpora[n], world, budget, planner, layout)
                    times.append(elapsed)
                growth = [b / a if a > 0 else float("nan") for a, b in zip(times, times[1:])]
                ratios += growth
                st, lengths = plan.stats, corpora[sizes[-1]]
                n_mb = sum(st.n_microbatches)
                bound_bins = lower_bound_bins(lengths, budget)
                # a sequence over the budget sits alone: its micro-batch holds what it holds
                capacity = budget * n_mb + sum(n - budget for n in lengths if n > budget)
                efficiency = st.real_tokens / capacity if n_mb else 1.0
                rows.append([
                    planner, layout, str(world), f"{budget:,}",
                    *(f"{1000 * t:,.0f}" for t in times),
                    *(f"×{g:.1f}" for g in growth),
                    f"{st.steps:,} / {st.lower_bound_steps:,}",
                    f"{efficiency:.4f}" if world == 1 else "—",
                    f"{bound_bins / n_mb:.3%}" if n_mb and world == 1 else "—",
                    f"{st.cost_imbalance:.4f}",
                ])
                log(name + " | " + " | ".join(rows[-1]))
    return rows, ratios


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", type=int, default=100_000, help="lengths in part 1's large case (0 skips it)")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    ap.add_argument("--sizes", type=parse_ints, default=SCALE_SIZES,
                    help="part 2's corpus sizes, ascending (none: skip part 2)")
    ap.add_argument("--budgets", type=parse_ints, default=SCALE_BUDGETS, help="part 2's budgets")
    ap.add_argument("--ranks", type=parse_ints, default=SCALE_RANKS, help="part 2's rank counts")
    ap.add_argument(
        "--distributions", default=",".join(DISTRIBUTIONS), help="part 2's distributions: " + ", ".join(DISTRIBUTIONS)
    )
    ap.add_argument("--no-published", action="store_true", help="skip part 1")
    ap.add_argument("--no-million", action="store_true", help="skip part 3")
    ap.add_argument("--peers-size", type=int, default=PEER_SIZE, help="part 4's sequences per distribution (0 skips "
                    "part 4's distributions; --no-peers skips part 4)")
    ap.add_argument("--no-peers", action="store_true", help="skip part 4")
    ap.add_argument("--packing-sizes", type=parse_ints, default=PACKING_SIZES,
                    help="part 5's corpus sizes (none: skip part 5)")
    args = ap.parse_args(argv)
    unknown = [d for d in args.distributions.split(",") if d not in DISTRIBUTIONS]
    if unknown:
        print(f"--distributions: unknown {', '.join(unknown)} (valid: {', '.join(DISTRIBUTIONS)})", file=sys.stderr)
        return 2
    command = "PYTHONPATH=. python scripts/bench_planner.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])
    )
    out = [
        "# Planner benchmark",
        "",
        (f"`{command}` on {platform.processor() or platform.machine()}, Python {platform.python_version()}. "
         "Lock-step plans (as FSDP2 runs them). Planning times are wall-clock on a shared machine: upper bounds."),
    ]
    if not args.no_published:
        out += published(args.large)
    if args.sizes:
        out += scaling(args)
    if not args.no_million:
        out += million()
    if not args.no_peers:
        out += peers(args.peers_size, [d for d in args.distributions.split(",") if d])
    if args.packing_sizes:
        out += packing(args.packing_sizes)
    text = "\n".join(out) + "\n"
    if args.out:
        args.out.write_text(text)
    return 0


def published(large: int) -> list[str]:
    cost_model = cost_model_for(ModelSpec(name="qwen3_5_35b_a3b", path="/nonexistent/Qwen3.5-35B-A3B"))
    header = ["planner", "layout", "ranks", "budget", "steps / lower bound", "pad eff.", "cost max/mean",
              "critical path", "critical path ≥", "over budget", "plan ms"]
    lengths = mixed_lengths(128, 64, 32768, 42)
    out = [
        "",
        "## Part 1: the published workload",
        "",
        f"Cost model: a = {cost_model.a:.4g} FLOPs/token, b = {cost_model.b:.4g} FLOPs/token² ({cost_model.source}).",
        "",
        f"### seed_mixed_128 ({len(lengths)} examples, {sum(lengths):,} tokens)",
        "",
    ]
    rows = []
    for world in RANKS:
        for planner, layout in CASES:
            for budget in BUDGETS:
                rows.append(row(lengths, planner, layout, world, budget, cost_model))
                print(" | ".join(rows[-1]), flush=True)
    out.append(table(header, rows))
    if large:
        big = mixed_lengths(large, 64, 32768, 42)
        out += [
            "",
            f"### {large:,} lengths (the original workload generator, seed 42), 8 ranks, {sum(big):,} tokens",
            "",
        ]
        big_rows = []
        for planner, layout in CASES:
            for budget in BUDGETS:
                big_rows.append(row(big, planner, layout, 8, budget, cost_model))
                print(" | ".join(big_rows[-1]), flush=True)
        out.append(table(header, big_rows))
    return out


def scaling(args) -> list[str]:
    sizes = tuple(sorted(args.sizes))
    names = args.distributions.split(",")
    header = [
        "planner",
        "layout",
        "ranks",
        "budget",
        *(f"ms at {n:,}" for n in sizes),
        *(f"growth ×10 ({a:,}→{b:,})" if b == 10 * a else f"growth {a:,}→{b:,}" for a, b in zip(sizes, sizes[1:])),
        f"steps / bound at {sizes[-1]:,}",
        "packing eff.",
        "of the bound's",
        "cost max/mean",
    ]
    out = [
        "",
        "## Part 2: planning time against corpus size",
        "",
        ("Growth is t(larger) / t(smaller): about ×10 per ×10 sequences is linear, ×100 quadratic. "
         "Packing efficiency (1 rank; with more, the balanced planner spreads the work over every slot of its steps) "
         "is real tokens / (micro-batches × budget) at the largest size "
         "(a sequence over the budget, alone in its micro-batch, counts as full); "
         "*of the bound's* is the lower bound's micro-batches / the plan's (100% is the bound). "
         "Cost model: tokens (a sequence costs its length)."),
    ]
    all_ratios: dict[str, list[float]] = {}
    for name in names:
        rows, ratios = scaling_rows(name, sizes, args.budgets, args.ranks, CASES, lambda line: print(line, flush=True))
        all_ratios[name] = ratios
        out += ["", f"### {name}: {DISTRIBUTIONS[name][1].rstrip('.')}", "", table(header, rows)]
    if len(sizes) > 1:
        out += ["", "### Largest growth per distribution", ""]
        worst = [[name, f"×{max(r):.1f}" if r else "—"] for name, r in all_ratios.items()]
        out.append(table(["distribution", "largest t(larger) / t(smaller), any planner, layout, budget, ranks"], worst))
    return out


def million() -> list[str]:
    header = [
        "distribution",
        "budget",
        "planner",
        "layout",
        "ranks",
        "ms at 100,000",
        f"ms at {MILLION:,}",
        "growth ×10",
        "steps / bound",
        "packing eff.",
        "of the bound's",
        "cost max/mean",
    ]
    out = ["", f"## Part 3: {MILLION:,} sequences", "",
           "Each distribution at the budget it is usually trained with; cost model: tokens.", ""]
    rows = []
    for name, budget in MILLION_CASES:
        part, _ = scaling_rows(
            name, (100_000, MILLION), (budget,), MILLION_RANKS, CASES, lambda line: print(line, flush=True)
        )
        rows += [[name, r[3], r[0], r[1], r[2], *r[4:]] for r in part]
    out.append(table(header, rows))
    return out


def peer_row(lengths, planner, layout, world, budget, cost_model) -> list[str]:
    """``row``'s columns for any planner; a peer's refusal fills the row with its reason."""
    try:
        cells = row(lengths, planner, layout, world, budget, cost_model)
    except PeerRefusal as exc:
        reason = re.sub(r" \([^()]*\)$", "", str(exc).split("; ")[0]).removeprefix(f"planner: {planner} ")
        return [planner, layout, str(world), f"{budget:,}", f"refused: {reason}", *["—"] * 6]
    return cells


def peers(size: int, names: list[str]) -> list[str]:
    cost_model = cost_model_for(ModelSpec(name="qwen3_5_35b_a3b", path="/nonexistent/Qwen3.5-35B-A3B"))
    header = ["planner", "layout", "ranks", "budget", "steps / lower bound", "pad eff.", "cost max/mean",
              "critical path", "critical path ≥", "over budget", "plan ms"]
    lengths = mixed_lengths(128, 64, 32768, 42)
    out = ["", "## Part 4: the peers beside the balanced and greedy planners", "",
           (f"Peers: {', '.join(PEER_NAMES)} (harness/peers/), each in its own layout. "
           "A refusal is the peer's own (its assert, its ValueError, or a sample it would drop)."), "",
           f"### seed_mixed_128 ({len(lengths)} examples, {sum(lengths):,} tokens), cost model {cost_model.source}", ""]
    rows = []
    for world in PEER_RANKS:
        for budget in BUDGETS:
            for planner, layout in PEER_CASES:
                rows.append(peer_row(lengths, planner, layout, world, budget, cost_model))
                print(" | ".join(rows[-1]), flush=True)
    out.append(table(header, rows))
    usual = dict(MILLION_CASES)
    for name in names if size else []:
        corpus = DISTRIBUTIONS[name][0](size)
        budget = usual[name]
        out += ["", f"### {name}, {size:,} sequences at budget {budget:,}: {DISTRIBUTIONS[name][1].rstrip('.')}", ""]
        rows = []
        for world in (1, 8):
            for planner, layout in PEER_CASES:
                rows.append(peer_row(corpus, planner, layout, world, budget, None))
                print(name + " | " + " | ".join(rows[-1]), flush=True)
        out.append(table(header, rows))
    return out


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def packing(sizes) -> list[str]:
    """Part 5: each corpus packer's rows, efficiency and time of one call at each size."""
    header = ["lengths", "capacity", "sequences", "packer", "rows", "of the bound", "efficiency", "wall s", "CPU s"]
    packers = [
        ("balance_batch.pack", lambda ls, c: pack(ls, c).rows, "array"),
        ("balanced planner, 1 rank (plan_step)", lambda ls, c: plan_step(
            ls, world_size=1, max_tokens_per_microbatch=c, layout="packed", planner="balanced").stats.steps, "list"),
        ("TRL pack_dataset bfd", lambda ls, c: len(trl_bfd(ls, c)), "list"),
        ("torchtune PackedDataset greedy", lambda ls, c: len(torchtune_greedy(ls, c)), "list"),
        ("NeMo-RL first-fit decreasing", lambda ls, c: len(first_fit_decreasing(ls, c)), "naive"),
        ("NeMo-RL modified first-fit decreasing", lambda ls, c: len(modified_first_fit_decreasing(ls, c)), "naive"),
        ("LPFHP, 3 a pack (packed-BERT)", lambda ls, c: rows_of(histogram_packer(ls, c, True, 3)), "array"),
        ("SPFHP, 3 a pack (packed-BERT)", lambda ls, c: rows_of(histogram_packer(ls, c, False, 3)), "array"),
        ("LPFHP, any number a pack", lambda ls, c: rows_of(histogram_packer(ls, c, True, None)), "array"),
    ]
    out = ["", "## Part 5: packing a corpus", "",
           ("One call each, the lengths already in memory (a numpy array for the array packers, a list for the "
            "others); *of the bound* is the fewest rows any packing can have ÷ the rows made; efficiency is real "
            "tokens ÷ (rows × capacity). The balanced planner runs at the two smaller sizes only (its plan is Python "
            f"lists); NeMo-RL's first-fit packers at {NAIVE_SIZE:,} only, their time at larger sizes extrapolated "
            "(× the square of the size ratio) and marked *est.*"), ""]
    rows = []

    def measure(name: str, capacity: int, n: int, label: str, fn, kind: str) -> float:
        lengths = corpora[n]
        n_rows, wall, cpu = _timed(lambda: fn(lengths if kind == "array" else lists[n], capacity))
        rows.append([name, f"{capacity:,}", f"{n:,}", label, f"{n_rows:,}", f"{bounds[n] / n_rows:.6f}",
                     f"{lengths.sum() / (n_rows * capacity):.6f}", f"{wall:.3f}", f"{cpu:.3f}"])
        print(" | ".join(rows[-1]), flush=True)
        return wall

    for name, capacity in PACKING_CASES:
        ns = sorted(set(sizes) | {NAIVE_SIZE})
        corpora = {n: np.asarray(DISTRIBUTIONS[name][0](n), dtype=np.int64) for n in ns}
        lists = {n: corpora[n].tolist() for n in ns}
        bounds = {n: lower_bound_bins(corpora[n], capacity) for n in ns}
        measure(name, capacity, NAIVE_SIZE, *packers[0])  # ours beside the first-fit packers at their size
        naive_s = {label: measure(name, capacity, NAIVE_SIZE, label, fn, kind)
                   for label, fn, kind in packers if kind == "naive"}
        for n in sorted(sizes):
            for label, fn, kind in packers:
                if kind == "naive":
                    if n > NAIVE_SIZE:
                        est = naive_s[label] * (n / NAIVE_SIZE) ** 2
                        rows.append([name, f"{capacity:,}", f"{n:,}", label, "not run", "—", "—", f"est. {est:,.0f}",
                                     "—"])
                elif not (label.startswith("balanced") and n > 1_000_000):
                    measure(name, capacity, n, label, fn, kind)
    out.append(table(header, rows))
    return out


if __name__ == "__main__":
    sys.exit(main())
