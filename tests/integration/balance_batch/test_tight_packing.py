"""verl's test shape, where best-fit decreasing leaves a micro-batch over: 300 seeded steps of 20 or 25 lengths in
[50, 90] at a budget of 300, every plan and every packing at the optimum."""

from __future__ import annotations

import math
import random

from balance_batch import pack, plan_step


def verl_shaped(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 90) for _ in range(rng.choice((20, 25)))]


def test_verl_shaped_steps_take_the_fewest_microbatches():
    # no length is over half the budget, so the bound is the tokens' ceil(sum / 300); every case reaches it, which
    # proves it optimal (before the exact search, best-fit decreasing left one over in 83 plans and 127 packings)
    for seed in range(300):
        lengths = verl_shaped(seed)
        bound = math.ceil(sum(lengths) / 300)
        plan = plan_step(lengths, world_size=1, max_tokens_per_microbatch=300, layout="packed")
        bins = [b for schedule in plan.microbatches for b in schedule if b]
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 300 for b in bins)
        assert len(bins) == bound, (seed, lengths)
        rows = pack(lengths, 300)
        assert rows.rows == bound and rows.row_tokens().max() <= 300, (seed, lengths)
