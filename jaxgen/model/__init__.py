"""Flax decoder models, configs and weight loading.

Axis glossary (used in einsums and in names such as ``q_btnh``):
  B batch, T query tokens, S kv tokens, N query heads, K kv heads, G group (N / K),
  H head dim, D model width, F mlp width, V vocab, L layers, P pages.

The names below are imported on first use: `jaxgen.model.errors` (which the host-side
scheduler's errors build on) must not pull in JAX and Flax.
"""

from jaxgen._lazy import lazy_exports

_LAZY = {
    "ModelConfig": "jaxgen.model.config",
    "RopeScaling": "jaxgen.model.config",
    "ModelLoadError": "jaxgen.model.errors",
    "Transformer": "jaxgen.model.llama",
    "forward": "jaxgen.model.llama",
    "init_params": "jaxgen.model.llama",
    "convert": "jaxgen.model.loading",
    "load_model": "jaxgen.model.loading",
    "load_tokenizer": "jaxgen.model.loading",
    "save_checkpoint": "jaxgen.model.loading",
    "Tokenizer": "jaxgen.model.tokenizer",
}

__getattr__, __all__ = lazy_exports(__name__, _LAZY)
