"""Small runnable clients of balance_batch (docs/library.md runs each): ``python -m examples.<name>``."""
