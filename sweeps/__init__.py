"""W&B sweep definitions (YAML) that drive python -m harness; see sweeps/README.md."""
