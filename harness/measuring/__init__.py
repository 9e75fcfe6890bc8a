"""The measurement protocol: warm-up, timed repeats (paired with the baseline or not), their statistics, and the CPU/GPU
samplers around each repeat."""
