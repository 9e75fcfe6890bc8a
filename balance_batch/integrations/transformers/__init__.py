"""Hugging Face transformers: the Trainer on the sampler's steps (``TokenBudgetTrainer``) and the model preparation
packed rows need (``prepare_model_for_packing``). Importing this imports transformers and torch."""

from balance_batch.integrations.transformers.packing import (  # noqa: F401
    check_packable,
    is_prepared_for_packing,
    prepare_model_for_packing,
)
from balance_batch.integrations.transformers.trainer import STATE_FILE, TokenBudgetTrainer, token_counts  # noqa: F401
