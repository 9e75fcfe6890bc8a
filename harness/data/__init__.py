"""What a point trains on: workloads (lengths and examples), datasets tokenized from your rows, offline demo data."""
