"""Rank hooks that check a backend's set-up from inside real worker processes (imported by path there).

A failed check raises, which the controller reports as a start-up or pass failure naming the rank.
"""

from __future__ import annotations

import torch

from backends.fsdp2 import FSDP2Hooks


class FSDP2ExpectsBf16Policy(FSDP2Hooks):
    """Checks FSDP2's mixed precision on a bf16 model: bf16 parameters in compute, fp32 reduction and shards."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        model = super().wrap(model)
        policies = {
            (group.mp_policy.param_dtype, group.mp_policy.reduce_dtype)
            for m in model.modules()
            if isinstance(m, FSDPModule) and (group := m._get_fsdp_state()._fsdp_param_group) is not None
        }
        if policies != {(torch.bfloat16, torch.float32)}:
            raise RuntimeError(f"FSDP2 mixed precision (param, reduce) dtypes: {policies}")
        trainable = {p.dtype for p in model.parameters() if p.requires_grad}
        if trainable != {torch.float32}:  # peft keeps LoRA adapters in fp32: the sharded master copies
            raise RuntimeError(f"trainable sharded parameters are {trainable}, expected float32")
        lora_a = next(m for n, m in model.named_modules() if n.endswith("lora_A.default"))
        lora_a.register_forward_pre_hook(self._check_compute_dtype)
        return model

    @staticmethod
    def _check_compute_dtype(module, args):
        if module.weight.dtype != torch.bfloat16:
            raise RuntimeError(f"LoRA computes in {module.weight.dtype} under FSDP2, expected bfloat16")
