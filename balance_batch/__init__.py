"""balance_batch: token-budget micro-batch planning over sequence lengths, in Python and numpy (no torch).

``plan_step(lengths, world_size=..., max_tokens_per_microbatch=...)`` plans one step of a batch in memory: each
rank's micro-batches, their modeled cost and the step's token totals. Underneath: the balanced and the greedy planner,
the peers' planners (``balance_batch.peers``), the cost model and plan statistics. The harness and its backends plan
through ``plan_step`` too, so what they measure is what the library plans.

``TokenBudgetSampler`` samples a dataset in optimizer steps sized in sequences or tokens, each planned over the ranks
(docs/library.md); ``balance_batch.collate`` (the one module that imports torch) packs a micro-batch into one row.
``pack(lengths, capacity)`` packs a whole corpus offline into rows, as arrays (``python -m balance_batch.pack`` on
disk).
"""

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
from balance_batch.plan import PLAN_JSON_VERSION, PLANNERS, Plan, plan_batch, plan_step
from balance_batch.sampler import Step, TokenBudgetSampler
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
    "Step",
    "TokenBudgetSampler",
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
    "plan_step",
    "plan_stats",
    "sort_by_length",
]
