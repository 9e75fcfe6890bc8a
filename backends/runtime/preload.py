"""Imported by the ranks' fork server alone (backends/runtime/forkserver.py), once, before it forks a rank."""

from backends.runtime.forkserver import warm

warm()
