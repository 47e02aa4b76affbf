"""Errors raised while reading models; `engine.errors` re-exports them."""


class ModelLoadError(ValueError):
    """A model source is missing, unreadable, corrupt, or does not match its config."""
