"""The Hydra application and its configuration: the schema and its checks, what the batching knobs mean, running the
CLI so a mistake is one line, the Hydra callbacks, who leads a launched job, and the run's exit status."""
