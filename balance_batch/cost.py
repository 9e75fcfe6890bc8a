"""Modeled forward cost of sequences and micro-batches, a·L + b·L² per sequence, derived from a model's config.

The planner balances this cost, not token counts: attention makes a long
sequence cost more per token than a short one. Units are forward FLOPs
(multiply-adds count 2), so the same numbers give FLOPs for MFU.

- ``a`` (FLOPs per token): every weight a token is multiplied by — attention
  or linear-attention projections, the router, the top-k routed experts plus
  the shared expert (or the dense MLP), and the LM head (the harness computes
  log-probs of every position). The embedding lookup is a gather, not a
  matmul, so it is left out. Linear-attention layers (gated delta rule) add a
  per-token state update of about 6·heads·d_k·d_v FLOPs and a short
  depthwise convolution: linear in L, so they land in ``a`` too.
- ``b`` (FLOPs per token pair): full-attention layers only. Causal scores and
  the weighted sum over L(L+1)/2 query-key pairs cost 2·heads·head_dim·(L²+L)
  per layer; the L² part is ``b``, the L part goes to ``a``.

A cost model calibrated on the hardware (``cost_model=calibrated``,
harness/calibration.py) is in seconds of forward + backward instead, and adds
what FLOPs leave out: ``c``, a cost per sequence (per-sequence attention and
delta-rule work, a padded row's own overhead), and ``fixed``, a cost per
micro-batch (launches, FSDP2's per-layer all-gathers). Both are 0 for FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

LAYOUTS = ("padded", "packed")


_MODEL_KEYS = ("a", "b", "source", "c", "fixed")  # a CostModel's own keys in its dict; any other is its fit's


@dataclass(frozen=True)
class CostModel:
    """Cost of one sequence of length L: ``a * L + b * L**2 + c``, and of a micro-batch ``fixed`` more.

    ``source`` says where the numbers came from; ``fit`` (a calibrated model's) how they were fitted: coefficients,
    R², residuals, the shapes measured (harness/calibration.py). FLOP models have ``c = fixed = 0`` and no fit.
    """

    a: float
    b: float
    source: str = "tokens"
    c: float = 0.0
    fixed: float = 0.0
    fit: Optional[dict] = field(default=None, compare=False, hash=False)

    def sequence(self, length: int) -> float:
        return self.a * length + self.b * length * length + self.c

    def as_dict(self) -> dict:
        """{a, b, source}; a calibrated model adds c, fixed and its fit's keys (coefficients, r2, residuals, ...)
        beside them (a FLOP model's dict is as it always was)."""
        out: dict = {"a": self.a, "b": self.b, "source": self.source}
        if self.c or self.fixed or self.fit is not None:
            out.update(c=self.c, fixed=self.fixed)
        if self.fit is not None:
            out.update({k: v for k, v in self.fit.items() if k not in _MODEL_KEYS})
        return out

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "CostModel":
        if data is None:
            return cls.tokens()
        fit = {k: v for k, v in data.items() if k not in _MODEL_KEYS} or None
        return cls(float(data["a"]), float(data["b"]), str(data.get("source", "")), float(data.get("c") or 0.0),
                   float(data.get("fixed") or 0.0), fit)

    @classmethod
    def tokens(cls) -> "CostModel":
        """No model at hand: the cost of a micro-batch is the tokens it computes."""
        return cls(1.0, 0.0, "tokens (no model config: cost = computed tokens)")


def microbatch_tokens(batch: Optional[Sequence[int]], lengths: Sequence[int], layout: str = "padded") -> int:
    """Tokens a micro-batch computes: ``count * longest`` padded, the sum of lengths packed (0 for a dummy)."""
    if not batch:
        return 0
    if layout == "packed":
        return sum(lengths[i] for i in batch)
    return len(batch) * max(lengths[i] for i in batch)


def microbatch_cost(
    batch: Optional[Sequence[int]], lengths: Sequence[int], layout: str, cost_model: CostModel
) -> float:
    """Modeled cost: ``count * cost(longest)`` padded, the sum of per-sequence costs packed, plus the model's
    ``fixed`` cost of a micro-batch; 0 for a dummy."""
    if not batch:
        return 0.0
    if layout == "packed":
        return sum(cost_model.sequence(lengths[i]) for i in batch) + cost_model.fixed
    return len(batch) * cost_model.sequence(max(lengths[i] for i in batch)) + cost_model.fixed


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a (possibly multimodal) Hugging Face config.json."""
    return config.get("text_config") or config


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's token mixer: ``layer_types`` when given, else every ``full_attention_interval``-th layer full.

    Models without linear-attention keys are all full attention.
    """
    c = _text_config(config)
    n = int(c["num_hidden_layers"])
    if c.get("layer_types"):
        return list(c["layer_types"])
    if "linear_num_value_heads" not in c:
        return ["full_attention"] * n
    # Qwen3.5 / Qwen3-Next: layer i is full attention when (i + 1) % interval == 0 (3 linear : 1 full by default).
    interval = int(c.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _gated_attention(c: Mapping[str, Any]) -> bool:
    # Qwen3.5 and Qwen3-Next gate the attention output: q_proj emits queries and the gate (2 x heads x head_dim).
    if "attn_output_gate" in c:
        return bool(c["attn_output_gate"])
    return str(c.get("model_type", "")).startswith(("qwen3_5", "qwen3_next"))


def active_matmul_params(config: Mapping[str, Any]) -> int:
    """Weights one token is multiplied by in a forward pass (multiply-adds per token, attention scores excluded).

    The sum over ``weight_matmuls``: one list of the model's matmuls serves the
    planner's cost and the training-FLOPs model.
    """
    return sum(m.params_per_token for m in weight_matmuls(config))


@dataclass(frozen=True)
class TokenMixers:
    """The token mixers of a config, as the FLOPs formulas need them (the planner's cost and the training FLOPs)."""

    n_full: int  # full-attention layers
    n_linear: int  # gated delta-net (linear-attention) layers
    pair_flops: float  # causal QK^T and AV: FLOPs per (L² + L), all full-attention layers
    conv_flops: float  # the short depthwise convolution: FLOPs per token, one linear-attention layer
    k_dim: int = 0  # the delta rule's key and value head sizes and its value heads
    v_dim: int = 0
    v_heads: int = 0


def token_mixers(config: Mapping[str, Any]) -> TokenMixers:
    c = _text_config(config)
    h = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or h // heads)
    kinds = layer_types(c)
    n_full = sum(1 for k in kinds if k == "full_attention")
    n_linear = len(kinds) - n_full
    pair_flops = 2.0 * heads * head_dim * n_full
    if not n_linear:
        return TokenMixers(n_full, 0, pair_flops, 0.0)
    dk, dv = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
    v_heads = int(c["linear_num_value_heads"])
    conv_dim = 2 * dk * int(c["linear_num_key_heads"]) + dv * v_heads
    conv_flops = 2.0 * conv_dim * int(c.get("linear_conv_kernel_dim", 4))
    return TokenMixers(n_full, n_linear, pair_flops, conv_flops, dk, dv, v_heads)


def cost_model_from_config(config: Mapping[str, Any], source: str) -> CostModel:
    """a and b (forward FLOPs) from a Hugging Face config dict; see the module docstring for what counts."""
    m = token_mixers(config)
    a = 2.0 * active_matmul_params(config)
    a += m.pair_flops  # the L part of the causal pairs
    if m.n_linear:
        a += m.n_linear * (6.0 * m.v_heads * m.k_dim * m.v_dim + m.conv_flops)
    return CostModel(a=a, b=m.pair_flops, source=source)


@dataclass(frozen=True)
class WeightMatmul:
    """One weight a token is multiplied by: ``d_in -> d_out``, ``per_token`` times per token (top-k for routed experts).

    ``kind`` says what the weight is, which decides whether peft's
    ``target_modules="all-linear"`` gives it a LoRA adapter: ``"linear"`` (an
    ``nn.Linear``: adapted), ``"router"`` (a bare Parameter), ``"experts"``
    (fused 3-D expert Parameters), ``"lm_head"`` (the output layer, which peft
    leaves out). ``reads_embeddings``: its input is the embedding output itself
    (layer 0's token mixer), so with a frozen embedding no gradient flows into it.
    """

    name: str
    d_in: int
    d_out: int
    per_token: int = 1
    kind: str = "linear"
    reads_embeddings: bool = False

    @property
    def lora(self) -> bool:
        return self.kind == "linear"

    @property
    def params_per_token(self) -> int:
        return self.d_in * self.d_out * self.per_token


def weight_matmuls(config: Mapping[str, Any]) -> list[WeightMatmul]:
    """Every weight matmul of a forward, layer by layer: a token passes each of them ``per_token`` times."""
    c = _text_config(config)
    h = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or h // heads)
    q_out = heads * head_dim * (2 if _gated_attention(c) else 1)
    mlp_only = set(c.get("mlp_only_layers") or [])
    experts = int(c.get("num_experts") or 0)
    out: list[WeightMatmul] = []
    for i, kind in enumerate(layer_types(c)):
        first = i == 0
        p = f"layers.{i}."
        if kind == "full_attention":
            out += [
                WeightMatmul(p + "self_attn.q_proj", h, q_out, reads_embeddings=first),
                WeightMatmul(p + "self_attn.k_proj", h, kv_heads * head_dim, reads_embeddings=first),
                WeightMatmul(p + "self_attn.v_proj", h, kv_heads * head_dim, reads_embeddings=first),
                WeightMatmul(p + "self_attn.o_proj", heads * head_dim, h),
            ]
        else:
            key_dim = int(c["linear_key_head_dim"]) * int(c["linear_num_key_heads"])
            v_heads = int(c["linear_num_value_heads"])
            value_dim = int(c["linear_value_head_dim"]) * v_heads
            out += [
                WeightMatmul(p + "linear_attn.in_proj_qkv", h, 2 * key_dim + value_dim, reads_embeddings=first),
                WeightMatmul(p + "linear_attn.in_proj_z", h, value_dim, reads_embeddings=first),
                WeightMatmul(p + "linear_attn.in_proj_b", h, v_heads, reads_embeddings=first),
                WeightMatmul(p + "linear_attn.in_proj_a", h, v_heads, reads_embeddings=first),
                WeightMatmul(p + "linear_attn.out_proj", value_dim, h),
            ]
        if experts and i not in mlp_only:
            moe = int(c["moe_intermediate_size"])
            top_k = int(c["num_experts_per_tok"])
            out += [
                WeightMatmul(p + "mlp.gate", h, experts, kind="router"),
                WeightMatmul(p + "mlp.experts.gate_up_proj", h, 2 * moe, per_token=top_k, kind="experts"),
                WeightMatmul(p + "mlp.experts.down_proj", moe, h, per_token=top_k, kind="experts"),
            ]
            shared = int(c.get("shared_expert_intermediate_size") or 0)
            if shared:
                out += [
                    WeightMatmul(p + "mlp.shared_expert.gate_proj", h, shared),
                    WeightMatmul(p + "mlp.shared_expert.up_proj", h, shared),
                    WeightMatmul(p + "mlp.shared_expert.down_proj", shared, h),
                    WeightMatmul(p + "mlp.shared_expert_gate", h, 1),
                ]
        else:
            inter = int(c["intermediate_size"])
            out += [
                WeightMatmul(p + "mlp.gate_proj", h, inter),
                WeightMatmul(p + "mlp.up_proj", h, inter),
                WeightMatmul(p + "mlp.down_proj", inter, h),
            ]
    out.append(WeightMatmul("lm_head", h, int(c["vocab_size"]), kind="lm_head"))
    return out
