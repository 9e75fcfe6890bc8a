"""In-process tests: planner, packing, FLOPs, configs, reports, kernels (make test-fast; under a minute on 2 cores)."""
