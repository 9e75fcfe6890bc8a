"""TRL: ``SFTTrainer`` on a ``TokenBudgetSampler``'s steps (``TokenBudgetSFTTrainer``). Importing this imports trl.

SFTTrainer prepares the dataset in its constructor (tokenizes it, builds labels, truncates to ``max_length``, may
shuffle it), so the sampler's lengths and loss tokens must be those of the prepared dataset: the trainer checks them
item by item and refuses a mismatch in one line. Its loss (a fused LM head's log-probabilities, summed and divided
by ``num_items_in_batch``, times the number of processes) takes the step's ``global_loss_tokens`` as it comes.
"""

from __future__ import annotations

from trl import SFTTrainer

from balance_batch.integrations.transformers.trainer import TokenBudgetMixin, token_counts


class TokenBudgetSFTTrainer(TokenBudgetMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` whose optimizer steps are a ``TokenBudgetSampler``'s: ``TokenBudgetSFTTrainer(model=...,
    args=SFTConfig(...), train_dataset=..., processing_class=..., sampler=TokenBudgetSampler(...))``, the rest as
    ``TokenBudgetTrainer`` (docs/library.md, "TRL")."""

    def _check_settings(self) -> None:
        super()._check_settings()
        who = type(self).__name__
        if self.args.packing:
            raise ValueError(f"{who}: packing=True would cut the dataset into fixed-length blocks the sampler's "
                             "lengths do not describe; the sampler packs micro-batches itself: set packing=False")
        lengths, loss_tokens = token_counts(self.train_dataset)
        for i, (n, k) in enumerate(zip(lengths, loss_tokens)):
            want = int(self.sampler.lengths[i]), int(self.sampler.loss_tokens[i])
            if (n, k) != want:
                raise ValueError(
                    f"{who}: item {i} of the prepared train dataset has {n} tokens, {k} of them loss tokens; the "
                    f"sampler has {want[0]} and {want[1]}: build the sampler "
                    "from token_counts(dataset) of the dataset as SFTTrainer prepares it (max_length truncates, "
                    "shuffle_dataset reorders, completion_only_loss and assistant_only_loss mask labels)")
