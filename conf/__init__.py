"""Hydra configs, one group per concern (backend/, model/, workload/, logger/, experiment/, batching/); the harness
reads them from ../conf."""
