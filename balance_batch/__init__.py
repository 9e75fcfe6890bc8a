"""balance_batch: token-budget micro-batch planning over sequence lengths, in Python and numpy (no torch).

What a user calls, from here:

- ``plan_step(lengths, world_size=..., max_tokens_per_microbatch=...)`` plans one step of a batch in memory (the
  rollouts of an RL step): each rank's micro-batches, their modeled cost and the step's token totals (a ``Plan``).
- ``TokenBudgetSampler`` samples a dataset in optimizer steps sized in sequences or tokens, each planned over the
  ranks (a ``Step``: this rank's micro-batches and the step's loss denominator); docs/library.md.
- ``TokenBudgetStream`` does the same for a stream of items whose lengths are not known up front, each step planned
  over every rank's items together (``balance_batch.stream``).
- ``pack(lengths, capacity)`` packs a whole corpus offline into rows (a ``Packing``, as arrays;
  ``python -m balance_batch.pack`` on disk).
- ``CostModel`` is what the planners balance; ``PLANNERS`` (the library's two, ``"greedy"`` and ``"balanced"``) and
  ``LAYOUTS`` the choices they take.

The rest stays in submodules: the registry of planners by name and the settings a plan is made under
(``balance_batch.planners``), the planners themselves (``balance_batch.balanced``, ``balance_batch.greedy``), the
sampler's parts (``balance_batch.step_cutter``, ``balance_batch.step_plans``), plan statistics and bounds
(``balance_batch.stats``), the cost model's helpers (``balance_batch.cost``). Torch-facing: ``balance_batch.collate``
(a micro-batch as one packed row) and ``balance_batch.integrations`` (transformers, TRL).
"""

from balance_batch.corpus import Packing, pack
from balance_batch.cost import LAYOUTS, CostModel
from balance_batch.plan import PLANNERS, Plan, plan_step
from balance_batch.sampler import Step, TokenBudgetSampler
from balance_batch.stream import TokenBudgetStream

__all__ = ["LAYOUTS", "PLANNERS", "CostModel", "Packing", "Plan", "Step", "TokenBudgetSampler", "TokenBudgetStream",
           "pack", "plan_step"]
