"""The training side: the registry of backends, the messages they take, the model, the ranks, the planner.

registry.py   the backends in one table (name, controller, rank hooks, distributed, lock-step)
start.py      make_backend: the registry's controller, or rank 0 of a launched job
backend.py    the Backend base class every backend is
messages.py   what passes between harness and backend: Example, PassCommand, PassResult
specs.py      BackendSpec and ModelSpec, the configs Hydra validates
errors.py     UserError (one line, exit 2) and BackendError (a failed point)
pytorch.py, fsdp2.py, megatron_ddp.py   the three backends
planning/     micro-batch planning, pure Python (greedy, balanced, cost model, plan.json)
model/        building and running the model, the same on every backend
runtime/      devices, memory, spawned and launched ranks, liveness, failures
"""
