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


class FSDP2ChecksShardedLoad(FSDP2Hooks):
    """Checks the sharded load inside each rank: meta before sharding, only this rank's chunk after, the same values.

    The reference is the unsharded build every other backend uses (plain
    from_pretrained for a checkpoint, the seed for the tiny model); every
    parameter, persistent and non-persistent buffer must equal it bit for bit.
    """

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        real = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type != "meta"]
        if real:
            raise RuntimeError(f"rank {self.rank}: {len(real)} tensors hold storage before sharding, e.g. {real[:3]}")
        return super().wrap(model)

    def load_model(self, model_spec):
        from torch.distributed.tensor import DTensor

        from backends.model.build import build_model

        model, built, method = super().load_model(model_spec)
        reference = build_model(model_spec, self.device, False)
        expected = reference.state_dict()
        names = list(model.state_dict())
        if set(names) != set(expected):
            raise RuntimeError(f"rank {self.rank}: state dict names differ: {sorted(set(names) ^ set(expected))[:5]}")
        for name, value in model.state_dict().items():
            if not isinstance(value, DTensor):
                raise RuntimeError(f"rank {self.rank}: {name} is not sharded ({type(value).__name__})")
            if value.device_mesh.device_type != self.device.type:
                raise RuntimeError(f"rank {self.rank}: {name} sharded on {value.device_mesh.device_type}")
            full = expected[name]
            chunks = torch.chunk(full, self.world_size, dim=0)
            mine = chunks[self.rank] if self.rank < len(chunks) else full[:0]
            if not torch.equal(value.to_local(), mine):
                raise RuntimeError(f"rank {self.rank}: {name} holds {tuple(value.to_local().shape)}, not its chunk "
                                   f"{tuple(mine.shape)} of {tuple(full.shape)} with the reference's values")
        reference_buffers = dict(reference.named_buffers())
        for name, buffer in model.named_buffers():
            if not torch.equal(buffer, reference_buffers[name]) or buffer.dtype != reference_buffers[name].dtype:
                raise RuntimeError(f"rank {self.rank}: buffer {name} differs from the unsharded build")
        if not any(n.endswith("inv_freq") for n in reference_buffers):
            raise RuntimeError("no rotary inv_freq buffer found: the non-persistent buffer check checked nothing")
        return model, built, method


class FSDP2SlowRank0Read(FSDP2ChecksShardedLoad):
    """Rank 0's read of the weights takes longer than the process group's time-out (a real sleep, as a slow filesystem).

    The sharded load must still complete with the reference's values (checked
    as in ``FSDP2ChecksShardedLoad``), and rank 0 logs its broadcast progress on
    every tensor so that the lines show up in a short test.
    """

    load_progress_every_s = 0.0

    def read_weights(self, model_spec, device):
        import time

        time.sleep(self.read_delay_s(self.spec.dist_timeout_s))
        return super().read_weights(model_spec, device)

    @staticmethod
    def read_delay_s(dist_timeout_s: float) -> float:
        return 1.5 * dist_timeout_s + 1.0


class FSDP2SeesItsControllersEnvironment(FSDP2Hooks):
    """Checks the rank runs with the environment its controller had when it started the rank (as spawn gave it),
    not the fork server's (started earlier, for the whole process: backends/runtime/forkserver.py)."""

    def setup(self) -> None:
        import os

        if os.environ.get("BALANCE_BATCH_TEST_PROBE") != "set-after-the-fork-server":
            raise RuntimeError("rank environment: "
                               f"BALANCE_BATCH_TEST_PROBE={os.environ.get('BALANCE_BATCH_TEST_PROBE')!r}")
        super().setup()
