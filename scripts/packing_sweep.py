"""Which causal LMs packed rows are exact on: every model type the installed transformers maps to a causal LM, built
tiny from its own config (random weights, float32 by default), plus a 4-token sliding-window variant of each that has
a window. For each: ``check_packable`` as it comes, ``prepare_model_for_packing`` on a fresh copy, and the truth
beside both: three sequences in one ``pack_collate`` row against each sequence alone (the largest logit difference),
measured here independently of the library's own probe, on other lengths than it uses.

    python -m scripts.packing_sweep                       # every model type, a line each, then the counts
    python -m scripts.packing_sweep --only llama,opt,gpt_oss
    python -m scripts.packing_sweep --json sweep.json --write-docs docs/library.md

A row's verdict: ``exact as is`` (accepted, exact, and preparing keeps it exact), ``exact once prepared`` (refused
as it comes, prepared, then exact), ``refused`` (both say why, in one line), or a defect the library must not have:
``accepted but wrong``, ``accepted but fails``, ``prepared but wrong``, ``prepared but fails``, ``raised <error>``
(anything but ValueError). The exit status is 1 when any row is a defect. Models that do not build from a small
config (sizes this script cannot shrink, a missing optional package, a forward that fails on input_ids alone at
those sizes) are listed as ``not built``, not judged.
``--write-docs`` replaces the table between the ``packing-sweep`` markers of that file with this run's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

# Packed and alone agree to rounding or differ by a defect: in float32 rounding is about 1e-6 and the smallest defect
# seen 4e-3; in bfloat16 stock attention over the whole row rounds to about 4e-3, so only larger defects show there.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05}
LENGTHS = (11, 6, 17)
WINDOW = 4
DEFECTS = ("accepted but wrong", "accepted but fails", "prepared but wrong", "prepared but fails", "raised")
# Sizes a config is shrunk to, where it has the attribute (its own name or an alias it maps).
SMALL = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
    topk_group=1, n_embd=64, n_layer=2, n_head=4, d_model=64, ffn_dim=128, decoder_layers=2,
    decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2, encoder_attention_heads=4,
    encoder_ffn_dim=128, n_positions=512, rotary_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, first_k_dense_replace=1, max_position_embeddings=512,
    vocab_size_per_layer_input=512, hidden_size_per_layer_input=16, num_layers=2,
    attention_types=[[["global", "local"], 1]],
)
MAX_PARAMETERS = 20_000_000  # a config whose sub-models this script cannot shrink is skipped, not built
BEGIN, END = "<!-- packing-sweep:begin -->", "<!-- packing-sweep:end -->"


def small_config(config_class, window: int | None = None):
    """``config_class`` at the sizes of ``SMALL`` (its text config too); ``window``: every sliding window that size."""
    from transformers import PretrainedConfig

    base = config_class()
    names = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    kwargs = {k: v for k, v in SMALL.items() if k in names}
    if "kv_lora_rank" in names and "num_key_value_heads" in kwargs:  # latent attention expands keys for every head
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    layer_types = getattr(base, "layer_types", None)
    if "layer_types" in names and layer_types:
        kinds = list(dict.fromkeys(layer_types))  # each kind of layer once (two layers of one kind where one kind)
        kwargs["layer_types"] = (kinds * 2)[: max(2, len(kinds))]
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    if window is not None:
        kwargs["sliding_window"] = window
        if "window_size" in names:  # GPT-Neo's local attention
            kwargs["window_size"] = window
    sub = getattr(base, "text_config", None)
    if isinstance(sub, PretrainedConfig):
        kwargs["text_config"] = small_config(type(sub), window).to_dict()
    config = config_class(**kwargs)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= SMALL["vocab_size"]:
            setattr(config, name, 1)
    return config


def model_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def has_window(model_type: str) -> bool:
    import transformers

    base = transformers.CONFIG_MAPPING[model_type]()
    text = getattr(base, "text_config", None) or base
    return "sliding_window" in text.to_dict() or "window_size" in text.to_dict()


def build(model_type: str, class_name: str, window: int | None, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    config = small_config(transformers.CONFIG_MAPPING[model_type], window)
    model_class = getattr(transformers, class_name)
    with torch.device("meta"):
        shaped = model_class(config)
    n = sum(p.numel() for p in shaped.parameters())
    if n > MAX_PARAMETERS:
        raise MemoryError(f"{n:,} parameters at the small sizes")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_class(config).to(dtype).eval()


def worst_difference(model: torch.nn.Module) -> float:
    """The largest logit difference between a sequence in a three-sequence packed row and the sequence alone."""
    from balance_batch.collate import pack_collate

    g = torch.Generator().manual_seed(7)
    vocab = min(int(getattr(model.config, "vocab_size", 512) or 512), 512)
    seqs = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    with torch.no_grad():
        batch = pack_collate([{"input_ids": s} for s in seqs])
        batch.pop("labels")
        packed = model(**batch).logits[0].float()
        start, worst = 0, 0.0
        for s in seqs:
            alone = model(input_ids=s[None], use_cache=False).logits[0].float()
            worst = max(worst, float((packed[start:start + len(s)] - alone).abs().max()))
            start += len(s)
    return worst


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}"


def _asks(call, model) -> tuple:
    """(True, None) where ``call(model)`` returns, (False, its one line) where it raises ValueError, and (None, what
    it raised) for anything else."""
    try:
        call(model)
        return True, None
    except ValueError as exc:
        return False, str(exc)
    except Exception as exc:  # noqa: BLE001 - anything but ValueError is a defect of the library, reported as such
        return None, f"{call.__name__}: {_short(exc)}"


def judge(model_type: str, class_name: str, window: int | None, dtype: torch.dtype) -> dict:
    """One row: what check_packable and prepare_model_for_packing say and what is true."""
    from balance_batch.integrations.transformers import check_packable, prepare_model_for_packing

    row = {"model_type": model_type, "class": class_name, "window": window}
    try:
        model = build(model_type, class_name, window, dtype)
    except Exception as exc:  # noqa: BLE001 - a model that does not build small is listed, not judged
        return {**row, "verdict": "not built", "why": _short(exc)}
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(3, 3 + LENGTHS[0])[None], use_cache=False)
    except Exception as exc:  # noqa: BLE001 - the small config is this script's; a model that cannot run it is not judged
        return {**row, "verdict": "not built", "why": "its forward on input_ids alone fails: " + _short(exc)}
    try:
        worst = worst_difference(model)
        row["as_is"] = f"{worst:.2g}"
        exact = worst <= TOLERANCE[dtype]
    except Exception as exc:  # noqa: BLE001 - the packed forward failing is a fact about the model
        row["as_is"], exact = _short(exc), False
    row["accepted"], refusal = _asks(check_packable, model)
    if refusal is not None:
        row["refusal"] = refusal
    model = build(model_type, class_name, window, dtype)  # prepared from scratch, as a user would
    row["prepared"], refusal = _asks(prepare_model_for_packing, model)
    if refusal is not None:
        row["prepare_refusal"] = refusal
    for asked, said in (("accepted", "refusal"), ("prepared", "prepare_refusal")):
        if row[asked] is None:  # anything but ValueError is a defect of the library
            return {**row, "verdict": "raised", "why": row.pop(said)}
    prepared_exact = None
    if row["prepared"]:
        try:
            worst = worst_difference(model)
            row["after"] = f"{worst:.2g}"
            prepared_exact = worst <= TOLERANCE[dtype]
        except Exception as exc:  # noqa: BLE001 - recorded: a prepared model whose packed forward fails
            row["after"], prepared_exact = _short(exc), False
    if row["accepted"] and not exact:
        verdict = "accepted but fails" if "Error" in row["as_is"] else "accepted but wrong"
    elif row["prepared"] and not prepared_exact:
        verdict = "prepared but fails" if "Error" in row["after"] else "prepared but wrong"
    elif row["accepted"]:
        verdict = "exact as is"
    elif row["prepared"]:
        verdict = "exact once prepared"
    else:
        verdict = "refused"
        row["why"] = row["prepare_refusal"]
    return {**row, "verdict": verdict}


def _reason(row: dict) -> str:
    """The refusal, without the model's name in front (one cell of the table)."""
    text = row.get("why", "")
    text = re.sub(r"^prepare_model_for_packing: (packed rows are not exact on \w+ and cannot be made so here: )?", "",
                  text)
    return text.replace("; use pad_collate (one row per sequence)", "").replace("|", "\\|")


def markdown(rows: list[dict], dtype: str) -> str:
    import transformers

    counts = Counter(r["verdict"] for r in rows)
    lines = [
        f"Swept in {dtype} on transformers {transformers.__version__}, torch {torch.__version__}: {len(rows)} models ("
        + ", ".join(f"{n} {v}" for v, n in counts.most_common()) + ").",
        "",
        "| model type | class | verdict | packed vs alone, as is / prepared | why refused |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["verdict"] == "not built":
            continue
        name = r["model_type"] + (f" (window {r['window']})" if r["window"] else "")
        measured = f"{r.get('as_is', '')} / {r.get('after', '-')}" if len(r.get("as_is", "")) < 12 else "fails / "
        if measured == "fails / ":
            measured += r.get("after", "-") if len(r.get("after", "-")) < 12 else "fails"
        why = _reason(r) if r["verdict"] == "refused" else ""
        lines.append(f"| {name} | {r['class']} | {r['verdict']} | {measured} | {why} |")
    built = list(dict.fromkeys(r["model_type"] for r in rows if r["verdict"] == "not built"))
    if built:
        lines += ["", f"Not built from a small config here, so not judged ({len(built)}): {', '.join(built)}."]
    return "\n".join(lines) + "\n"


def write_docs(path: Path, table: str) -> None:
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"packing_sweep: {path} has no {BEGIN} ... {END} markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + "\n" + table + END + tail, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m scripts.packing_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (default: every causal-LM model type)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no-windows", action="store_true", help="skip the sliding-window variants")
    parser.add_argument("--shard", default="1/1", help="K/N: run every N-th model type from the K-th (for N processes)")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--rows-from", type=Path, nargs="+",
                        help="run nothing: read the rows of earlier --json files (the shards of one sweep)")
    parser.add_argument("--write-docs", type=Path, help="replace the table between the packing-sweep markers")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    types = model_types()
    if args.only:
        wanted = args.only.split(",")
        unknown = [t for t in wanted if t not in types]
        if unknown:
            parser.error(f"--only: not causal-LM model types here: {', '.join(unknown)}")
        types = {t: types[t] for t in wanted}
    dtype = getattr(torch, args.dtype)
    shard, shards = (int(x) for x in args.shard.split("/"))
    if not 1 <= shard <= shards:
        parser.error(f"--shard: K/N with 1 <= K <= N, got {args.shard}")
    rows = []
    if args.rows_from:
        # a later file's row replaces an earlier one's for the same model (a rerun of a few)
        rows = list({(row["model_type"], row["window"]): row for path in args.rows_from
                     for row in json.loads(path.read_text(encoding="utf-8"))}.values())
        order = list(types)
        rows.sort(key=lambda r: (order.index(r["model_type"]) if r["model_type"] in order else len(order),
                                 r["window"] or 0))
        types = {}
    started = time.monotonic()
    for model_type, class_name in list(types.items())[shard - 1::shards]:
        windows = [None] + ([] if args.no_windows or not _safe_has_window(model_type) else [WINDOW])
        for window in windows:
            row = judge(model_type, class_name, window, dtype)
            rows.append(row)
            detail = row.get("why") or row.get("refusal", "")
            print(f"{model_type:28s} {str(window or ''):3s} {row['verdict']:22s} as is {row.get('as_is', '-'):>8.8s}"
                  f"  prepared {row.get('after', '-'):>8.8s}  {detail[:110]}", flush=True)
    counts = Counter(r["verdict"] for r in rows)
    print(f"{len(rows)} rows in {time.monotonic() - started:.0f} s: "
          + ", ".join(f"{n} {v}" for v, n in counts.most_common()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.write_docs:
        write_docs(args.write_docs, markdown(rows, dtype=args.dtype))
    return 1 if any(r["verdict"] in DEFECTS for r in rows) else 0


def _safe_has_window(model_type: str) -> bool:
    try:
        return has_window(model_type)
    except Exception:  # noqa: BLE001 - a config that does not build has no window to vary
        return False


if __name__ == "__main__":
    raise SystemExit(main())
