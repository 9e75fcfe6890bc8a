"""Hydra configs, one group per concern (backend/, model/, workload/, logger/, experiment/); harness reads them from ../conf."""
