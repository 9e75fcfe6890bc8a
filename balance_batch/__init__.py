"""balance_batch: token-budget micro-batching for your own training loop (no torch at its core; see
docs/library.md)."""

from balance_batch.sampler import Step, TokenBudgetSampler

__all__ = ["Step", "TokenBudgetSampler"]
