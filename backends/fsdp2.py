"""FSDP2 backend: the model sharded with ``fully_shard``; ranks run the same number of steps per pass."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from backends.model.build import decoder_layers
from backends.model.loading import LOAD_PROGRESS_EVERY_S, load_sharded, read_source
from backends.model.step import grad_sq_sum, local_grads
from backends.runtime.ranks import RankHooks
from backends.runtime.spawned import DistributedBackend
from backends.specs import ModelSpec
from balance_batch.plan import Schedule


def mixed_precision_policy(model: torch.nn.Module):
    """bf16/fp16 parameters and compute, gradients reduced in fp32, for a model that runs in half precision.

    A float32 model gets the default policy (no casting). Trainable parameters
    keep the dtype they were created in (peft makes LoRA adapters float32), so
    their sharded gradients accumulate in that dtype after the fp32 reduction.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_mesh(device: torch.device, world_size: int):
    """The 1-D mesh the shards live on, of the ranks' own device type.

    Explicit because ``fully_shard`` without a mesh picks the accelerator
    whenever one exists, so CPU ranks on a GPU host would shard onto the GPU.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


class StepCountMismatch(RuntimeError):
    """FSDP2 ranks about to run different numbers of steps in one pass."""


def check_equal_step_counts(steps: int, world_size: int, device: torch.device) -> None:
    """Raise on every rank, before any step, unless all ranks will run ``steps`` steps.

    FSDP2 gathers and reduces parameters inside each step, so a rank running
    fewer steps leaves the others in a collective: a crash on gloo, a hang until
    the time-out on NCCL. One small all-gather first turns that into an error
    naming each rank's count, raised alike on every rank.
    """
    mine = torch.tensor([steps], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(counts, mine)
    per_rank = [int(c.item()) for c in counts]
    if len(set(per_rank)) > 1:
        listed = ", ".join(f"rank {r} has {n}" for r, n in enumerate(per_rank))
        raise StepCountMismatch(
            f"FSDP2 ranks would run different numbers of steps in this pass ({listed}); every rank must call "
            "the model equally often (short ranks are padded with dummy steps), so the pass was stopped before its "
            "first step"
        )


class FSDP2Hooks(RankHooks):
    load_progress_every_s = LOAD_PROGRESS_EVERY_S  # rank 0's broadcast progress lines while loading

    def load_model(self, model_spec: ModelSpec) -> tuple[torch.nn.Module, Optional[dict], str]:
        # Built on meta and sharded before any weight is read: no rank ever holds the unsharded model.
        # The others wait for rank 0's read on the job's store, not in a collective (backends/model/loading.py
        # ReadGate).
        return load_sharded(model_spec, self.device, self.spec.gradient_checkpointing, self.wrap, self.rank,
                            store=self.store, read=self.read_weights, progress_every_s=self.load_progress_every_s,
                            timeout_s=self.spec.dist_timeout_s)

    def read_weights(self, model_spec: ModelSpec, device: torch.device) -> torch.nn.Module:
        """Rank 0's host copy of the weights, which the broadcasts send."""
        return read_source(model_spec, device)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mp_policy = mixed_precision_policy(model)
        mesh = shard_mesh(self.device, self.world_size)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        # Sum, not average, across ranks: each rank's loss is already divided by
        # the whole batch's weight, so the sum is the batch gradient. A plain SUM
        # (no pre-multiplied sum) is also what gloo supports.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.9
                    module.set_force_sum_reduction_for_comms(True)
        return model

    def align(self, local: Schedule) -> Schedule:
        schedule = self.pad(local)
        check_equal_step_counts(len(schedule), self.world_size, self.device)
        return schedule

    def pad(self, local: Schedule) -> Schedule:
        # Every rank must call the model equally often: agree on the most steps
        # on the main process group and pad with zero-weight dummy steps (a
        # lock-step plan already has equal lengths: the count then changes nothing).
        count = torch.tensor([len(local)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return list(local) + [None] * (int(count.item()) - len(local))

    def reduce_dtype(self, model: torch.nn.Module) -> Optional[torch.dtype]:
        # The policy's reduce dtype; the default policy (a float32 model) reduces in the gradients' own dtype.
        trainable = [p for p in model.parameters() if p.requires_grad]
        return mixed_precision_policy(model).reduce_dtype or (trainable[0].dtype if trainable else None)

    def grad_norm(self, model: torch.nn.Module) -> float:
        # Each rank's shards' sum of squares, summed across ranks on the device: one host read per pass.
        t = grad_sq_sum(local_grads(model), self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return math.sqrt(float(t.item()))


    def wait_points(self, model: torch.nn.Module) -> list:
        # Where a rank waits for its peers inside a step: each parameter group's all-gather wait (and copy-out) before
        # its forward and backward, its post-backward reduce-scatter (which also waits for earlier ones to free
        # their buffers) and the final wait for the last reduce-scatters. The host blocks there on gloo; on CUDA the
        # compute stream waits on the collectives' events.
        from torch.distributed.fsdp import FSDPModule

        points = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            for group in getattr(state, "_fsdp_param_groups", None) or []:
                points += [(group, name) for name in FSDP_WAITS if hasattr(group, name)]
        return points


# FSDPParamGroup's methods that wait for a collective (torch 2.13)
FSDP_WAITS = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")


class FSDP2Backend(DistributedBackend):
    name = "fsdp2"
