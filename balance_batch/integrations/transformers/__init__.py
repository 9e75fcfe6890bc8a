"""Hugging Face transformers: the Trainer on the sampler's steps (``TokenBudgetTrainer``) and the model preparation
packed rows need (``prepare_model_for_packing``). Importing this imports transformers and torch; the Trainer's names
load on first use, so the harness's ranks, which use the model preparation alone, never import the Trainer."""

from balance_batch.integrations.transformers.packing import (  # noqa: F401
    check_packable,
    is_prepared_for_packing,
    prepare_model_for_packing,
)

_TRAINER_NAMES = ("STATE_FILE", "TokenBudgetMixin", "TokenBudgetTrainer", "token_counts")


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        from balance_batch.integrations.transformers import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
