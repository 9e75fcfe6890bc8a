"""What the examples share: a toy token dataset whose items say which index they are, and the tiny Qwen3.5-MoE model
(the architecture of the project's benchmark model, random weights, CPU-sized), ready for packed rows."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

VOCAB = 2048


class ToyDataset(Dataset):
    """Item i: ``input_ids`` of ``lengths[i]`` tokens, starting with token i (so a batch shows its indices)."""

    def __init__(self, lengths, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.cat([torch.tensor([i % VOCAB]), torch.randint(0, VOCAB, (n - 1,), generator=g)])
                      for i, n in enumerate(lengths)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def tiny_model(lora_rank: int = 0, seed: int = 0) -> torch.nn.Module:
    """The tiny model in float32, train mode, with LoRA adapters when ``lora_rank`` > 0, prepared for packed rows
    (its CPU fallbacks of the linear-attention layers are made to honour ``cu_seq_lens``)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from backends.model.configs import TINY_CONFIG
    from balance_batch.integrations.transformers.packing import prepare_model_for_packing

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY_CONFIG)).float()
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules="all-linear",
                                                 lora_dropout=0.0))
    prepare_model_for_packing(model)
    return model.train()
