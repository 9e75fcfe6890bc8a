"""The live server (``python -m harness.serve``): its request parsing and routes, and the client that measures
against it."""
