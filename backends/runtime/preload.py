"""Imported by the ranks' fork server alone (backends/runtime/forkserver.py), once, before it forks a rank."""

import atexit
import gc

from backends.runtime.collector import defer_full_collections
from backends.runtime.forkserver import leave_now, warm

# Set here, in the server's fresh interpreter, before its imports; the ranks it forks inherit it (collector.py).
defer_full_collections()
warm()
# What the imports made is kept out of every later garbage collection. A forked rank shares the fork server's memory
# until it writes a page, and a collection writes the header of every object it visits: without this each rank's
# first collections copied the whole imported heap (torch, transformers, megatron-core), page by page. One
# fsdp2 point of the smoke workload on 2 ranks took 7.0 CPU-seconds in all, 4.1 with it; megatron_ddp 7.6 and 3.3.
gc.freeze()
# The server leaves when its controller closes the pipe it watches (backends/runtime/children.py), through the
# interpreter's exit, where it has nothing to clean up; this handler, the last registered, runs first and skips the
# teardown of what the imports made. A 2-rank run's end_children took 0.15-0.2 s with it, 1.0-1.3 s without (two runs
# each, loaded 2-core machine). Only the server runs it: a rank it forks exits through os._exit (multiprocessing's
# forkserver), which runs no exit handlers.
atexit.register(leave_now)
