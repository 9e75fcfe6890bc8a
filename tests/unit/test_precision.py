"""The precision policy inside one bf16 model, in-process (every backend on real ranks:
tests/integration/test_precision.py)."""

from __future__ import annotations

import torch

from backends.model.build import build_model, describe_precision
from backends.specs import ModelSpec


def test_lora_adapters_compute_in_bf16_and_keep_float32_weights_and_gradients():
    """The policy itself, inside one bf16 model: every LoRA factor multiplies bf16 by bf16, and its float32
    weight receives a float32 gradient (what FSDP2's mixed precision does to every parameter)."""
    model = build_model(ModelSpec(dtype="bfloat16"), torch.device("cpu"), False)
    seen = []

    def record(module, args, output):
        seen.append((args[0].dtype, output.dtype, module.weight.dtype))

    factors = [m for n, m in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    assert len(factors) == 70
    handles = [m.register_forward_hook(record) for m in factors]
    ids = torch.randint(0, 2048, (2, 24))
    model(input_ids=ids, use_cache=False).logits.float().sum().backward()
    for h in handles:
        h.remove()
    assert len(seen) == len(factors)
    assert {out for _, out, _ in seen} == {torch.bfloat16}  # computed in bf16 ...
    assert {w for _, _, w in seen} == {torch.float32}  # ... from float32 weights
    grads = {m.weight.grad.dtype for m in factors if m.weight.grad is not None}
    assert grads == {torch.float32}
    assert describe_precision(model, None)["compute"] == "bfloat16"
