"""Typed errors for bad input. All subclass ValueError; each message says what to change."""

from jaxgen.model.errors import LoRAError, ModelLoadError


class JaxgenError(ValueError):
    """Base class of jaxgen's user-facing input errors."""


class InvalidSamplingParams(JaxgenError):
    """A SamplingParams field is out of range."""


class InvalidPrompt(JaxgenError):
    """A prompt is empty, holds out-of-vocabulary ids, or is too long for the model."""


class CapacityError(JaxgenError):
    """A request can never fit the engine's KV cache or context length."""


class LoRANotLoaded(JaxgenError):
    """A request names a LoRA adapter that is not loaded (or the engine runs without LoRA)."""


class WeightsMismatch(JaxgenError):
    """Weights given to `LLM.update_weights` do not have the model's layout (leaves, shapes)."""


class EnginePaused(JaxgenError):
    """A request reached an engine paused with `pause(mode="abort")` (or a synchronous call
    reached a paused or sleeping engine, where it would wait forever)."""


class EngineSleeping(JaxgenError):
    """The engine sleeps (`LLM.sleep`): its KV pool, and at level 2 its weights, are freed."""


__all__ = [
    "CapacityError",
    "EnginePaused",
    "EngineSleeping",
    "InvalidPrompt",
    "InvalidSamplingParams",
    "JaxgenError",
    "LoRAError",
    "LoRANotLoaded",
    "ModelLoadError",
    "WeightsMismatch",
]
