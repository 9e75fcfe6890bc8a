"""TRL: ``SFTTrainer`` on a ``TokenBudgetSampler``'s steps (``TokenBudgetSFTTrainer``). Importing this imports trl.

SFTTrainer prepares the dataset in its constructor (tokenizes it, builds labels, truncates to ``max_length``, may
shuffle it), so the sampler's lengths and loss tokens must be those of the prepared dataset: give ``sampler`` as a
function of the dataset, which the trainer calls with the dataset as SFTTrainer prepared it, or a sampler built
from a tokenized dataset SFTTrainer keeps as it is. The trainer checks the sampler item by item and refuses a
mismatch in one line. Its loss (a fused LM head's log-probabilities, summed and divided by ``num_items_in_batch``,
times the number of processes) takes the step's ``global_loss_tokens`` as it comes.
"""

from __future__ import annotations

from trl import SFTTrainer

from balance_batch.integrations.transformers.trainer import TokenBudgetMixin


class TokenBudgetSFTTrainer(TokenBudgetMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` whose optimizer steps are a ``TokenBudgetSampler``'s; the rest as ``TokenBudgetTrainer``.

    SFTTrainer prepares the dataset in its constructor (tokenizes, builds labels, truncates), so give ``sampler`` as
    a function: it is called with the dataset as SFTTrainer prepared it. See docs/library.md, "TRL".

    Args:
        *args: ``SFTTrainer``'s (``model``, ``args=SFTConfig(...)``, ``train_dataset``, ``processing_class``, ...);
            **kwargs takes the rest of them.
        sampler: a function of the prepared train dataset that returns the ``TokenBudgetSampler`` (or a sampler
            that describes the prepared dataset item by item).
        collate_fn: as ``TokenBudgetTrainer``'s (default ``pack_collate``).

    Raises:
        ValueError: ``packing=True`` (the sampler packs the micro-batches), and what ``TokenBudgetTrainer``
            refuses.

    Example:
        >>> from balance_batch import TokenBudgetSampler
        >>> from balance_batch.integrations.transformers import token_counts
        >>> def make_sampler(prepared):  # the dataset as SFTTrainer prepared it
        ...     lengths, loss_tokens = token_counts(prepared)
        ...     return TokenBudgetSampler(lengths, loss_tokens_per_sequence=loss_tokens,
        ...                               max_tokens_per_microbatch=1024, tokens_per_step=4096)
        >>> trainer = TokenBudgetSFTTrainer(model=model, args=sft_config, train_dataset=dataset,  # doctest: +SKIP
        ...                                 processing_class=tokenizer, sampler=make_sampler)
    """

    _dataset_name = "the prepared train dataset"
    _sampler_advice = ("pass sampler=lambda dataset: TokenBudgetSampler(lengths, loss_tokens_per_sequence=loss_tokens, "
                      "...) with lengths, loss_tokens = token_counts(dataset): the trainer calls it with the dataset "
                      "as SFTTrainer prepared it (max_length truncates, shuffle_dataset reorders, completion_only_loss "
                      "and assistant_only_loss mask labels)")

    def _check_settings(self) -> None:
        if self.args.packing:
            raise ValueError(f"{type(self).__name__}: packing=True would cut the dataset into fixed-length blocks the "
                             "sampler's lengths do not describe; the sampler packs micro-batches itself: set "
                             "packing=False")
        super()._check_settings()
