"""Real processes: the CLI, servers, torchrun and spawned ranks, long model runs (make test runs them with the unit
tier)."""
