"""The unit of work: one sequence with its targets and per-token loss weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Example:
    """One training sequence. All three arrays have the same length."""

    input_ids: np.ndarray  # int64 token ids
    target_tokens: np.ndarray  # int64 next-token targets
    weights: np.ndarray  # float32 per-token loss weights

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class ExampleOutput:
    """What a pass returns per example: per-token log-probabilities of the targets and the weighted loss sum."""

    logprobs: np.ndarray  # float32, one per token
    loss: float  # -sum(weights * logprobs)
