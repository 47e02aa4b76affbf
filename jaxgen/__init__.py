"""jaxgen: LLM inference in JAX/XLA.

    from jaxgen import LLM, LoRARequest, SamplingParams, StructuredOutputs

Subpackages, top floor first; each imports only floors below it: ``cli`` (the commands),
``bench``, ``entrypoints`` (LLM, the OpenAI server, batch jobs, perplexity), ``engine``
(scheduler, runner, sampling, speculative decoding), ``sharding``, ``model``, ``quant``,
``cache``, ``pallas_kernels``.

The names below are imported on first use, so that ``import jaxgen.cache.block_manager`` (host
only) does not import the engine, JAX or Flax.
"""

from jaxgen._lazy import lazy_exports
from jaxgen._logging import configure as _configure_logging

_configure_logging()  # INFO lines on stderr (JAXGEN_CONFIGURE_LOGGING=0 leaves logging alone)

_LAZY = {
    "LLM": "jaxgen.entrypoints.llm",
    "JaxgenConfig": "jaxgen.engine.config",
    "SamplingParams": "jaxgen.engine.params",
    "StructuredOutputs": "jaxgen.engine.params",
    "LoRARequest": "jaxgen.engine.lora",
    "CompletionOutput": "jaxgen.engine.outputs",
    "Logprob": "jaxgen.engine.outputs",
    "RequestMetrics": "jaxgen.engine.outputs",
    "RequestOutput": "jaxgen.engine.outputs",
}

__getattr__, __all__ = lazy_exports(__name__, _LAZY)
