"""One point's life: set it up, share a measurement another point made, measure it, map its failures, write results.json
and the W&B run."""
