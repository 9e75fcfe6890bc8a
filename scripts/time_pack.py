"""The time of one ``balance_batch.pack`` call, three times, on two corpora: 16.3 million pre-training-like
lengths at 512 (the size of the Wikipedia histogram) and a million QA-like ones at 384 (a script, not a test).

    PYTHONPATH=. python scripts/time_pack.py
"""

import time

import numpy as np

from balance_batch import pack
from scripts.bench_planner import qa_lengths, short_lengths

for name, make, n, cap in (("short", short_lengths, 16_300_000, 512), ("qa", qa_lengths, 1_000_000, 384)):
    lengths = np.asarray(make(n))
    runs = []
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        rows = pack(lengths, cap)
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    print(f"{name} {n:,} at {cap}: {rows.rows:,} rows, {rows.bound_ratio:.6f} of the bound; "
          f"wall s {', '.join(f'{w:.3f}' for w, _ in runs)}; CPU s {', '.join(f'{c:.3f}' for _, c in runs)}")
