"""Python's cyclic garbage collector in the harness's processes: full collections left to the harness's own calls.

A harness process (the controller, a rank, the ranks' fork server) imports torch, transformers and megatron-core:
hundreds of thousands of objects that live as long as the process. CPython collects its oldest generation whenever the
objects that survived into it have grown by a quarter since its last full collection, and a full collection visits
every object the collector tracks, so while those imports run it visits the whole heap again and again, and later
a full collection that falls inside a timed pass is measured as the pass's. What each function here saves is
measured in docs/development.md ("Garbage collection").

So full collections come from the harness itself: a pass type's first run in a point starts with one
(``memory.release_cached_memory``), before its peak memory is reset, and so does closing the pytorch backend. The
young generations are collected as CPython's defaults say, so short-lived cycles are freed as before.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn

# Middle-generation collections between two automatic full ones (CPython's default: 10). At the default young
# threshold (700 allocations) that is one per 7 million container allocations at most, and it is still skipped
# while the survivors have grown by less than a quarter.
FULL_AFTER_MIDDLE = 1000


def defer_full_collections() -> None:
    """Leave full collections to the harness's explicit ones (the module docstring says why); the young and middle
    generations keep their thresholds. Idempotent; called first by each entry point that imports the heavy modules."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_AFTER_MIDDLE)


def freeze_before_the_model() -> None:
    """Leave every object alive now out of every later collection: called by ``build_model`` once the libraries are
    imported and before the model is built, so that a pass's full collection visits the model and what came after
    it, not the imported heap again.

    What it freezes is never freed by the collector (an object freed by its reference count is freed as ever): a
    model built after it, and a closed backend's (collected at its close, before the next is built), are collected
    as before; a cycle alive now and dropped later (a sweep point's config) stays until the process ends."""
    gc.freeze()


def exit_with(code: int) -> NoReturn:
    """``sys.exit(code)`` for an entry point whose work is done, with the heap frozen first: the interpreter's
    teardown collects garbage over every object it tracks: hundreds of thousands in a harness process (and a process
    forked from a warm one writes every page the collector visits). Threads are
    joined and every ``atexit`` handler runs as before; what reference counts free is freed, and the cycles still
    alive then go with the process, whose finalizers Python never promised to run at exit."""
    gc.freeze()
    sys.exit(code)

