"""Errors raised while reading models; `jaxgen.errors` re-exports them."""


class ModelLoadError(ValueError):
    """A model source is missing, unreadable, corrupt, or does not match its config."""


class LoRAError(ModelLoadError):
    """A LoRA adapter is unreadable, uses a feature jaxgen does not run, or does not fit the
    base model (or the slots and rank it is stacked into)."""
