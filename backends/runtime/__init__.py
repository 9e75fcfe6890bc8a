"""Running ranks: devices, memory, the live control file, spawned and launched ranks, liveness and failures.

ranks.py     what every rank runs: RankHooks, start-up, one pass of the global plan
spawned.py   ranks the harness spawns (DistributedBackend and each spawned rank's loop)
job.py       a job torchrun or Slurm started: its environment, store, heartbeats, command channel, watchdog
launched.py  that job's rank 0 backend (LaunchedBackend) and every other rank's loop (follow)
liveness.py  heartbeat counters and dying with the parent, written once
failures.py  a rank's failure report and ``blame``: which failure the user sees
devices.py   which device a name means, what results.json says of it, usable CPU cores
memory.py    memory limits, peaks and out-of-memory messages
collector.py full garbage collections left to the harness's own (the heavy imports' heap, collected once per pass)
forkserver.py the ranks' fork server and what it imports (preload.py, and a backend's own: preload_megatron.py)
control.py   the shared-memory control file a live server's admin endpoint writes
atomic.py    writes that never leave half a file
"""
