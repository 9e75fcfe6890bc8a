"""Packed rows on stock Hugging Face models: ``model(**pack_collate(samples))`` gives each sequence's loss and the
gradient one sequence per forward gives, on standard-attention models as they come (``use_cache`` left at its
default) and on the tiny Qwen3.5-MoE once ``prepare_model_for_packing`` ran; what cannot keep sequences apart is
refused in one line. ``pad_collate``'s right-padded rows give a stock Llama the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.model.configs import TINY_CONFIG
from balance_batch.collate import pack_collate, pad_collate
from balance_batch.integrations.transformers import check_packable, prepare_model_for_packing
from tests.loss_oracle import stock_transformers

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
LENGTHS = (7, 13, 4, 21, 9)
MODELS = ("llama", "qwen2", "qwen3", "qwen3_5_moe")
FLOAT32_TOL = 1e-5


def build(name: str, attention: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A stock model from its default config (small sizes only), random weights from seed 0."""
    import transformers as tf

    config = {
        "llama": lambda: tf.LlamaConfig(**SMALL),
        "qwen2": lambda: tf.Qwen2Config(**SMALL),
        "qwen3": lambda: tf.Qwen3Config(**SMALL, head_dim=16),
        "qwen3_5_moe": lambda: tf.Qwen3_5MoeTextConfig(**TINY_CONFIG),
    }[name]()
    config._attn_implementation = attention
    model_class = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
                   "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM}[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config).to(dtype).train()
    assert model.config.use_cache  # the default the packed row must be right under
    if name == "qwen3_5_moe":
        prepare_model_for_packing(model)  # its linear-attention layers need it; the others need nothing
    return model


def samples_for(model: torch.nn.Module) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, model.config.vocab_size, (n,), generator=g)} for n in LENGTHS]


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each predicted token's loss (the causal LM's shift), those with a label only."""
    labels = labels[0, 1:]
    losses = F.cross_entropy(logits[0, :-1].float(), labels, reduction="none", ignore_index=-100)
    return losses[labels != -100]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def packed(model: torch.nn.Module, samples: list[dict]) -> tuple[torch.Tensor, dict]:
    """Per-token losses and the gradient of the mean loss, the samples in one packed row."""
    batch = pack_collate(samples)
    n = sum(len(s["input_ids"]) - 1 for s in samples)
    out = model(**batch, num_items_in_batch=n)
    out.loss.backward()
    return _token_losses(out.logits, batch["labels"]).detach(), _grads(model)


def one_per_forward(model: torch.nn.Module, samples: list[dict]) -> tuple[torch.Tensor, dict]:
    """The same, one sequence per forward, with transformers' own functions (none of ours swapped in)."""
    n = sum(len(s["input_ids"]) - 1 for s in samples)
    losses = []
    with stock_transformers():
        for sample in samples:
            ids = sample["input_ids"][None]
            out = model(input_ids=ids, labels=ids, num_items_in_batch=n)
            out.loss.backward()
            losses.append(_token_losses(out.logits, ids).detach())
    return torch.cat(losses), _grads(model)


def gaps(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> tuple[float, float]:
    """Largest difference of per-token losses, and of any gradient entry."""
    (losses_a, grads_a), (losses_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    return (float((losses_a - losses_b).abs().max()),
            max(float((grads_a[k] - grads_b[k]).abs().max()) for k in grads_a))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_a_packed_row_gives_each_sequences_losses_and_gradient_in_float32(name, attention):
    model = build(name, attention)
    samples = samples_for(model)
    loss_gap, grad_gap = gaps(packed(model, samples), one_per_forward(model, samples))
    assert loss_gap <= FLOAT32_TOL and grad_gap <= FLOAT32_TOL, (loss_gap, grad_gap)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["llama", "qwen3_5_moe"])
def test_a_packed_row_in_bf16_differs_from_one_per_forward_by_bf16_rounding_only(name, attention):
    """bf16 keeps 8 significant bits: the same sums in another order (one row under a block mask, or one sequence
    under a causal one) round differently, so the layouts cannot agree as in float32. The bound is what rounding alone
    moves, measured on the same model (one sequence per forward, bf16 against float32: r): each layout may be r off
    the exact answer, so 2r apart, doubled for the different summation orders: 4r (measured: at most 2.5r, in
    Qwen3.5-MoE eager's gradient). Attention across sequences moves bf16 losses by ~0.2 and gradients by ~0.1 here,
    10x and more beyond the bound."""
    model = build(name, attention, torch.bfloat16)
    samples = samples_for(model)
    reference = one_per_forward(model, samples)
    loss_r, grad_r = gaps(reference, one_per_forward(build(name, attention), samples))
    loss_gap, grad_gap = gaps(packed(model, samples), reference)
    assert loss_gap <= 4 * loss_r and grad_gap <= 4 * grad_r, ((loss_gap, grad_gap), (loss_r, grad_r))


def test_the_batch_keeps_use_cache_off_through_dataloader_workers():
    from torch.utils.data import DataLoader

    data = [{"input_ids": torch.arange(n)} for n in LENGTHS]
    loader = DataLoader(data, batch_size=2, collate_fn=pack_collate, num_workers=1)
    assert all(batch["use_cache"] is False for batch in loader)


def test_attention_that_keeps_no_sequences_apart_is_refused_in_one_line():
    model = build("llama", "sdpa")
    check_packable(model)
    model.config._attn_implementation = "paged|eager"  # builds no mask and reads no cu_seq_lens: attends across
    for refuse in (check_packable, prepare_model_for_packing):
        with pytest.raises(ValueError, match=r"'paged\|eager' .* valid: sdpa, eager, flex_attention") as error:
            refuse(model)
        assert "\n" not in str(error.value)


def test_linear_attention_is_refused_until_prepared_and_other_stateful_layers_always():
    import transformers as tf

    with stock_transformers():  # as a fresh process has it: no function of ours swapped in
        with pytest.raises(ValueError, match=r"GatedDeltaNet .* call prepare_model_for_packing\(model\)"):
            check_packable(tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**TINY_CONFIG)))
    check_packable(build("qwen3_5_moe", "sdpa"))
    lfm2 = tf.Lfm2ForCausalLM(tf.Lfm2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             layer_types=["conv", "full_attention"]))
    for refuse in (check_packable, prepare_model_for_packing):
        with pytest.raises(ValueError, match=r"Lfm2ShortConv layers carry a recurrent state .* attention-only models"):
            refuse(lfm2)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padded_rows_give_each_sequences_losses_and_gradient_on_a_stock_llama(attention):
    """pad_collate's attention_mask keeps the padding out of attention and its labels out of the loss: each
    sequence's per-token losses and the gradient equal one sequence per forward (float32)."""
    model = build("llama", attention)
    samples = samples_for(model)
    batch = pad_collate(samples, pad_token_id=model.config.vocab_size - 1)
    out = model(**batch, num_items_in_batch=sum(len(s["input_ids"]) - 1 for s in samples))
    out.loss.backward()
    losses = torch.cat([_token_losses(out.logits[r : r + 1], batch["labels"][r : r + 1])
                        for r in range(len(samples))]).detach()
    loss_gap, grad_gap = gaps((losses, _grads(model)), one_per_forward(model, samples))
    assert loss_gap <= FLOAT32_TOL and grad_gap <= FLOAT32_TOL, (loss_gap, grad_gap)
