"""Time to loss: a small causal LM trained from scratch on the standard library's source on two data-parallel ranks,
seven ways, the same tokens.

    python -m examples.time_to_loss --out DIR [--quick]

A Llama-style model of 1.2M parameters (random initialisation, float32, CPU) learns the running interpreter's
standard library (``Lib/**/*.py``, test folders left out), split by file into training and held-out files by a hash
of each file's path, tokenized with a byte-level BPE of 4,096 tokens trained here on the training files, each file
cut into pieces of at most 1,024 tokens. The script starts two gloo ranks (``torch.distributed.run``, one thread
each); every arm trains one pass over the same training pieces on both ranks, gradients all-reduced each step, with
the same seeds, initial weights and learning-rate schedule, counted in loss tokens:

- ``padded``: the Hugging Face Trainer's defaults: b sequences per rank per step, padded to the longest, random order;
- ``group_by_length``: the same with ``train_sampling_strategy="group_by_length"``;
- ``flattening``: b sequences per rank per step through ``DataCollatorWithFlattening``: one padding-free row;
- ``trl_packing``: TRL's ``SFTTrainer(packing=True)``: best-fit-decreasing rows of 1,024 tokens, padding-free, r rows
  per rank per step (one per forward, accumulated);
- ``token_budget`` / ``token_budget_ramp``: ``TokenBudgetTrainer`` on a ``TokenBudgetSampler`` over both ranks: steps
  sized in tokens (as many per pass as ``padded``'s, so the same mean tokens per step; the ramp from a quarter of the
  step over the first 20% of the tokens), packed and balanced into micro-batches of at most 1,024 tokens;
- ``token_budget_stock_sdpa``: ``token_budget`` with the model's stock sdpa over each whole packed row (its mask keeps
  the sequences apart at (row length)² cost): what the per-sequence kernel is worth.

Every padding-free arm but the last runs the library's per-sequence attention (``prepare_model_for_packing``: each
sequence of a row attends to itself alone, at the cost of the sum of its lengths squared, as a GPU varlen kernel
does); the kernel that ran is recorded per run. Every arm's loss is the mean over the step's loss tokens on both
ranks. Each rank records its time computing and its time waiting at the step's gradient all-reduce. The held-out
loss is measured before training and at the first step's end past each eighth of the tokens (a half with
``--quick``), split between the ranks, its time left out of the wall time. One untimed step of every arm runs first,
and the arms' order alternates by seed. It writes DIR/time_to_loss.json and DIR/time_to_loss.png;
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
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

from harness.data.demo_data import byte_level_bpe

# OpenMP's idle threads spin by default: beside other work on the cores, a spinning thread holds the core its
# partner waits for, and passes run many times slower (docs/measurements/2026-12-04-cpu-threads.md). Set before torch
# loads; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ARMS = ("padded", "group_by_length", "flattening", "trl_packing", "token_budget", "token_budget_ramp",
        "token_budget_stock_sdpa")
PER_SEQUENCE_ARMS = ("flattening", "trl_packing", "token_budget", "token_budget_ramp")  # the library's kernel
BUDGET_ARMS = ("token_budget", "token_budget_ramp", "token_budget_stock_sdpa")
RANKS = 2
HELD_OUT_PERCENT = 10  # a file is held out when its path's hash is 0..9 mod 100
PAD = "<pad>"
SAME_TOKENS = 0.02  # the arms' train tokens may differ by this much (the Trainer repeats a last uneven batch's items)


@dataclass(frozen=True)
class Size:
    """What a run trains: the tokens each arm trains (one pass over the training files it takes), and the model."""

    train_tokens: int  # the training files are taken in hash order until their loss tokens reach this
    seeds: tuple
    max_length: int = 1024
    vocab: int = 4096
    hidden: int = 96
    layers: int = 4
    intermediate: int = 256
    heads: int = 3
    kv_heads: int = 1
    held_out_tokens: int = 8192
    evals: int = 8  # held-out loss at 0, 1/evals, ..., 1 of the tokens
    tokenizer_files: int = 0  # 0: the tokenizer learns every training-pool file; n: the first n (the test's form)
    lr: float = 3e-3
    warmup: float = 0.1  # of the tokens


SIZES = {
    "full": Size(train_tokens=1_000_000, seeds=(0, 1, 2)),
    "quick": Size(train_tokens=100_000, seeds=(0,), evals=2, held_out_tokens=2048),
    # the test's form: seconds, not a measurement
    "tiny": Size(train_tokens=2_000, seeds=(0,), max_length=256, vocab=512, hidden=64, layers=2, intermediate=128,
                 heads=2, kv_heads=1, held_out_tokens=512, evals=1, tokenizer_files=40),
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
    """The files' pieces (``pieces``) in order until their loss tokens (length - 1 each) reach loss_tokens; the last
    one is cut so they reach it exactly (it keeps at least 2 tokens)."""
    out, total = [], 0
    for ids in pieces(tok, files, max_length):
        ids = ids[:loss_tokens - total + 1]
        if len(ids) < 2:
            continue
        out.append(ids)
        total += len(ids) - 1
        if total >= loss_tokens:
            return out
    raise SystemExit(f"time_to_loss: the standard library has only {total} tokens for the {loss_tokens} asked")


def pieces(tok, files, max_length: int):
    """Each file's token ids cut into consecutive pieces of at most max_length tokens (a document longer than the
    context split, as pretraining corpora are), pieces of fewer than 2 tokens left out; in file order."""
    for i in range(0, len(files), 32):
        for enc in tok.encode_batch([text for _, text in files[i:i + 32]]):
            for start in range(0, len(enc.ids), max_length):
                if len(enc.ids) - start >= 2:
                    yield enc.ids[start:start + max_length]


# ---------------------------------------------------------------------------------------------------------- training

class Items:
    """A map-style dataset of ``{"input_ids": ...}``: tensors, or lists (``DataCollatorWithFlattening`` reads lists)."""

    def __init__(self, seqs, lists: bool = False):
        import torch

        self.items = [{"input_ids": list(s) if lists else torch.tensor(s, dtype=torch.long)} for s in seqs]

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
    """The mean loss over every held-out loss token, each file a sequence of its own; each rank runs every
    ``RANKS``-th file and the sums are all-reduced (where a process group is up)."""
    import torch
    import torch.distributed as dist

    was_training = model.training
    model.eval()
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for item in held.items[rank::world]:
            ids = item["input_ids"][None]
            sums[0] += float(model(input_ids=ids, labels=ids, num_items_in_batch=1).loss)  # the summed token losses
            sums[1] += ids.shape[1] - 1
    if distributed:
        dist.all_reduce(sums)
    model.train(was_training)
    return float(sums[0] / sums[1])


def budget_sampler(lengths, size: Size, seed: int, tokens_per_step: int, ramp: dict, rank: int = 0):
    from balance_batch import TokenBudgetSampler

    return TokenBudgetSampler(lengths, max_tokens_per_microbatch=size.max_length, world_size=RANKS, rank=rank,
                              seed=seed, tokens_per_step=tokens_per_step, **ramp)


def matched_tokens_per_step(lengths, size: Size, seed: int, target: int) -> int:
    """The token-budget step that takes as many steps per epoch as ``padded`` (``target``), so both have the same
    mean tokens per step. A step holds at most tokens_per_step tokens, on average about half an item less, so: the
    smallest multiple of 4 (the ramp's quarters are whole tokens) from padded's mean tokens per step up that takes no
    more steps, found by doubling the distance and then halving it. Where the count jumps past padded's (more at one
    size, fewer at the next), it is fewer."""
    def steps(q: int) -> int:  # the steps of a step size of 4 q tokens
        return budget_sampler(lengths, size, seed, 4 * q, {}).steps_in_epoch

    low = math.ceil(sum(lengths) / target / 4) - 1  # takes more steps, or is the mean
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


def trl_rows(train, max_length: int) -> int:
    """How many rows TRL's best-fit-decreasing packing makes of the training files (``trl.data_utils.pack_dataset``,
    what ``SFTTrainer(packing=True)`` runs)."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    return len(pack_dataset(Dataset.from_dict({"input_ids": train}), max_length, "bfd"))


def training_set(tok, pool, size: Size) -> tuple[list, dict]:
    """The training files and every arm's step, chosen so every arm takes about the same number of optimizer steps
    and exactly the same tokens in one pass.

    Steps: b sequences per rank (padded, group_by_length, flattening: pieces / (2 b) steps) and r of TRL's rows per
    rank, one at a time (accumulated: rows / 2 / r steps, the last one short), b from 2 to 4 where r = round(b rows /
    pieces) comes closest to b's steps; the token-budget arms' tokens per step (per seed) the smallest that takes no
    more steps than b's. Pieces: the pool's (``pieces``) in order, the fewest from the run's tokens up that b's steps
    divide evenly and whose TRL rows are even: where a step is short of items the Trainer's loader repeats the first
    ones, and that arm would train more tokens."""
    seqs, total = [], 0
    source = pieces(tok, pool, size.max_length)
    for ids in source:
        seqs.append(ids)
        total += len(ids) - 1
        if total >= size.train_tokens:
            break
    else:
        raise SystemExit(f"time_to_loss: the standard library has only {total} tokens for the {size.train_tokens} "
                         f"asked")
    files, rows = len(seqs), trl_rows(seqs, size.max_length)

    def rows_per_rank(b: int) -> int:  # TRL's rows per rank per step that carry about b pieces' tokens
        return max(1, round(b * rows / files))

    def trl_steps(rows: int, r: int) -> int:  # a rank's rows, r to a step, the last step short
        return math.ceil(rows / RANKS / r)

    b = min((2, 3, 4), key=lambda b: abs(trl_steps(rows, rows_per_rank(b)) / math.ceil(files / (RANKS * b)) - 1))
    r = rows_per_rank(b)
    extra = [ids for ids, _ in zip(source, range(RANKS * b * 24))]
    found = None
    for n in range(files, files + len(extra) + 1):
        if n % (RANKS * b):
            continue
        train = seqs + extra[:n - files]
        rows = trl_rows(train, size.max_length)
        found = found or (train, rows)
        if rows % RANKS == 0:
            found = (train, rows)
            break
    train, rows = found
    lengths = [len(s) for s in train]
    steps = len(train) // (RANKS * b)
    return train, {"sequences_per_rank": b, "trl_rows_per_rank": r, "trl_rows": rows, "steps": steps,
                   "trl_steps": trl_steps(rows, r),
                   "tokens_per_step": {str(seed): matched_tokens_per_step(lengths, size, seed, steps)
                                       for seed in size.seeds}}


class Clock:
    """The run's wall time, the held-out evaluations' time left out."""

    def __init__(self):
        self.start, self.excluded = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.excluded


def attention_kernel(model, calls: dict) -> str:
    """What ran the training steps' attention: the library's per-sequence kernel (as it recorded itself while the
    steps ran), else the model's stock implementation over padded rows or whole packed rows."""
    if calls:
        return "+".join(sorted(calls))
    return model.config._attn_implementation


def _attention_calls() -> dict:
    from balance_batch.integrations.transformers import kernels

    return kernels.snapshot().get("attention", {})


def run_arm(arm: str, seed: int, size: Size, train, held, total: int, sizes: dict, tokenizer) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorWithFlattening,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from balance_batch.integrations.transformers import TokenBudgetTrainer, kernels, prepare_model_for_packing

    rank = dist.get_rank()
    model = make_model(size, seed)
    if arm in PER_SEQUENCE_ARMS:
        prepare_model_for_packing(model)
    counter = {"tokens": 0, "loss": float("nan")}
    attention: dict = {}  # the attention kernels' calls in the training steps (the held-out loss's left out)
    timing = {"step_s": 0.0, "wait_s": 0.0, "ready": None, "local_tokens": 0, "hooked": False}
    optimizer = torch.optim.AdamW(model.parameters(), lr=size.lr, betas=(0.9, 0.95), weight_decay=0.1)
    # LambdaLR's step() runs after each optimizer step: the factor for the next step, from the tokens trained so far
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: lr_factor(counter["tokens"], total, size.warmup))
    checkpoints = [round(total * k / size.evals) for k in range(1, size.evals + 1)]
    curve, steps = [[0, 0.0, None, held_out_loss(model, held)]], []
    clock = Clock()

    def timed_allreduce(state, bucket):  # DDP's own averaging all-reduce, its start time noted
        timing["ready"] = time.perf_counter()  # the last bucket's: this rank's gradients are all computed
        return default_hooks.allreduce_hook(None, bucket)

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
            if not timing["hooked"] and isinstance(model, torch.nn.parallel.DistributedDataParallel):
                model.register_comm_hook(None, timed_allreduce)
                timing["hooked"] = True
            kernels.reset()
            timing["ready"] = None
            start = time.perf_counter()
            loss = super().training_step(model, inputs, num_items_in_batch)
            end = time.perf_counter()
            for impl, n in _attention_calls().items():
                attention[impl] = attention.get(impl, 0) + n
            timing["step_s"] += end - start
            if timing["ready"] is not None:  # this call all-reduced: waiting for the other rank, and the all-reduce
                timing["wait_s"] += end - timing["ready"]
            if "step" in inputs:  # a sampler step: its loss tokens over all ranks
                local = sum(int((mb["labels"][..., 1:] != -100).sum()) for mb in inputs["microbatches"])
                tokens = inputs["step"].global_loss_tokens
            else:  # the Trainer's count over the accumulated micro-batches on all ranks (shifted, padding ignored)
                local = int((inputs["labels"][..., 1:] != -100).sum())
                tokens = int(num_items_in_batch) if self.accelerator.sync_gradients else 0
            timing["local_tokens"] += local
            counter["loss"] = float(loss)
            if not tokens:  # not the step's last micro-batch
                return loss
            counter["tokens"] += tokens
            steps.append(tokens)
            return loss

    with tempfile.TemporaryDirectory() as out:
        common = dict(output_dir=out, num_train_epochs=1, seed=seed, report_to="none", use_cpu=True,
                      save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                      max_grad_norm=1.0, ddp_find_unused_parameters=False)
        hooks = dict(optimizers=(optimizer, scheduler), callbacks=[Record()])
        b = sizes["sequences_per_rank"]
        if arm in ("padded", "group_by_length"):
            strategy = "group_by_length" if arm == "group_by_length" else "random"
            args = TrainingArguments(per_device_train_batch_size=b, train_sampling_strategy=strategy, **common)
            trainer = type("Padded", (Counted, Trainer), {})(
                model=model, args=args, train_dataset=Items(train), **hooks,
                data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
        elif arm == "flattening":
            args = TrainingArguments(per_device_train_batch_size=b, **common)
            trainer = type("Flat", (Counted, Trainer), {})(
                model=model, args=args, train_dataset=Items(train, lists=True), **hooks,
                data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True))
        elif arm == "trl_packing":
            from datasets import Dataset
            from trl import SFTConfig, SFTTrainer

            # bf16=False: TRL's default would autocast every forward (and the held-out loss's) to bfloat16
            # a row per forward, r accumulated: the last step takes what is left, where r rows per forward would
            # have the loader repeat rows to fill it
            args = SFTConfig(per_device_train_batch_size=1, gradient_accumulation_steps=sizes["trl_rows_per_rank"],
                             packing=True, bf16=False,
                             packing_strategy="bfd", padding_free=True, max_length=size.max_length, **common)
            trainer = type("TRL", (Counted, SFTTrainer), {})(
                model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": train}),
                processing_class=tokenizer, **hooks)
        else:
            tokens_per_step = sizes["tokens_per_step"][str(seed)]
            ramp = dict(rampup=(tokens_per_step // 4, tokens_per_step // 4, round(0.2 * sum(map(len, train))))) \
                if arm == "token_budget_ramp" else {}
            sampler = budget_sampler([len(s) for s in train], size, seed, tokens_per_step, ramp, rank)
            trainer = type("Budget", (Counted, TokenBudgetTrainer), {})(
                model=model, args=TrainingArguments(**common), train_dataset=Items(train), sampler=sampler, **hooks)
        trainer.remove_callback(PrinterCallback)  # its end-of-training line, per arm and rank
        trainer.train()
        wall = clock.now()
    if curve[-1][3] is None:  # the last step is always a checkpoint; kept as a guard
        raise AssertionError(f"{arm}: no held-out loss at the end")
    return {"arm": arm, "seed": seed, "rank": rank, "wall_s": round(wall, 3), "eval_s": round(clock.excluded, 3),
            "train_tokens": counter["tokens"], "local_tokens": timing["local_tokens"], "steps": len(steps),
            "step_s": round(timing["step_s"], 3), "wait_s": round(timing["wait_s"], 3),
            "attention": attention_kernel(model, attention),
            "tokens_per_step": {"mean": round(statistics.mean(steps), 1), "min": min(steps), "max": max(steps),
                                "stdev": round(statistics.pstdev(steps), 1)},
            "val_loss": curve[-1][3], "curve": curve}


def prepare(size: Size, work: str) -> dict:
    """The run's data, made once (rank 0) and read by every rank from WORK/data.json: the tokenizer, the training
    pieces and every arm's step (``training_set``), the held-out pieces."""
    start = time.perf_counter()
    pool, held_files = split(stdlib_files())
    tok_files = pool[:size.tokenizer_files] if size.tokenizer_files else pool
    tokenizer = byte_level_bpe((t for _, t in tok_files), size.vocab, [PAD])
    train, sizes = training_set(tokenizer, pool, size)
    held = take(tokenizer, held_files, size.held_out_tokens, size.max_length)
    data = {"tokenizer": tokenizer.to_str(), "train": train, "held": held, "sizes": sizes,
            "prepare_s": round(time.perf_counter() - start, 2)}
    with open(os.path.join(work, "data.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)
    return data


def worker(work: str, mode_name: str, threads: int) -> int:
    """One rank of the run (started by ``torch.distributed.run``): rank 0 prepares the data, then every rank runs
    every arm and seed in turn and writes its records to WORK/rank<r>.json (rank 0's with the run's facts)."""
    import datasets
    import torch
    import torch.distributed as dist
    import transformers
    import trl.data_utils  # noqa: F401 (TRL loads lazily: every rank at once here, not rank 0 alone while preparing)
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from trl import SFTTrainer  # noqa: F401

    size = SIZES[mode_name]
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    # TRL's config sets a field transformers renamed; nothing of ours to act on
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6", category=FutureWarning)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        data = prepare(size, work)
        total = sum(len(s) - 1 for s in data["train"])
        print(f"time_to_loss ({mode_name}): {len(data['train'])} training pieces, {total} loss tokens each arm, "
              f"{len(data['held'])} held-out pieces, {RANKS} ranks; steps of {data['sizes']['sequences_per_rank']} "
              f"sequences or {data['sizes']['trl_rows_per_rank']} TRL rows per rank or "
              f"{data['sizes']['tokens_per_step']} tokens (by seed); prepared in {data['prepare_s']:.1f} s", flush=True)
    dist.barrier()
    if rank != 0:
        with open(os.path.join(work, "data.json"), encoding="utf-8") as f:
            data = json.load(f)
    sizes = data["sizes"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(data["tokenizer"]), pad_token=PAD)
    train, held = data["train"], Items(data["held"])
    total = sum(len(s) - 1 for s in train)
    if mode_name != "tiny":  # one step of every arm, untimed: a code path's first use imports and initialises
        b = sizes["sequences_per_rank"]
        warm = train[:RANKS * b]
        warm_sizes = {**sizes, "tokens_per_step": {"0": 4 * math.ceil(sum(map(len, warm)) / 4)}}
        for arm in ARMS:
            run_arm(arm, 0, size, warm, Items(data["held"][:1]), sum(len(s) - 1 for s in warm), warm_sizes,
                    tokenizer)
    runs = []
    for k, seed in enumerate(size.seeds):
        for arm in ARMS if k % 2 == 0 else ARMS[::-1]:  # the order alternates by seed: a drift in load cancels
            r = run_arm(arm, seed, size, train, held, total, sizes, tokenizer)
            runs.append(r)
            if rank == 0:
                print(f"  {arm:24s} seed {seed}: {r['steps']:3d} steps, {r['train_tokens']} tokens, "
                      f"{r['wall_s']:6.1f} s training (+{r['eval_s']:.1f} s held-out), rank 0 waited "
                      f"{r['wait_s']:.1f} s, held-out loss {r['val_loss']:.4f}", flush=True)
    record = {"runs": runs}
    if rank == 0:
        record["facts"] = {
            "parameters": sum(p.numel() for p in make_model(size, 0).parameters()), "train_tokens": total,
            "corpus": {"stdlib": sysconfig.get_paths()["stdlib"], "training_pieces": len(train),
                       "held_out_pieces": len(held), "held_out_tokens": sum(len(x) - 1 for x in data["held"]),
                       "mean_length": round(statistics.mean(len(s) for s in train), 1),
                       "at_max_length": sum(len(s) == size.max_length for s in train)},
            "step_sizes": sizes, "machine": machine(threads), "prepare_s": data["prepare_s"]}
    with open(os.path.join(work, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------------------- analysis

def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Each (arm, seed)'s run as rank 0 recorded it (its curve), with every rank's times: its wall time, its time in
    the training steps, and within them its wait at the gradient all-reduce; the idle fraction is the ranks' waits
    over their wall times."""
    runs = []
    for records in zip(*per_rank):
        first = records[0]
        assert all((r["arm"], r["seed"]) == (first["arm"], first["seed"]) for r in records), records
        ranks = [{"rank": r["rank"], "wall_s": r["wall_s"], "step_s": r["step_s"], "wait_s": r["wait_s"],
                  "idle_fraction": round(r["wait_s"] / r["wall_s"], 4), "local_tokens": r["local_tokens"]}
                 for r in records]
        wall = max(r["wall_s"] for r in records)
        run = {k: v for k, v in first.items() if k not in ("rank", "step_s", "wait_s", "local_tokens")}
        run.update(world_size=len(records), wall_s=wall, ranks=ranks,
                   idle_fraction=round(sum(r["wait_s"] for r in records) / sum(r["wall_s"] for r in records), 4),
                   tokens_per_s=round(first["train_tokens"] / wall, 1), curve_state=curve_state(first["curve"]))
        runs.append(run)
    return runs


def curve_state(curve) -> dict:
    """Where a held-out curve stands at its end: its drop over the last evaluation interval, and "still falling"
    where that is over 1% of the loss, else "flattened"."""
    vals = [c[3] for c in curve if c[3] is not None]
    drop = vals[-2] - vals[-1]
    return {"last_interval_drop": round(drop, 4), "state": "still falling" if drop > 0.01 * vals[-1] else "flattened"}


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


def spread(values: list) -> dict:
    return {"mean": round(statistics.mean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4),
            "per_seed": [round(x, 4) for x in values]}


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
        entry = spread(ratios) if ratios else {"mean": None, "min": None, "max": None, "per_seed": []}
        if missing:
            entry["not_reached_seeds"] = missing
            entry["reason"] = "the held-out loss never reached padded's final held-out loss of the same seed"
        out[arm] = entry
    return out


def paired(runs: list[dict], value) -> dict:
    """Per arm: ``value(run, padded's run of the same seed)`` over the seeds, mean and the seeds' min and max."""
    base = {r["seed"]: r for r in runs if r["arm"] == "padded"}
    return {arm: spread([value(r, base[r["seed"]]) for r in runs if r["arm"] == arm]) for arm in ARMS}


def summarize(runs: list[dict]) -> dict:
    arms = {}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        vals = [r["val_loss"] for r in rs]
        arms[arm] = {"attention": sorted({r["attention"] for r in rs}), "world_size": rs[0]["world_size"],
                     "wall_s": round(statistics.mean(r["wall_s"] for r in rs), 3),
                     "tokens_per_s": round(statistics.mean(r["tokens_per_s"] for r in rs), 1),
                     "idle_fraction": round(statistics.mean(r["idle_fraction"] for r in rs), 4),
                     "val_loss": round(statistics.mean(vals), 5), "val_loss_min": min(vals), "val_loss_max": max(vals),
                     "train_tokens": [r["train_tokens"] for r in rs], "steps": [r["steps"] for r in rs],
                     "tokens_per_step_mean": round(statistics.mean(r["tokens_per_step"]["mean"] for r in rs), 1),
                     "curve_states": [r["curve_state"]["state"] for r in rs]}
    return arms


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(ARMS, ("tab:gray", "tab:blue", "tab:purple", "tab:brown", "tab:orange", "tab:green",
                             "tab:red")))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for arm in ARMS:
        for i, r in enumerate(r for r in runs if r["arm"] == arm):
            pts = [c for c in r["curve"] if c[3] is not None]
            style = dict(marker="o", ms=2.5, lw=1.1, color=colors[arm], label=arm if i == 0 else None, alpha=0.8)
            axes[0].plot([c[0] for c in pts], [c[3] for c in pts], **style)
            axes[1].plot([c[1] for c in pts], [c[3] for c in pts], **style)
    axes[0].set_xlabel("training tokens (loss tokens)")
    axes[1].set_xlabel("wall time, s (training only)")
    axes[0].set_ylabel("held-out loss")
    for ax in axes:
        ax.grid(alpha=0.3)
    lo = min(c[3] for r in runs for c in r["curve"] if c[3] is not None)
    axes[0].set_ylim(lo - 0.2, lo + 3.0)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _x(s: dict, digits: int = 2) -> str:
    return f"{s['mean']:.{digits}f}× ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(result: dict) -> str:
    """The measurement page's tables, from a run's JSON."""
    lines = [("| arm | attention | steps | loss tokens/step | wall s | tokens/s | ranks idle | held-out loss "
              "(mean; min–max) | Δ loss vs padded (paired; min–max) | speedup to padded's loss | speedup at equal "
              "tokens |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        a, s = result["arms"][arm], result["speedup_to_baseline_loss"][arm]
        e, d = result["speedup_at_equal_tokens"][arm], result["loss_difference_at_equal_tokens"][arm]
        sp = "never reached" if s["mean"] is None else _x(s)
        if s["mean"] is not None and s.get("not_reached_seeds"):
            sp += f", not reached for seeds {s['not_reached_seeds']}"
        lines.append(f"| {arm} | {'/'.join(a['attention'])} | {'/'.join(map(str, a['steps']))} | "
                     f"{a['tokens_per_step_mean']:,.0f} | {a['wall_s']:.1f} | {a['tokens_per_s']:,.0f} | "
                     f"{100 * a['idle_fraction']:.1f}% | {a['val_loss']:.3f} ({a['val_loss_min']:.3f}–"
                     f"{a['val_loss_max']:.3f}) | {d['mean']:+.3f} ({d['min']:+.3f}–{d['max']:+.3f}) | {sp} | "
                     f"{_x(e)} |")
    m, c, z = result["machine"], result["corpus"], result["step_sizes"]
    states = {arm: a["curve_states"] for arm, a in result["arms"].items()}
    falling = sorted({arm for arm, st in states.items() if "still falling" in st})
    lines += ["", (f"Corpus: {c['training_pieces']} training pieces, {c['at_max_length']} of them "
                   f"{result['size']['max_length']:,} tokens long, {c['mean_length']:,.1f} tokens on average, "
                   f"{result['train_tokens']:,} loss tokens; {c['held_out_pieces']} held-out pieces, "
                   f"{c['held_out_tokens']:,} loss tokens; {result['parameters']:,} parameters."),
              "", (f"Steps: {z['sequences_per_rank']} sequences per rank ({z['steps']} steps), "
                   f"{z['trl_rows_per_rank']} of TRL's {z['trl_rows']} rows per rank ({z['trl_steps']} steps), "
                   f"token-budget steps of {', '.join(map(str, z['tokens_per_step'].values()))} tokens (by seed). "
                   f"Still falling over the last interval: {', '.join(falling) or 'none'}."),
              "", (f"Machine: {m['cpu']}, {result['world_size']} gloo ranks of {m['threads']} thread(s), Python "
                   f"{m['python']}, torch {m['torch']}, transformers {m['transformers']}, trl {m['trl']}, tokenizers "
                   f"{m['tokenizers']}; the whole command took {result['total_s']:.0f} s ({result['mode']}).")]
    return "\n".join(lines)


def machine(threads: int) -> dict:
    import tokenizers
    import torch
    import transformers
    import trl

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads,
            "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "tokenizers": tokenizers.__version__, "platform": platform.platform()}


# ---------------------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.time_to_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for time_to_loss.json and time_to_loss.png")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="one seed, 100,000 tokens, 2 held-out points (under 5 minutes)")
    mode.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the test's form
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--markdown", metavar="JSON", help="print the measurement page's tables from a run's JSON")
    p.add_argument("--worker", nargs=3, metavar=("WORK", "MODE", "THREADS"), help=argparse.SUPPRESS)  # one rank
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker[0], a.worker[1], int(a.worker[2]))
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

    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".time_to_loss-", dir=a.out)
    try:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(a.threads)}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={RANKS}", "--max-restarts=0", "-m", "examples.time_to_loss",
                               "--worker", work, mode_name, str(a.threads)], env=env)
        if proc.returncode != 0:
            print(f"time_to_loss: a rank failed (exit {proc.returncode}); its error is above", file=sys.stderr)
            return 1
        per_rank = []
        for r in range(RANKS):
            with open(os.path.join(work, f"rank{r}.json"), encoding="utf-8") as f:
                per_rank.append(json.load(f))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    facts = per_rank[0]["facts"]
    runs = merge_ranks([record["runs"] for record in per_rank])
    total, trained = facts["train_tokens"], [r["train_tokens"] for r in runs]
    same = max(trained) <= (1 + SAME_TOKENS) * min(trained) and min(trained) >= total
    result = {
        "mode": mode_name, "size": asdict(size), "world_size": RANKS, **facts,
        "train_tokens_spread": round(max(trained) / min(trained) - 1, 5), "same_train_tokens": same,
        "arms": summarize(runs), "speedup_to_baseline_loss": speedups(runs),
        "speedup_at_equal_tokens": paired(runs, lambda r, b: b["wall_s"] / r["wall_s"]),
        "loss_difference_at_equal_tokens": paired(runs, lambda r, b: r["val_loss"] - b["val_loss"]),
        "runs": runs,
    }
    n_params = facts["parameters"]
    result["total_s"] = round(time.perf_counter() - start, 1)
    plot(runs, os.path.join(a.out, "time_to_loss.png"),
         f"{n_params / 1e6:.1f}M-parameter Llama on the standard library, {total:,} tokens per arm, "
         f"seeds {list(size.seeds)}, {RANKS} ranks of {a.threads} CPU thread")
    with open(os.path.join(a.out, "time_to_loss.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    if not same:  # written all the same: nothing measured is lost
        print(f"time_to_loss: the arms trained on numbers of tokens more than {SAME_TOKENS:.0%} apart: "
              f"{sorted(set(trained))} (one pass is {total})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
