"""Model architectures as plain dicts (no torch): the tiny test model, the benchmark model's shipped config, and their
cost models."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from backends.errors import UserError
from backends.specs import ModelSpec
from balance_batch.cost import CostModel, cost_model_from_config

# The benchmark model's architecture (Qwen3.5-MoE: gated delta-net linear
# attention and full attention layers, 3:1, routed experts plus a shared
# expert) at a size two CPU cores can train in seconds.
TINY_CONFIG = dict(
    vocab_size=2048,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
)

# Qwen3.5-35B-A3B's text config (the fields the cost model reads), so a dry run
# needs no checkpoint. Values as published with the model: they agree across
# THUDM/slime scripts/models/qwen3.5-35B-A3B.sh (40 layers, hidden 2048, 16
# heads / 2 KV heads of 256, 256 experts top-8 of 512, shared expert 512,
# linear attention 16 key / 32 value heads of 128, 1 full-attention layer in 4,
# vocabulary 248,320, untied embeddings), a public test fixture copied from
# mlx-community/Qwen3.5-35B-A3B-4bit's text_config, and the defaults of
# transformers 5.24's Qwen3_5MoeTextConfig (documented as Qwen/Qwen3.5-35B-A3B).
QWEN3_5_35B_A3B_TEXT_CONFIG = dict(
    model_type="qwen3_5_moe_text",
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    full_attention_interval=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    mlp_only_layers=[],
    max_position_embeddings=262144,
    tie_word_embeddings=False,
)

# Configs shipped in the repository, by model name (harness/conf/model/<name>.yaml).
SHIPPED_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {**TINY_CONFIG, "model_type": "qwen3_5_moe_text"},
    "qwen3_5_35b_a3b": QWEN3_5_35B_A3B_TEXT_CONFIG,
}


def config_file(spec: ModelSpec) -> Optional[Path]:
    """The checkpoint's config.json when it is on disk, else None."""
    if spec.path is None:
        return None
    path = Path(os.path.expanduser(str(spec.path))) / "config.json"
    return path if path.is_file() else None


def model_config(spec: ModelSpec) -> tuple[dict[str, Any], str]:
    """The model's config and where it came from: the checkpoint's config.json when it is on disk, else the shipped one.

    The tiny model (no path) is TINY_CONFIG with the spec's vocabulary size.
    A named model whose checkpoint is absent or not given (a dry run on a
    laptop; a real run refuses a missing checkpoint before this matters) falls
    back to its shipped config; a model with neither gets the token-count cost.
    """
    path = config_file(spec)
    if path is not None:
        data = read_json_file(path, "a checkpoint's config.json")
        return dict(data.get("text_config") or data), str(path)
    if spec.path is None and (spec.name == "tiny" or spec.name not in SHIPPED_CONFIGS):
        config = dict(SHIPPED_CONFIGS["tiny"])
        if spec.vocab_size:
            config["vocab_size"] = int(spec.vocab_size)
        return config, "backends/model/configs.py:TINY_CONFIG"
    if spec.name in SHIPPED_CONFIGS:
        why = "no model.path" if spec.path is None else "checkpoint not on disk"
        return dict(SHIPPED_CONFIGS[spec.name]), f"backends/model/configs.py:{spec.name} ({why})"
    return {}, ""


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path`` (``what`` it should be, for the error), or one line naming the file and the
    problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"model.path: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                        f"{what} is JSON, as save_pretrained writes it") from None
    except OSError as exc:
        raise UserError(f"model.path: cannot read {path} ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"model.path: {path} is not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno}); "
                        f"{what} is one JSON object, as save_pretrained writes it") from None
    if not isinstance(data, dict):
        raise UserError(f"model.path: {path} holds a JSON {type(data).__name__}, not an object "
                        f"({what} is one JSON object, as save_pretrained writes it)")
    return data


# Architectures (config model_type) whose layers the packed layout keeps apart at sequence boundaries:
# Qwen3.5-MoE's gated delta-net and full attention (prepare_model_for_packing), tested against padded and mbs=1.
PACKED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def check_model_spec(spec: ModelSpec, layout: str = "padded") -> None:
    """Settings the model would silently ignore or not run, refused in one line before anything is loaded (torch-free).

    - ``model.vocab_size`` sizes the tiny model only; a checkpoint's vocabulary is its own.
    - ``layout=packed`` needs an architecture whose layers packing keeps apart
      (``PACKED_MODEL_TYPES``); read from config.json, or the shipped config.
      A model with neither (a dry run of a checkpoint not on disk) is not judged here.
    """
    if spec.path is not None and spec.vocab_size is not None:
        config, _ = model_config(spec)
        own = f" ({config['vocab_size']} in {spec.path})" if "vocab_size" in config else ""
        raise UserError(f"model.vocab_size: applies only to the tiny model built in code (model.path=null); "
                        f"a checkpoint's vocabulary is its own{own}: drop model.vocab_size={spec.vocab_size}")
    if layout == "packed":
        config, source = model_config(spec)
        # a composite checkpoint names its type at the top and in its text_config: either one will do
        file = config_file(spec)
        top = read_json_file(file, "a checkpoint's config.json") if file is not None else {}
        types = [t for t in (config.get("model_type"), top.get("model_type")) if t is not None]
        if config and not set(types) & set(PACKED_MODEL_TYPES):
            raise UserError(f"layout: packed keeps sequences apart only in Qwen3.5-MoE models (model_type "
                            f"{' / '.join(PACKED_MODEL_TYPES)}), and {source} says model_type "
                            f"{types[0] if types else None!r}; use layout=padded for it")


def cost_model_for(spec: ModelSpec) -> CostModel:
    """The planner's cost model for a model spec (torch-free; reads config.json only)."""
    config, source = model_config(spec)
    if not config:
        return CostModel.tokens()
    try:
        return cost_model_from_config(config, source)
    except (KeyError, TypeError, ValueError):
        return CostModel.tokens()  # an architecture the formula does not know: fall back to tokens

