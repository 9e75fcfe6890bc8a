"""Model construction: the tiny Qwen3.5-MoE, LoRA, gradient checkpointing, and loading a local checkpoint."""

from __future__ import annotations

import pytest
import torch

from backends.errors import UserError
from backends.model.build import build_model, model_vocab_size
from backends.specs import ModelSpec

CPU = torch.device("cpu")


def test_tiny_model_has_the_benchmark_architecture():
    model = build_model(ModelSpec(lora_rank=0), CPU, gradient_checkpointing=False)
    cfg = model.config
    assert cfg.model_type == "qwen3_5_moe_text"
    assert {"linear_attention", "full_attention"} <= set(cfg.layer_types)
    assert cfg.num_experts > cfg.num_experts_per_tok > 1
    assert all(p.requires_grad for p in model.parameters())  # rank 0 = full fine-tuning


def test_same_seed_same_weights_and_lora_rank_from_config():
    a = build_model(ModelSpec(lora_rank=8), CPU, False)
    b = build_model(ModelSpec(lora_rank=8), CPU, False)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    ranks = {p.shape[0] for n, p in a.named_parameters() if "lora_A" in n}
    assert ranks == {8}


def _layer_forward_calls(model: torch.nn.Module) -> int:
    """How often one decoder layer's forward runs in one forward+backward (a real forward hook counts).

    transformers checkpoints the layer's ``forward``, not its ``__call__`` (so
    the layer's own hooks run once); the hook sits on a module inside it, which
    the recomputation calls again.
    """
    from backends.model.build import decoder_layers

    layer = decoder_layers(model)[1]
    calls = []
    handle = layer.input_layernorm.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
    finally:
        handle.remove()
    return len(calls)


def test_gradient_checkpointing_switch():
    """On: each decoder layer's forward runs again in backward (activations recomputed); off: once."""
    on, off = build_model(ModelSpec(), CPU, True), build_model(ModelSpec(), CPU, False)
    assert on.is_gradient_checkpointing and not off.is_gradient_checkpointing
    assert _layer_forward_calls(off) == 1
    assert _layer_forward_calls(on) == 2


def test_local_checkpoint_loads_and_matches(tmp_path):
    base = build_model(ModelSpec(lora_rank=0), CPU, False)
    base.save_pretrained(tmp_path / "ckpt")
    spec = ModelSpec(name="local", path=str(tmp_path / "ckpt"))
    assert model_vocab_size(spec) == base.config.vocab_size
    loaded = build_model(spec, CPU, False)
    tiny = build_model(ModelSpec(), CPU, False)
    ids = torch.randint(0, base.config.vocab_size, (2, 33))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, tiny(input_ids=ids).logits)


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(UserError, match=r"model.path: '.*nowhere'"):
        build_model(ModelSpec(path=str(tmp_path / "nowhere")), CPU, False)
