"""Micro-batch planning over sequence lengths: pure Python, no torch (the names backends use; built in backends/planning/).

The planner decides which examples go to which rank and which micro-batch, and
what that costs in padded tokens and modeled compute. Backends execute its
schedules; the harness reports its statistics; a dry run prints them without
building a model.
"""

from backends.planning import *  # noqa: F401,F403
from backends.planning import __all__ as _planning_names
from backends.planning.greedy import _greedy_token_budget  # noqa: F401  (the seed's name, kept importable)

__all__ = list(_planning_names)
