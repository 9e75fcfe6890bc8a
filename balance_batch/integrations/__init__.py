"""Framework glue, one module per framework; each imports its framework only when it is imported itself."""
