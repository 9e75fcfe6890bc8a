"""Imported by the ranks' fork server after ``backends.runtime.preload`` when its ranks may be megatron_ddp's (the
registry's ``rank_preload``): megatron-core."""

import gc

from backends.runtime.forkserver import import_each

import_each(("megatron.core.distributed", "megatron.core.transformer"))
gc.freeze()  # as preload.py's: what these imports made is kept out of every later collection
