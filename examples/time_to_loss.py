"""Time to loss: a small causal LM trained from scratch on the standard library's source, four ways, the same tokens.

    python -m examples.time_to_loss --out DIR [--quick]

A Llama-style model of 3.1M parameters (random initialisation, float32, CPU, sdpa attention, 2 threads) learns the
running interpreter's standard library (``Lib/**/*.py``, test folders left out), split by file into training and
held-out files by a hash of each file's path, tokenized with a byte-level BPE of 4,096 tokens trained here on the
training files, each file cut at 1,024 tokens. Four arms train one pass over the same training files, so each arm
trains on exactly the same tokens; the same seeds and the same learning-rate schedule, counted in tokens trained:

- ``padded``: the Hugging Face Trainer's defaults: 4 sequences per step, padded to the longest, random order;
- ``group_by_length``: the same with ``train_sampling_strategy="group_by_length"`` (the Trainer's own remedy, once
  ``group_by_length=True``);
- ``token_budget``: ``TokenBudgetTrainer`` on a ``TokenBudgetSampler``: steps sized in tokens, as many per pass as
  ``padded``'s (so the same mean tokens per step), packed and balanced into micro-batches of at most 1,024 tokens;
- ``token_budget_ramp``: the same, the step size ramped from a quarter to the full size over the first 20% of the
  tokens (``rampup=``).

Every arm's loss is the mean over the step's loss tokens (the Trainer divides a padded step's summed loss by its
label count, ``num_items_in_batch``; ``TokenBudgetTrainer`` by the step's ``global_loss_tokens``). The held-out loss
is measured before training and at the first step's end past each eighth of the tokens (a quarter with
``--quick``), its time left out of the wall time, which counts everything else from the Trainer's construction to the
end of ``train()``. One untimed step of every arm runs first (a code path's first use imports and initialises), and
the arms' order alternates by seed. It writes DIR/time_to_loss.json and DIR/time_to_loss.png;
``--markdown DIR/time_to_loss.json`` prints the tables of the measurement page from a run's JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass

from harness.data.demo_data import byte_level_bpe

# OpenMP's idle threads spin by default: beside other work on the cores, a spinning thread holds the core its
# partner waits for, and passes run many times slower (docs/measurements/2026-12-04-cpu-threads.md). Set before torch
# loads; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ARMS = ("padded", "group_by_length", "token_budget", "token_budget_ramp")
HELD_OUT_PERCENT = 10  # a file is held out when its path's hash is 0..9 mod 100
PAD = "<pad>"


@dataclass(frozen=True)
class Size:
    """What a run trains: the tokens each arm trains (one pass over the training files it takes), and the model."""

    train_tokens: int  # the training files are taken in hash order until their loss tokens reach this
    seeds: tuple
    max_length: int = 1024
    sequences_per_step: int = 4
    vocab: int = 4096
    hidden: int = 192
    layers: int = 4
    intermediate: int = 512
    heads: int = 6
    kv_heads: int = 2
    held_out_tokens: int = 8192
    evals: int = 8  # held-out loss at 0, 1/evals, ..., 1 of the tokens
    tokenizer_files: int = 0  # 0: the tokenizer learns every training-pool file; n: the first n (the test's form)
    lr: float = 3e-3
    warmup: float = 0.1  # of the tokens


SIZES = {
    "full": Size(train_tokens=300_000, seeds=(0, 1)),
    "quick": Size(train_tokens=60_000, seeds=(0,), evals=4, held_out_tokens=4096),
    # the test's form: seconds, not a measurement
    "tiny": Size(train_tokens=3_000, seeds=(0,), max_length=256, vocab=512, hidden=64, layers=2, intermediate=128,
                 heads=2, kv_heads=1, held_out_tokens=1024, evals=2, tokenizer_files=40),
}


# ---------------------------------------------------------------------------------------------------------- corpus

def stdlib_files() -> list[tuple[str, str]]:
    """(path relative to the standard library, text) of its ``.py`` files, in path order; site-packages, the test
    suites (``test``/``tests`` folders) and idlelib's and lib2to3's test data left out."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in ("site-packages", "dist-packages") or {"test", "tests"} & set(parts[:-1]):
            continue
        if parts[0] in ("idlelib", "lib2to3") and ("idle_test" in parts or "tests" in parts):
            continue
        files.append((rel, path.read_text(encoding="utf-8", errors="replace")))
    return files


def file_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")


def split(files):
    """Training pool and held-out files, each in hash order (a fixed order that does not depend on the machine)."""
    ordered = sorted(files, key=lambda f: file_hash(f[0]))
    held = [f for f in ordered if file_hash(f[0]) % 100 < HELD_OUT_PERCENT]
    pool = [f for f in ordered if file_hash(f[0]) % 100 >= HELD_OUT_PERCENT]
    return pool, held


def take(tok, files, loss_tokens: int, max_length: int) -> list[list[int]]:
    """Files' token ids, each cut at max_length, in order until their loss tokens (length - 1 each) reach
    loss_tokens; the last one is cut so they reach it exactly (it keeps at least 2 tokens)."""
    out, total = [], 0
    for i in range(0, len(files), 32):
        for enc in tok.encode_batch([text for _, text in files[i:i + 32]]):
            ids = enc.ids[:max_length]
            if len(ids) < 2:
                continue
            ids = ids[:loss_tokens - total + 1]
            if len(ids) < 2:
                continue
            out.append(ids)
            total += len(ids) - 1
            if total >= loss_tokens:
                return out
    raise SystemExit(f"time_to_loss: the standard library has only {total} tokens for the {loss_tokens} asked")


# ---------------------------------------------------------------------------------------------------------- training

class Items:
    """A map-style dataset of ``{"input_ids": tensor}``."""

    def __init__(self, seqs):
        import torch

        self.items = [{"input_ids": torch.tensor(s, dtype=torch.long)} for s in seqs]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_model(size: Size, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.kv_heads, head_dim=size.hidden // size.heads,
                         max_position_embeddings=size.max_length, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def lr_factor(tokens: int, total: int, warmup: float) -> float:
    """The schedule, in tokens trained: linear warm-up over ``warmup`` of them, then a cosine to a tenth."""
    w = max(warmup * total, 1.0)
    if tokens < w:
        return (tokens + 1) / (w + 1)
    progress = min((tokens - w) / max(total - w, 1.0), 1.0)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def held_out_loss(model, held) -> float:
    """The mean loss over every held-out loss token, each file a sequence of its own."""
    import torch

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for item in held:
            ids = item["input_ids"][None]
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=1).loss  # the summed token losses
            total += float(loss)
            count += ids.shape[1] - 1
    model.train(was_training)
    return total / count


def budget_sampler(lengths, size: Size, seed: int, tokens_per_step: int, ramp: dict):
    from balance_batch import TokenBudgetSampler

    return TokenBudgetSampler(lengths, max_tokens_per_microbatch=size.max_length, world_size=1, rank=0, seed=seed,
                              tokens_per_step=tokens_per_step, **ramp)


def matched_tokens_per_step(lengths, size: Size, seed: int) -> int:
    """The token-budget step that takes as many steps per epoch as ``padded`` (ceil(items / sequences per step)),
    so both have the same mean tokens per step. A step holds at most tokens_per_step tokens, on average about half an
    item less, so: the smallest multiple of 4 (the ramp's quarters are whole tokens) from padded's mean tokens per
    step up that takes no more steps, found by doubling the distance and then halving it. Where the count jumps past
    padded's (more at one size, fewer at the next), it is fewer."""
    target = math.ceil(len(lengths) / size.sequences_per_step)

    def steps(q: int) -> int:  # the steps of a step size of 4 q tokens
        return budget_sampler(lengths, size, seed, 4 * q, {}).steps_in_epoch

    low = math.ceil(size.sequences_per_step * sum(lengths) / len(lengths) / 4) - 1  # takes more steps, or is the mean
    if steps(low + 1) <= target:
        return 4 * (low + 1)
    gap = 1
    while steps(low + gap) > target:
        low, gap = low + gap, gap * 2
    high = low + gap  # steps(low) > target >= steps(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if steps(mid) > target else (low, mid)
    return 4 * high


class Clock:
    """The run's wall time, the held-out evaluations' time left out."""

    def __init__(self):
        self.start, self.excluded = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.excluded


def run_arm(arm: str, seed: int, size: Size, train, held, total: int, tokens_per_step: int) -> dict:
    import torch
    from transformers import (
        DataCollatorForLanguageModeling,
        PreTrainedTokenizerFast,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from balance_batch.integrations.transformers import TokenBudgetTrainer

    model = make_model(size, seed)
    counter = {"tokens": 0}
    optimizer = torch.optim.AdamW(model.parameters(), lr=size.lr, betas=(0.9, 0.95), weight_decay=0.1)
    # LambdaLR's step() runs after each optimizer step: the factor for the next step, from the tokens trained so far
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: lr_factor(counter["tokens"], total, size.warmup))
    checkpoints = [round(total * k / size.evals) for k in range(1, size.evals + 1)]
    curve, steps = [[0, 0.0, None, held_out_loss(model, held)]], []
    clock = Clock()

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            wall, val = clock.now(), None
            if checkpoints and counter["tokens"] >= checkpoints[0]:
                while checkpoints and counter["tokens"] >= checkpoints[0]:
                    checkpoints.pop(0)
                t = time.perf_counter()
                val = held_out_loss(kwargs["model"], held)
                clock.excluded += time.perf_counter() - t
            curve.append([counter["tokens"], round(wall, 3), round(counter["loss"], 5),
                          None if val is None else round(val, 5)])

    class Counted:
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if "step" in inputs:  # a sampler step: its loss tokens over all ranks
                tokens = inputs["step"].global_loss_tokens
            else:  # a padded batch: the labels the loss counts (shifted, padding ignored)
                tokens = int((inputs["labels"][..., 1:] != -100).sum())
            counter["tokens"] += tokens
            counter["loss"] = float(loss)
            steps.append(tokens)
            return loss

    with tempfile.TemporaryDirectory() as out:
        common = dict(output_dir=out, num_train_epochs=1, seed=seed, report_to="none", use_cpu=True,
                      save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                      max_grad_norm=1.0)
        dataset = Items(train)
        if arm in ("padded", "group_by_length"):
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=_TOKENIZER[0], pad_token=PAD)
            strategy = "group_by_length" if arm == "group_by_length" else "random"
            args = TrainingArguments(per_device_train_batch_size=size.sequences_per_step,
                                     train_sampling_strategy=strategy, **common)
            trainer = type("Padded", (Counted, Trainer), {})(
                model=model, args=args, train_dataset=dataset, optimizers=(optimizer, scheduler),
                data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), callbacks=[Record()])
        else:
            lengths = [len(s) for s in train]
            ramp = dict(rampup=(tokens_per_step // 4, tokens_per_step // 4, round(0.2 * sum(lengths)))) \
                if arm == "token_budget_ramp" else {}
            sampler = budget_sampler(lengths, size, seed, tokens_per_step, ramp)
            args = TrainingArguments(**common)
            trainer = type("Budget", (Counted, TokenBudgetTrainer), {})(
                model=model, args=args, train_dataset=dataset, sampler=sampler, optimizers=(optimizer, scheduler),
                callbacks=[Record()])
        trainer.train()
        wall = clock.now()
    if curve[-1][3] is None:  # the last step is always a checkpoint; kept as a guard
        raise AssertionError(f"{arm}: no held-out loss at the end")
    return {"arm": arm, "seed": seed, "wall_s": round(wall, 3), "eval_s": round(clock.excluded, 3),
            "train_tokens": counter["tokens"], "steps": len(steps),
            "tokens_per_step": {"mean": round(statistics.mean(steps), 1), "min": min(steps), "max": max(steps),
                                "stdev": round(statistics.pstdev(steps), 1)},
            "val_loss": curve[-1][3], "curve": curve}


_TOKENIZER: list = []  # the run's tokenizer, set by main (the padded arms' collator wraps it)


# ---------------------------------------------------------------------------------------------------------- analysis

def time_to_loss(curve, target: float):
    """The wall time at which the held-out curve first reaches target, linearly interpolated between evaluations;
    None where it never does."""
    points = [(c[1], c[3]) for c in curve if c[3] is not None]
    for (w0, v0), (w1, v1) in zip(points, points[1:]):
        if v1 <= target:
            if v0 <= target:
                return w0
            return w0 + (w1 - w0) * (v0 - target) / (v0 - v1)
    return None


def speedups(runs: list[dict]) -> dict:
    """Per arm: padded's time to reach its final held-out loss over the arm's, paired by seed (the same seed is the
    same initialisation), times at the steps' ends; mean and the seeds' min and max."""
    base = {r["seed"]: r for r in runs if r["arm"] == "padded"}
    out = {}
    for arm in ARMS:
        ratios, missing = [], []
        for r in (r for r in runs if r["arm"] == arm):
            b = base[r["seed"]]
            t = time_to_loss(r["curve"], b["val_loss"])
            if t is None or t <= 0:
                missing.append(r["seed"])
            else:  # padded's own time to it: where its curve first reached it (the last step's end, or before)
                ratios.append(time_to_loss(b["curve"], b["val_loss"]) / t)
        entry = {"mean": round(statistics.mean(ratios), 3) if ratios else None,
                 "min": round(min(ratios), 3) if ratios else None, "max": round(max(ratios), 3) if ratios else None,
                 "per_seed": [round(x, 3) for x in ratios]}
        if missing:
            entry["not_reached_seeds"] = missing
            entry["reason"] = "the held-out loss never reached padded's final held-out loss of the same seed"
        out[arm] = entry
    return out


def equal_token_speedups(runs: list[dict]) -> dict:
    """Per arm: padded's wall time over the arm's for the same tokens, paired by seed; mean and the seeds' min and
    max. Always defined, where the time to padded's loss is not (an arm whose final loss is a little worse)."""
    base = {r["seed"]: r["wall_s"] for r in runs if r["arm"] == "padded"}
    out = {}
    for arm in ARMS:
        ratios = [base[r["seed"]] / r["wall_s"] for r in runs if r["arm"] == arm]
        out[arm] = {"mean": round(statistics.mean(ratios), 3), "min": round(min(ratios), 3),
                    "max": round(max(ratios), 3), "per_seed": [round(x, 3) for x in ratios]}
    return out


def summarize(runs: list[dict]) -> dict:
    arms = {}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        vals = [r["val_loss"] for r in rs]
        arms[arm] = {"wall_s": round(statistics.mean(r["wall_s"] for r in rs), 3),
                     "val_loss": round(statistics.mean(vals), 5), "val_loss_min": min(vals), "val_loss_max": max(vals),
                     "train_tokens": rs[0]["train_tokens"], "steps": [r["steps"] for r in rs],
                     "tokens_per_step_mean": round(statistics.mean(r["tokens_per_step"]["mean"] for r in rs), 1)}
    return arms


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(ARMS, ("tab:gray", "tab:blue", "tab:orange", "tab:green")))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for arm in ARMS:
        for i, r in enumerate(r for r in runs if r["arm"] == arm):
            pts = [c for c in r["curve"] if c[3] is not None]
            label = arm if i == 0 else None
            axes[0].plot([c[0] for c in pts], [c[3] for c in pts], marker="o", ms=3, lw=1.2, color=colors[arm],
                         label=label, alpha=0.85)
            axes[1].plot([c[1] for c in pts], [c[3] for c in pts], marker="o", ms=3, lw=1.2, color=colors[arm],
                         label=label, alpha=0.85)
    axes[0].set_xlabel("training tokens (loss tokens)")
    axes[1].set_xlabel("wall time, s (training only)")
    axes[0].set_ylabel("held-out loss")
    for ax in axes:
        ax.grid(alpha=0.3)
    lo = min(c[3] for r in runs for c in r["curve"] if c[3] is not None)
    axes[0].set_ylim(lo - 0.2, lo + 3.0)
    axes[1].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    """The measurement page's tables, from a run's JSON."""
    lines = [("| arm | seeds | train tokens | steps | loss tokens/step (mean) | wall s (training) | held-out loss "
              "(mean; min–max) | speedup to padded's loss (mean; min–max) | speedup at equal tokens (mean; min–max) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        a, s = result["arms"][arm], result["speedup_to_baseline_loss"][arm]
        e = result["speedup_at_equal_tokens"][arm]
        sp = "never reached" if s["mean"] is None else f"{s['mean']:.2f}× ({s['min']:.2f}–{s['max']:.2f})"
        if s["mean"] is not None and s.get("not_reached_seeds"):
            sp += f", not reached for seeds {s['not_reached_seeds']}"
        lines.append(f"| {arm} | {len(a['steps'])} | {a['train_tokens']:,} | {'/'.join(map(str, a['steps']))} | "
                     f"{a['tokens_per_step_mean']:,.0f} | {a['wall_s']:.1f} | {a['val_loss']:.3f} "
                     f"({a['val_loss_min']:.3f}–{a['val_loss_max']:.3f}) | {sp} | "
                     f"{e['mean']:.2f}× ({e['min']:.2f}–{e['max']:.2f}) |")
    m, c = result["machine"], result["corpus"]
    lines += ["", (f"Corpus: {c['training_files']} training files, {c['at_max_length']} of them cut at "
                   f"{result['size']['max_length']:,} tokens, {c['mean_length']:,.1f} tokens on average; "
                   f"{c['held_out_files']} held-out files, {c['held_out_tokens']:,} loss tokens; "
                   f"{result['parameters']:,} parameters."),
              "", (f"Machine: {m['cpu']}, {m['threads']} threads, Python {m['python']}, torch {m['torch']}, "
                   f"transformers {m['transformers']}, tokenizers {m['tokenizers']}; the whole command took "
                   f"{result['total_s']:.0f} s ({result['mode']}).")]
    return "\n".join(lines)


def machine(threads: int) -> dict:
    import tokenizers
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads,
            "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "platform": platform.platform()}


# ---------------------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.time_to_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for time_to_loss.json and time_to_loss.png")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="one seed, a fifth of the tokens, 4 held-out points (under 3 minutes)")
    mode.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the test's form
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--markdown", metavar="JSON", help="print the measurement page's tables from a run's JSON")
    a = p.parse_args(argv)
    if a.markdown:
        try:
            with open(a.markdown, encoding="utf-8") as f:
                print(markdown(json.load(f)))
        except (OSError, ValueError, KeyError) as e:
            print(f"time_to_loss: --markdown {a.markdown}: not a time_to_loss.json ({e})", file=sys.stderr)
            return 2
        return 0
    if not a.out:
        print("time_to_loss: --out DIR is required (the folder for time_to_loss.json and time_to_loss.png)",
              file=sys.stderr)
        return 2
    if a.threads < 1:
        print(f"time_to_loss: --threads must be a positive integer, got {a.threads}", file=sys.stderr)
        return 2
    mode_name = "tiny" if a.tiny else "quick" if a.quick else "full"
    size = SIZES[mode_name]
    start = time.perf_counter()

    import torch

    torch.set_num_threads(a.threads)
    pool, held_files = split(stdlib_files())
    tok_files = pool[:size.tokenizer_files] if size.tokenizer_files else pool
    _TOKENIZER[:] = [byte_level_bpe((t for _, t in tok_files), size.vocab, [PAD])]
    train = take(_TOKENIZER[0], pool, size.train_tokens, size.max_length)
    held = Items(take(_TOKENIZER[0], held_files, size.held_out_tokens, size.max_length))
    total = sum(len(s) - 1 for s in train)
    lengths = [len(s) for s in train]
    # the token-budget arms' step: as many steps per epoch as padded's, so the same mean tokens per step
    budgets = {seed: matched_tokens_per_step(lengths, size, seed) for seed in size.seeds}
    prep_s = time.perf_counter() - start
    print(f"time_to_loss ({mode_name}): {len(train)} training files, {total} loss tokens each arm, "
          f"{len(held)} held-out files; steps of {size.sequences_per_step} sequences or {budgets} tokens (by seed); "
          f"prepared in {prep_s:.1f} s", flush=True)
    # one step of every arm, untimed: the first use of a code path imports and initialises what later runs reuse
    warm = train[:size.sequences_per_step]
    for arm in ARMS:
        run_arm(arm, 0, size, warm, Items([held.items[0]["input_ids"].tolist()]), sum(len(s) - 1 for s in warm),
                4 * math.ceil(sum(map(len, warm)) / 4))
    warm_s = time.perf_counter() - start - prep_s

    runs = []
    for k, seed in enumerate(size.seeds):
        for arm in ARMS if k % 2 == 0 else ARMS[::-1]:  # the order alternates by seed: a drift in load cancels
            r = run_arm(arm, seed, size, train, held, total, budgets[seed])
            runs.append(r)
            print(f"  {arm:18s} seed {seed}: {r['steps']:3d} steps, {r['train_tokens']} tokens, "
                  f"{r['wall_s']:6.1f} s training (+{r['eval_s']:.1f} s held-out), held-out loss {r['val_loss']:.4f}",
                  flush=True)
    trained = {r["train_tokens"] for r in runs}
    if trained != {total}:
        raise AssertionError(f"the arms trained on different numbers of tokens: {sorted(trained)}, expected {total}")
    n_params = sum(p.numel() for p in make_model(size, 0).parameters())
    result = {
        "mode": mode_name, "size": asdict(size), "parameters": n_params,
        "corpus": {"stdlib": sysconfig.get_paths()["stdlib"], "training_files": len(train),
                   "held_out_files": len(held), "held_out_tokens": sum(len(x["input_ids"]) - 1 for x in held.items),
                   "mean_length": round(statistics.mean(len(s) for s in train), 1),
                   "at_max_length": sum(len(s) == size.max_length for s in train)},
        "train_tokens": total, "token_budget_tokens_per_step": budgets, "same_train_tokens": True,
        "arms": summarize(runs), "speedup_to_baseline_loss": speedups(runs),
        "speedup_at_equal_tokens": equal_token_speedups(runs), "runs": runs,
        "machine": machine(a.threads), "prepare_s": round(prep_s, 2), "warm_up_s": round(warm_s, 2),
    }
    os.makedirs(a.out, exist_ok=True)
    result["total_s"] = round(time.perf_counter() - start, 1)
    plot(runs, os.path.join(a.out, "time_to_loss.png"),
         f"{n_params / 1e6:.1f}M-parameter Llama on the standard library, {total:,} tokens per arm, "
         f"seeds {list(size.seeds)}, {a.threads} CPU threads")
    with open(os.path.join(a.out, "time_to_loss.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
