"""The one error class the library shares with the harness: a mistake in what the user asked for."""


class UserError(Exception):
    """A mistake in what the user asked for: a config value, a path, a request.

    The message names the key (or path) and says what would be valid; the harness reports it as one line (exit 2).
    """
