"""Errors the harness reports as one line, without a traceback."""


class UserError(Exception):
    """A mistake in what the user asked for: a config value, a path, a request.

    The message names the key (or path) and says what would be valid.
    """


class BackendError(RuntimeError):
    """A pass failed inside a backend (a worker raised or died); the message names the rank."""
