"""Errors raised while reading models; `jaxgen.errors` re-exports them."""


class ModelLoadError(ValueError):
    """A model source is missing, unreadable, corrupt, or does not match its config."""
