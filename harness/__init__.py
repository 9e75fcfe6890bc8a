"""The benchmark application: ``python -m harness`` (a Hydra app, one point per job) and ``python -m harness.serve``."""
