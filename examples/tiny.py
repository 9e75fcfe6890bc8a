"""What the examples share: a toy token dataset whose items say which index they are, and the tiny Qwen3.5-MoE model
(the architecture of the project's benchmark model, random weights, CPU-sized), ready for packed rows.

The examples here need only the library's wheel with its ``[transformers]`` extra, not the harness (time_to_loss.py
excepted): they run from a copy of this folder as from the checkout."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

# The harness's tiny model (backends.model.configs.TINY_CONFIG, which tests/unit/test_structure.py keeps equal to
# this): Qwen3.5-MoE's gated delta-net linear attention and full attention layers, 3:1, routed experts plus a shared
# expert, at a size two CPU cores train in seconds.
TINY_CONFIG = {"vocab_size": 2048, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 8,
               "num_experts_per_tok": 2, "max_position_embeddings": 262144, "tie_word_embeddings": False}
VOCAB = TINY_CONFIG["vocab_size"]


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


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """The tiny model in float32, train mode, prepared for packed rows (its CPU fallbacks of the linear-attention
    layers are made to honour ``cu_seq_lens``)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from balance_batch.integrations.transformers.packing import prepare_model_for_packing

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY_CONFIG)).float()
    prepare_model_for_packing(model)
    return model.train()
