"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class MinferError(Exception):
    """A problem with the user's input (checkpoint, prompt, options), not a bug in minfer."""
