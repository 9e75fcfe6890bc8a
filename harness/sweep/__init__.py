"""A sweep: its points and their folders (resume, baselines), and hot sweeps (one backend for a whole multirun)."""
