"""Micro-batch planning over sequence lengths, Python and numpy (no torch): greedy and balanced planners, cost model,
statistics."""

from balance_batch.balanced import balanced_schedules, fewest_padded_microbatches
from balance_batch.corpus import Packing, pack
from balance_batch.cost import (
    LAYOUTS,
    CostModel,
    active_matmul_params,
    cost_model_from_config,
    layer_types,
    microbatch_cost,
    microbatch_tokens,
)
from balance_batch.greedy import (
    MicroBatch,
    Schedule,
    align_schedules,
    deal_to_ranks,
    greedy_packed_microbatches,
    make_fixed_size_microbatches,
    make_token_balanced_microbatches,
    microbatches_for_rank,
    sort_by_length,
)
from balance_batch.plan import PLAN_JSON_VERSION, PLANNERS, Plan, plan_batch
from balance_batch.stats import (
    PlanStats,
    critical_path_lower_bound,
    lower_bound_bins,
    lower_bound_steps,
    padded_tokens,
    plan_stats,
)

__all__ = [
    "LAYOUTS",
    "PLANNERS",
    "PLAN_JSON_VERSION",
    "CostModel",
    "MicroBatch",
    "Packing",
    "Plan",
    "PlanStats",
    "Schedule",
    "active_matmul_params",
    "align_schedules",
    "balanced_schedules",
    "cost_model_from_config",
    "critical_path_lower_bound",
    "deal_to_ranks",
    "fewest_padded_microbatches",
    "greedy_packed_microbatches",
    "layer_types",
    "lower_bound_bins",
    "lower_bound_steps",
    "make_fixed_size_microbatches",
    "make_token_balanced_microbatches",
    "microbatch_cost",
    "microbatch_tokens",
    "microbatches_for_rank",
    "pack",
    "padded_tokens",
    "plan_batch",
    "plan_stats",
    "sort_by_length",
]
