"""The tests: tests/unit in-process (make test-fast), tests/integration real processes; helpers both tiers share live
here."""
