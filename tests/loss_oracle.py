"""An independent oracle for a pass's loss: a plain Hugging Face forward per example, log_softmax, a hand-written sum.

No harness code runs here (no planner, no collate, no step, no log-prob head):
the model is built from the tiny config and peft the documented way, each
example goes through it alone, and the batch loss is

    L = sum over examples and tokens of -weight * log p(target) / sum of all weights

so its gradient is what every backend must report, however it groups the batch.
"""

from __future__ import annotations

import contextlib
import math
import sys

import numpy as np
import torch

from backends.messages import Example
from backends.model.configs import TINY_CONFIG


def tiny_examples(
    lengths=(9, 5, 14, 7, 3, 11), vocab_size: int = TINY_CONFIG["vocab_size"], seed: int = 7
) -> list[Example]:
    """A few short examples with uneven, non-integer weights (zeros among them), so no normalisation is accidentally
    right."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(0, vocab_size, n, dtype=np.int64)
        targets = rng.integers(0, vocab_size, n, dtype=np.int64)
        weights = rng.uniform(0.2, 3.0, n).astype(np.float32)
        weights[rng.random(n) < 0.3] = 0.0
        weights[-1] = 1.5  # every example carries some weight
        out.append(Example(ids, targets, weights))
    return out


def plain_model(init_seed: int = 0, lora_rank: int = 32) -> torch.nn.Module:
    """The tiny model as transformers and peft build it from the same seeds (ModelSpec's defaults), float32 on CPU."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY_CONFIG))
    model.config.use_cache = False
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0, target_modules="all-linear", bias="none"
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed + 1)
            model = get_peft_model(model, config)
    return model.train()


# The marker the library's prepare_model_for_packing sets on the functions it swaps into transformers' modules;
# the function it replaced is the marker's value.
_SWAPPED_MARK = "_balance_batch_packed"


@contextlib.contextmanager
def stock_transformers():
    """transformers' own module functions, while inside: the harness swaps some in place
    (prepare_model_for_packing).

    A process that built a harness model has its conv, delta-rule and grouped-GEMM functions
    replaced module-wide, so without this the oracle would run the harness's scan too.
    """
    swapped = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            original = getattr(value, _SWAPPED_MARK, None) if callable(value) else None
            if original is not None:
                swapped.append((module, attr, value))
                setattr(module, attr, original)
    try:
        yield
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


def oracle(examples: list[Example], model: torch.nn.Module | None = None) -> dict:
    """Per-example target log-probs and weighted loss sums, the batch loss, its gradient (by name) and gradient norm."""
    with stock_transformers():
        return _oracle(examples, model or plain_model())


def _oracle(examples: list[Example], model: torch.nn.Module) -> dict:
    model.zero_grad(set_to_none=True)
    total_weight = sum(float(np.asarray(e.weights, dtype=np.float64).sum()) for e in examples)
    logprobs, losses, batch_loss = [], [], 0.0
    for ex in examples:
        ids = torch.as_tensor(ex.input_ids).unsqueeze(0)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)[torch.arange(len(ex)), torch.as_tensor(ex.target_tokens)]
        loss = -(lp * torch.as_tensor(ex.weights)).sum()
        (loss / total_weight).backward()  # gradients add up over examples: the batch's gradient
        logprobs.append(lp.detach().numpy().copy())
        losses.append(float(loss.detach()))
        batch_loss += float(loss.detach()) / total_weight
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    return {"logprobs": logprobs, "losses": losses, "loss": batch_loss, "total_weight": total_weight,
            "grads": grads, "grad_norm": grad_norm}
