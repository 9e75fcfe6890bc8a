"""The training side: planner, model, the shared step, and one module per backend.

Start at backends/registry.py (the backends, in one table) and backends/start.py (make_backend).
"""
