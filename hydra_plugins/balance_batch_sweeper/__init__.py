"""Hydra plugin package (Hydra finds plugins only under ``hydra_plugins``): the harness's sweeper."""
