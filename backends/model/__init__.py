"""Building and running the model, the same on every backend: build, configs, checkpoint checks, loading, packing, the
log-prob head, the shared step, the kernel record.

build.py       the model from a config or a local checkpoint, LoRA, the precision policy, what was built
configs.py     the tiny model's config and the shipped configs a dry run plans with
checkpoint.py  a checkpoint checked before it is measured: config.json, weight files, missing/unexpected weights
loading.py     how the weights reach each rank, timed (LoadMeter), and rank 0's read gate
packing.py     the packed layout: sequences end to end in one row, the per-layer wrappers that keep them apart
logprobs.py    the chunked target log-prob head (no [tokens x vocab] logits)
step.py        the micro-batch loop every backend runs (forward, forward+backward), the loss weights, progress
kernels.py     which implementation of each op ran (results.json ``kernels``), and the CUDA kernel packages
"""
