"""Megatron-core DDP backend: ranks batch independently; gradients meet in one ``finish_grad_sync`` per pass."""

from __future__ import annotations

import logging
import math
import warnings

import torch

from backends.model.step import grad_sq_sum
from backends.runtime.ranks import RankHooks
from backends.runtime.spawned import DistributedBackend


def point_cuda_device_at_cpu() -> None:
    """megatron-core allocates its gradient buffers on ``torch.cuda.current_device()``.

    Without CUDA that lookup fails, and with CUDA it would put a CPU rank's
    buffers on a GPU; answering "cpu" makes megatron-core 0.16.1 DDP run
    correctly on gloo. Only ever called in a worker process whose rank runs on the CPU.
    """
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


def needs_cpu_device_shim(device_type: str, cuda_available: bool) -> bool:
    """Whether a rank on ``device_type`` must point megatron-core's device lookup at the CPU.

    Every CPU rank does, whether or not the host has a GPU (``cuda_available``
    does not change the answer: a CPU rank on a GPU host would otherwise get
    its buffers on the GPU); CUDA ranks never do.
    """
    del cuda_available  # named so the decision is visibly independent of it
    return device_type == "cpu"


class MegatronDDPHooks(RankHooks):
    def setup(self) -> None:
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")
        logging.getLogger("megatron").setLevel(logging.WARNING)  # it lists every bucketed parameter at INFO
        if needs_cpu_device_shim(self.device.type, torch.cuda.is_available()):
            point_cuda_device_at_cpu()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer import TransformerConfig

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()  # pure data parallel: TP = PP = 1
        hf = model.config
        dtype = next(model.parameters()).dtype
        config = TransformerConfig(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            # Sum gradients across ranks instead of averaging: every rank already
            # divides its loss by the whole batch's weight.
            calculate_per_token_loss=True,
        )
        ddp_config = DistributedDataParallelConfig(
            # recorded by reduce_dtype overlap_grad_reduce=False, use_distributed_optimizer=False
            grad_reduce_in_fp32=True,
        )
        return DistributedDataParallel(config, ddp_config, model)

    def start_pass(self, model, pass_type: str) -> None:
        if pass_type == "forward_backward":
            model.zero_grad_buffer()

    def finish_pass(self, model, pass_type: str) -> None:
        if pass_type == "forward_backward":
            model.finish_grad_sync()

    def reduce_dtype(self, model) -> torch.dtype:
        return torch.float32  # grad_reduce_in_fp32: main_grad buffers and their all-reduce in float32

    def grad_norm(self, model) -> float:
        # After finish_grad_sync every rank holds the same all-reduced main_grad: one fused norm, one host read.
        grads = [p.main_grad.detach() for p in model.module.parameters()
                 if p.requires_grad and getattr(p, "main_grad", None) is not None]
        return math.sqrt(float(grad_sq_sum(grads, self.device).item()))


class MegatronDDPBackend(DistributedBackend):
    name = "megatron_ddp"
