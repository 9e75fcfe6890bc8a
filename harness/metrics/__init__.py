"""Figures read from the passes: the spread of repeats, balance against the plan, training FLOPs and MFU, and the
calibrated cost model."""
