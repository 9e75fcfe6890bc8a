"""Imported by the ranks' fork server alone (backends/runtime/forkserver.py), once, before it forks a rank."""

import gc

from backends.runtime.forkserver import warm

warm()
# What the imports made is kept out of every later garbage collection. A forked rank shares the fork server's memory
# until it writes a page, and a collection writes the header of every object it visits: without this each rank's
# first collections copied the whole imported heap (torch, transformers, megatron-core), page by page. One
# fsdp2 point of the smoke workload on 2 ranks took 7.0 CPU-seconds in all, 4.1 with it; megatron_ddp 7.6 and 3.3.
gc.freeze()
