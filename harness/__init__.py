"""The benchmark application: ``python -m harness`` (a Hydra app, one point per job) and ``python -m harness.serve``."""

import os as _os

# Idle OpenMP threads sleep at once instead of spinning for a while (OpenMP reads this when torch loads, so it is set
# before anything here imports torch; the fork server, and so every spawned rank, inherits it). On a busy 2-core
# machine a spinning thread holds a core its partner is waiting for, and it costs nothing on a quiet one: measured in
# docs/measurements/2026-12-04-cpu-threads.md (scripts/bench_threads.py). A user's own setting stays.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
