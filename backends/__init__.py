"""The training side: the registry of backends, the messages they take, the model, the ranks (the planner they run is
the library's, balance_batch).

registry.py   the backends in one table (name, controller, rank hooks, distributed, lock-step)
start.py      make_backend: the registry's controller, or rank 0 of a launched job
backend.py    the Backend base class every backend is
messages.py   what passes between harness and backend: Example, PassCommand, PassResult
specs.py      BackendSpec and ModelSpec, the configs Hydra validates
errors.py     BackendError (a failed point), beside the library's UserError (one line, exit 2)
pytorch.py, fsdp2.py, megatron_ddp.py   the three backends
model/        building and running the model, the same on every backend
runtime/      devices, memory, spawned and launched ranks, liveness, failures
"""
