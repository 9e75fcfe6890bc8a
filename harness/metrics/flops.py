"""Model FLOPs, achieved FLOP/s and MFU of a pass: a training-FLOPs model from the model's config, and a device peak.

What is counted (``TrainingFlops``, from the config and ``model.lora_rank``;
multiply-adds count 2; elementwise work, norms, softmax and the embedding
gather are left out):

- Forward, per sequence of length L: every weight matmul a token goes
  through (``balance_batch.cost.weight_matmuls``: projections, router,
  top-k routed experts, shared expert, LM head) and the short depthwise
  convolution; with LoRA also each adapter, 2·r·(d_in + d_out) per token of
  every ``nn.Linear`` peft's "all-linear" adapts (not the router, the fused
  3-D experts or the LM head); causal attention, 2·heads·head_dim·(L² + L)
  per full-attention layer; and the gated delta rule as the chunked
  algorithm computes it (``backends.model.packing.segment_chunk_gated_delta_rule``,
  chunks of 64 per sequence, the last one zero-padded): per chunk and value
  head the products K_β·Kᵀ, Q·Kᵀ, the intra-chunk read (C×C)·V, the two
  unit-triangular solves and the three state products, 6·C·d_k·d_v.
- Backward: input gradients everywhere (1× forward for a weight matmul, 2×
  for the activation-activation products: attention and the delta rule),
  except into the frozen embedding's output under LoRA (layer 0's token-mixer
  projections get none); weight gradients only for trainable weights: every
  weight under full fine-tuning (so fwd+bwd is exactly 3× forward), only the
  adapters under LoRA (1× their forward).

Model FLOPs are that work for the real sequences. Hardware FLOPs are the
work of the micro-batches the plan runs: padded rows at their longest
length (padding included), packed rows as their sequences, and with gradient
checkpointing one more forward for the recomputation (plus, under LoRA, the
input gradient into layer 0 that peft's ``enable_input_require_grads``
turns on), and under full fine-tuning the chunked log-prob head's logits,
recomputed in backward (backends/model/logprobs.py). MFU = model FLOP/s per device ÷ the device's dense peak.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from balance_batch import CostModel
from balance_batch.cost import token_mixers, weight_matmuls

# Dense data-sheet peaks (no sparsity), FLOP/s per device, per compute dtype: bf16 (and fp16) on the tensor cores;
# float32 without them (torch's float32 matrix products are IEEE float32 unless TF32 is switched on, which this
# project never does). The first key found in torch.cuda.get_device_name wins, so a variant comes before its
# family's bare name: "NVIDIA H200 NVL" must not match "H200" (the SXM part, e.g. "NVIDIA H200").
GPU_PEAKS = (
    ("B200", {"bfloat16": 2.25e15, "float32": 75e12}),
    ("H200 NVL", {"bfloat16": 835e12, "float32": 60e12}),
    ("H200", {"bfloat16": 989e12, "float32": 67e12}),  # SXM
    ("H100 NVL", {"bfloat16": 835e12, "float32": 60e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 51e12}),
    ("H100", {"bfloat16": 989e12, "float32": 67e12}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", {"bfloat16": 312e12, "float32": 19.5e12}),
)
FULL_FINE_TUNING_FACTOR = 3.0  # forward + backward = 3 forwards when every weight is trained
# chunk size of the chunked gated delta rule (transformers' and the library's packing.py's default)
DELTA_RULE_CHUNK = 64


def gpu_peak_flops(name: str, dtype: str = "bfloat16") -> Optional[float]:
    """The dense peak of a GPU by its name for a compute ``dtype`` (float16 counts as bfloat16), None for a device
    not in the table."""
    upper = name.upper()
    column = "float32" if dtype == "float32" else "bfloat16"
    for key, peaks in GPU_PEAKS:
        if key.upper() in upper:
            return peaks[column]
    return None


@functools.lru_cache(maxsize=None)
def measured_cpu_matmul_flops(dtype: str = "float32", repeats: int = 5, next_size_s: float = 0.25) -> tuple[float, int]:
    """(rate, n): this machine's n³ matrix-multiply rate in ``dtype`` with all its threads (best of ``repeats``).

    n starts at 256 and doubles up to 1024 while the next size's product is expected to take at most
    ``next_size_s``: float32 reaches 1024 in milliseconds, while a CPU without bf16 matrix units spends
    seconds on one bf16 1024³ product (19 s for best-of-5 on a 2-core EPYC), paid by every bf16 run.
    Measured once per process.
    """
    import torch

    def best_time(n: int, times: int) -> float:
        a = torch.randn(n, n, dtype=getattr(torch, dtype))
        b = torch.randn(n, n, dtype=getattr(torch, dtype))
        torch.mm(a, b)  # warm-up: thread pool and caches
        best = float("inf")
        for _ in range(times):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        return best

    n = 256
    while n < 1024 and 8 * best_time(n, 1) <= next_size_s:
        n *= 2
    return 2.0 * n**3 / best_time(n, repeats), n


def device_peak(device: dict, world_size: int, compute_dtype: str = "float32") -> dict:
    """{"flops_per_device": peak or None, "source": where it came from} for the devices a run uses.

    The peak is the run's compute dtype's (``precision.compute``): on a GPU the data sheet's column for it (bf16
    tensor cores, or float32 without them), on a CPU a matmul measured in it: a bf16 run's matrix products are bf16
    ones, whose rate differs from float32's by a large factor.
    """
    if device.get("type") == "cuda":  # the peak of the dtype that ran: a float32 run has no tensor-core peak
        column = "float32" if compute_dtype == "float32" else "bfloat16"
        peak = gpu_peak_flops(str(device.get("name", "")), column)
        source = (f"dense {column} data-sheet peak" if peak
                  else f"unknown device {device.get('name')!r}: no peak, no MFU")
        return {"flops_per_device": peak, "source": source}
    dtype = compute_dtype if compute_dtype in ("float32", "bfloat16", "float16") else "float32"
    machine, n = measured_cpu_matmul_flops(dtype=dtype)
    # CPU ranks split the machine's cores between them (backends/runtime/ranks.py), so each gets its share.
    return {
        "flops_per_device": machine / max(1, world_size),
        "source": f"measured: {dtype} {n}³ matmul on all cores = {machine / 1e9:.1f} GFLOP/s, split over {world_size} "
                  "rank(s)",
    }



def device_peak_again(device: dict, world_size: int, compute_dtype: str = "float32") -> dict:
    """``device_peak``, a CPU's matmul measured anew (not this process's first measurement)."""
    measured_cpu_matmul_flops.cache_clear()
    return device_peak(device, world_size, compute_dtype)


def checked_mfu(flops: dict, peak: dict, measure_again: Callable[[], dict]) -> tuple[dict, dict, Optional[str]]:
    """(flops, peak, warning): a pass's FLOPs record whose MFU is over 100%, which no device reaches, settled.

    A peak measured on a CPU (``device_peak``) is measured once per process and reads low on a busy machine (1.1
    GFLOP/s against 63-67 quiet gave an MFU of 684%): it is measured again (``measure_again``, the new peak) and the
    MFU recomputed. An MFU still over 100% (or over it against a data-sheet peak) is recorded as null, with
    ``mfu_out_of_range`` saying what it was and against what; ``warning`` is that line, None when nothing was wrong.
    """
    pct = flops.get("mfu_pct")
    if pct is None or pct <= 100.0:
        return flops, peak, None
    if str(peak.get("source", "")).startswith("measured"):
        peak = measure_again()
        again = peak.get("flops_per_device")
        pct = 100.0 * flops["model_flops_per_s_per_device"] / again if again else None
        if pct is None or pct <= 100.0:
            return {**flops, "mfu_pct": pct}, peak, None
    line = (f"MFU {pct:.0f}% is over 100% against the peak ({peak.get('source')}), so the peak is wrong (measured on a "
            "busy machine, or a device the table does not know): MFU recorded as null")
    return {**flops, "mfu_pct": None, "mfu_out_of_range": line}, peak, line


@dataclass(frozen=True)
class TrainingFlops:
    """Forward and backward FLOPs of one sequence, split by how backward treats each part (see the module docstring).

    Per-token terms (FLOPs per token): ``weights`` every weight matmul and the
    convolution; ``weights_no_input_grad`` the part of it whose input gets no
    gradient (LoRA: layer 0's mixer projections read the frozen embedding);
    ``trained_weights`` the part that gets a weight gradient; ``adapters`` the
    LoRA matmuls, ``adapters_no_input_grad`` their A matrices in layer 0.
    ``attention_pairs`` multiplies L² + L; ``delta_rule_chunk`` is the delta
    rule's cost of one chunk of ``chunk`` tokens, all linear-attention layers.
    ``head_recompute`` (hardware only, per token of a backward): the chunked
    log-prob head recomputes its logits in backward when its weight is trained.
    """

    weights: float
    weights_no_input_grad: float
    trained_weights: float
    adapters: float
    adapters_no_input_grad: float
    attention_pairs: float
    delta_rule_chunk: float
    head_recompute: float = 0.0
    chunk: int = DELTA_RULE_CHUNK
    lora_rank: int = 0
    source: str = ""

    def _parts(self, length: int) -> tuple[float, float]:
        """(per-token-linear part, activation-product part) of the forward of one sequence."""
        chunks = math.ceil(length / self.chunk) if self.delta_rule_chunk else 0
        products = self.attention_pairs * (length * length + length) + self.delta_rule_chunk * chunks
        return (self.weights + self.adapters) * length, products

    def forward(self, length: int) -> float:
        linear, products = self._parts(length)
        return linear + products

    def backward(self, length: int) -> float:
        """Input gradients (1× weights, 2× products) plus weight gradients of what is trained."""
        _, products = self._parts(length)
        inputs = self.weights - self.weights_no_input_grad + self.adapters - self.adapters_no_input_grad
        return (inputs + self.trained_weights + self.adapters) * length + 2.0 * products

    def sequence(self, pass_type: str, length: int) -> float:
        if pass_type == "forward":
            return self.forward(length)
        return self.forward(length) + self.backward(length)

    def microbatch(self, pass_type: str, batch: Optional[Sequence[int]], lengths: Sequence[int], layout: str) -> float:
        """A micro-batch as run: ``count`` rows of its longest sequence padded, its sequences packed; 0 for a dummy."""
        if not batch:
            return 0.0
        if layout == "packed":
            return sum(self.sequence(pass_type, lengths[i]) for i in batch)
        return len(batch) * self.sequence(pass_type, max(lengths[i] for i in batch))

    def backward_recompute(self, tokens: float, gradient_checkpointing: bool) -> float:
        """Hardware work of a backward beyond the model's: the head's recomputed logits, and with
        checkpointing under LoRA layer 0's input gradients (peft makes the embedding output require grad)."""
        extra = self.head_recompute * tokens
        if gradient_checkpointing:
            extra += (self.weights_no_input_grad + self.adapters_no_input_grad) * tokens
        return extra

    def as_dict(self) -> dict:
        return {
            "counted": "fwd: weight matmuls + conv + LoRA adapters + causal attention + chunked delta rule; "
            "bwd: input grads (1x weights, 2x attention/delta rule) + weight grads of trainable parameters only",
            "lora_rank": self.lora_rank,
            "per_token": {
                "weights": self.weights,
                "trained_weights": self.trained_weights,
                "adapters": self.adapters,
                "no_input_grad": self.weights_no_input_grad + self.adapters_no_input_grad,
            },
            "attention_pairs": self.attention_pairs,
            "delta_rule_chunk": self.delta_rule_chunk,
            "chunk": self.chunk,
            "source": self.source,
        }

    @classmethod
    def from_cost_model(cls, cost_model: CostModel) -> "TrainingFlops":
        """No config at hand: the planner's a·L + b·L², all of it trained weights (3× forward, full fine-tuning)."""
        return cls(cost_model.a - cost_model.b, 0.0, cost_model.a - cost_model.b, 0.0, 0.0, cost_model.b, 0.0,
                   source=f"cost model ({cost_model.source}), full fine-tuning assumed")


def delta_rule_chunk_flops(k_dim: int, v_dim: int, chunk: int = DELTA_RULE_CHUNK) -> float:
    """Forward FLOPs of one chunk of the chunked gated delta rule, one value head (segment_chunk_gated_delta_rule).

    Within the chunk: K_β·Kᵀ and Q·Kᵀ (2·C²·d_k each), the intra-chunk read
    (C×C)·ΔV (2·C²·d_v), two unit-lower-triangular solves of C×C against
    V_β and the decayed K_β (C·(C−1) per right-hand side column); across
    chunks: reading the state twice and writing it once (2·C·d_k·d_v each).
    """
    c = chunk
    return 4.0 * c * c * k_dim + 2.0 * c * c * v_dim + c * (c - 1) * (k_dim + v_dim) + 6.0 * c * k_dim * v_dim


def training_flops_from_config(
    config: Mapping[str, Any], lora_rank: int, source: str = "", chunked_logprobs: bool = True
) -> TrainingFlops:
    """The training-FLOPs model of a Hugging Face config dict with LoRA of rank ``lora_rank`` (0 = full fine-tuning).

    ``chunked_logprobs``: the harness's chunked log-prob head runs (``backend.logprob_chunk_tokens`` set).
    """
    mixers = token_mixers(config)
    matmuls = weight_matmuls(config)
    weights = sum(2.0 * m.params_per_token for m in matmuls)
    delta_chunk = 0.0
    if mixers.n_linear:
        weights += mixers.n_linear * mixers.conv_flops
        delta_chunk = mixers.n_linear * mixers.v_heads * delta_rule_chunk_flops(mixers.k_dim, mixers.v_dim)
    r = int(lora_rank)
    lora = r > 0
    adapted = [m for m in matmuls if m.lora] if lora else []
    first = [m for m in matmuls if m.reads_embeddings] if lora else []
    return TrainingFlops(
        weights=weights,
        weights_no_input_grad=sum(2.0 * m.params_per_token for m in first),
        trained_weights=0.0 if lora else weights,
        adapters=sum(2.0 * r * (m.d_in + m.d_out) * m.per_token for m in adapted),
        adapters_no_input_grad=sum(2.0 * r * m.d_in * m.per_token for m in first if m.lora),
        attention_pairs=mixers.pair_flops,
        delta_rule_chunk=delta_chunk,
        head_recompute=0.0 if lora or not chunked_logprobs else sum(
            2.0 * m.params_per_token for m in matmuls if m.kind == "lm_head"),
        lora_rank=r,
        source=source,
    )


def training_flops_for(spec, chunked_logprobs: bool = True) -> TrainingFlops:
    """The training-FLOPs model of a ``ModelSpec`` (its config via backends.model.configs, its LoRA rank)."""
    from backends.model.configs import cost_model_for, model_config

    config, source = model_config(spec)
    try:
        return training_flops_from_config(config, spec.lora_rank, source, chunked_logprobs)
    except (KeyError, TypeError, ValueError):
        return TrainingFlops.from_cost_model(cost_model_for(spec))


FlopsModel = Union[TrainingFlops, CostModel]


def _as_training(model: FlopsModel) -> TrainingFlops:
    return model if isinstance(model, TrainingFlops) else TrainingFlops.from_cost_model(model)


def pass_flops(
    pass_type: str,
    lengths: Sequence[int],
    flops_model: FlopsModel,
    plan_cost_per_rank: Sequence[float],
    gradient_checkpointing: bool,
    cost_model: Optional[CostModel] = None,
    schedules: Optional[Sequence[Sequence[Optional[Sequence[int]]]]] = None,
    layout: str = "padded",
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one pass.

    Hardware FLOPs come from the micro-batches when ``schedules`` (the plan's,
    one per rank) are given; otherwise the plan's modeled cost scaled by the
    training model: plan cost × (training FLOPs ÷ planner cost) of the real
    sequences, which is exact for packed rows and close for padded ones.
    """
    training = _as_training(flops_model)
    model = sum(training.sequence(pass_type, n) for n in lengths)
    forward_model = sum(training.forward(n) for n in lengths)
    backward = pass_type != "forward"
    if schedules is not None:
        batches = [b for schedule in schedules for b in schedule if b]
        hardware = sum(training.microbatch(pass_type, b, lengths, layout) for b in batches)
        forward_hardware = sum(training.microbatch("forward", b, lengths, layout) for b in batches)
        tokens = sum(len(b) * max(lengths[i] for i in b) if layout != "packed" else sum(lengths[i] for i in b)
                     for b in batches)
    else:
        cost_model = cost_model or (flops_model if isinstance(flops_model, CostModel) else None)
        planned = float(sum(plan_cost_per_rank))
        planned_real = sum(cost_model.sequence(n) for n in lengths) if cost_model else 0.0
        scale = planned / planned_real if planned and planned_real else 1.0
        hardware, forward_hardware = model * scale, forward_model * scale
        tokens = sum(lengths) * scale
    if backward:
        hardware += (forward_hardware if gradient_checkpointing else 0.0) + training.backward_recompute(
            tokens, gradient_checkpointing)
    return model, hardware


def flops_record(
    pass_type: str,
    lengths: Sequence[int],
    flops_model: FlopsModel,
    plan: dict,
    gradient_checkpointing: bool,
    elapsed_s: Sequence[float],
    world_size: int,
    peak: dict,
    cost_model: Optional[CostModel] = None,
    schedules: Optional[Sequence[Sequence[Optional[Sequence[int]]]]] = None,
) -> dict:
    """The FLOPs fields of a pass in results.json (``passes.<type>``); ``flops`` says what was counted."""
    if cost_model is None and plan.get("cost_model"):
        cost_model = CostModel.from_dict(plan["cost_model"])
    layout = plan.get("layout", "padded")
    model, hardware = pass_flops(
        pass_type,
        lengths,
        flops_model,
        plan.get("cost_per_rank") or [],
        gradient_checkpointing,
        cost_model=cost_model,
        schedules=schedules,
        layout=layout,
    )
    mean_s = sum(elapsed_s) / len(elapsed_s)
    per_device = model / mean_s / max(1, world_size)
    peak_flops = peak.get("flops_per_device")
    training = _as_training(flops_model)
    return {
        "model_flops": model,
        "hardware_flops": hardware,
        "model_flops_per_s_per_device": per_device,
        "hardware_flops_per_s_per_device": hardware / mean_s / max(1, world_size),
        "mfu_pct": 100.0 * per_device / peak_flops if peak_flops else None,
        "flops": {
            "model": training.as_dict()["counted"] + f" (lora_rank={training.lora_rank})",
            "hardware": ("micro-batches as run" if schedules is not None else "plan cost scaled")
            + (", padding included" if layout == "padded" else "")
            + (
                ", + one forward recomputed (gradient checkpointing)"
                if gradient_checkpointing and pass_type != "forward"
                else ""
            ),
        },
    }
