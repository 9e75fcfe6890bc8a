"""Hydra configs, one group per concern (backend/, model/, workload/, logger/, experiment/, batching/);
python -m harness and python -m harness.serve read them from here; they travel in the installed package as its data."""
