"""A stream's source with a position of its own, for the stream's tests (unit and torchrun)."""

from __future__ import annotations


class Shard:
    """A source with its own ``state_dict``, as ``datasets.IterableDataset``'s and torchdata's have: iterating it
    moves its position, and ``load_state_dict`` sets it."""

    def __init__(self, items):
        self.items, self.at = items, 0

    def __iter__(self):
        while self.at < len(self.items):
            self.at += 1
            yield self.items[self.at - 1]

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]
