"""The time of one ``balance_batch.pack`` call, three times, on the two corpora of issue 58's targets: 16.3 million
pre-training-like lengths at 512 and a million QA-like ones at 384 (a script, not a test).

    PYTHONPATH=. python scripts/time_pack.py
"""

import time, numpy as np
from scripts.bench_planner import short_lengths, qa_lengths
from balance_batch import pack
for name, make, n, cap in (("short", short_lengths, 16_300_000, 512), ("qa", qa_lengths, 1_000_000, 384)):
    lengths = np.asarray(make(n))
    runs = []
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        rows = pack(lengths, cap)
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    print(f"{name} {n:,} at {cap}: {rows.rows:,} rows, {rows.bound_ratio:.6f} of the bound; "
          f"wall s {', '.join(f'{w:.3f}' for w, _ in runs)}; CPU s {', '.join(f'{c:.3f}' for _, c in runs)}")
