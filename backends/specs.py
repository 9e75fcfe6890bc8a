"""The configs backends take, as plain dataclasses (no torch): Hydra validates harness/conf/ against them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class BackendSpec:
    """A backend config: what a backend runs. The CLI's are these defaults (harness/conf/backend/ sets only the name),
    its batching fields filled from the top-level knobs (harness/app/batching.py). Built in code with its defaults it
    runs what the CLI runs with none typed (tests/unit/test_batching.py holds every field but the name to that)."""

    # Differs from the CLI's default (fsdp2, harness/conf/config.yaml) on purpose: built in code, the default backend
    # runs in this process with no ranks to start, and the name decides which backend's rules apply (lock-step steps
    # or not).
    name: str = "pytorch"
    max_tokens_per_microbatch: Optional[int] = None
    micro_batch_size: int = 1
    # padded (count x longest) or packed (sequences end to end). The CLI's knob may be null, resolved by the harness
    # from what a backend config cannot see (a budget, mtpm=auto, whether the model packs:
    # harness.app.config.fill_batching_defaults); with no budget, as here, that is padded.
    layout: Optional[str] = "padded"
    # greedy (the original greedy planner) or balanced; the CLI's null resolves likewise: greedy with no budget
    planner: Optional[str] = "greedy"
    max_seqs_per_microbatch: Optional[int] = None  # at most this many sequences per micro-batch; None = no cap
    gradient_checkpointing: bool = False
    world_size: Optional[int] = None  # None = one per visible GPU, else 2 CPU ranks (1 for pytorch)
    device: str = "auto"  # auto, cpu or cuda
    dist_timeout_s: float = 600.0  # torch.distributed collective time-out
    # Start-up (ranks joining the group and loading the model) ending past this is stopped, naming the cause: a rank
    # that cannot start a thread under bench.memory_limit_gb waits in the group's set-up forever. None: no deadline.
    startup_timeout_s: Optional[float] = 1800.0
    memory_limit_gb: Optional[float] = None  # per worker: an OS limit on CPU, the memory fraction on GPU
    # Target log-probs this many tokens at a time (no [tokens × vocab] logits); None = unchunked.
    logprob_chunk_tokens: Optional[int] = 1024
    # On CUDA a kernel package (flash-attn, flash-linear-attention, causal-conv1d) that does not import
    # is a warning naming what it costs; true makes it an error before anything is loaded.
    require_kernels: bool = False
    hooks: Optional[str] = None  # "module:RankHooks subclass" replacing the backend's own (experiments, fault tests)
    # torch.compile each decoder layer, dynamic shapes; the warm-up pays for compiling (backends/model/compiling.py)
    compile: bool = False
    # A pass in which dynamo hits its recompile limit (a compiled layer then runs eagerly) fails the point; true:
    # records the hits (passes.<type>.compile.recompile_limit_hits) and goes on
    compile_eager_fallback: bool = False


@dataclass
class ModelSpec:
    """What the backends need to know of a model config (see harness/conf/model/)."""

    name: str = "tiny"
    path: Optional[str] = None  # a local checkpoint directory; None builds the tiny model
    lora_rank: int = 32  # 0 = full fine-tuning
    lora_alpha: Optional[int] = None  # None = same as the rank
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    init_seed: int = 0
    # None = flash_attention_2 on CUDA in half precision when flash-attn imports, else sdpa (both layouts alike)
    attn_implementation: Optional[str] = None
    vocab_size: Optional[int] = None  # tiny model only (refused with a path); None = TINY_CONFIG's
    # A checkpoint whose weights lack some of the model's (left randomly initialised) or hold others is refused;
    # true runs it and lists them in results.json's model.built.missing_weights / unexpected_weights.
    allow_missing_weights: bool = False
