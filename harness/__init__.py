"""The benchmark application: ``python -m harness`` (a Hydra app, one point per job) and ``python -m harness.serve``."""

import os as _os

# Idle OpenMP threads sleep at once instead of spinning for a while (OpenMP reads this when torch loads, so it is set
# before anything here imports torch; the fork server, and so every spawned rank, inherits it). On a busy 2-core
# machine a spinning thread holds a core its partner is waiting for: the in-process PyTorch backend's fwd+bwd took
# a median 62.7 s with spinning and 4.5 s without at load average 14, 23.9 s and 1.9 s at 11.7
# (scripts/bench_threads.py). A user's own setting stays.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
