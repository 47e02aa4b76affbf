"""Flax decoder models, configs and weight loading.

Axis glossary (used in einsums and in names such as ``q_btnh``):
  B batch, T query tokens, S kv tokens, N query heads, K kv heads, G group (N / K),
  H head dim, D model width, F mlp width, V vocab, L layers, P pages; in LoRA: A adapters,
  R LoRA rank, I and O a linear's input and output widths.

The names below are imported on first use: `jaxgen.model.errors` (which the host-side
scheduler's errors build on) must not pull in JAX and Flax.
"""

from jaxgen._lazy import lazy_exports

_LAZY = {
    "ModelConfig": "jaxgen.model.config",
    "RopeScaling": "jaxgen.model.config",
    "MLAConfig": "jaxgen.model.config",
    "MoEConfig": "jaxgen.model.config",
    "LoRAError": "jaxgen.model.errors",
    "ModelLoadError": "jaxgen.model.errors",
    "Transformer": "jaxgen.model.llama",
    "forward": "jaxgen.model.llama",
    "init_params": "jaxgen.model.llama",
    "unroll_layers": "jaxgen.model.llama",
    "LoRABatch": "jaxgen.model.lora",
    "LoRAWeights": "jaxgen.model.lora",
    "load_adapter": "jaxgen.model.lora",
    "stack_adapters": "jaxgen.model.lora",
    "convert": "jaxgen.model.loading",
    "load_model": "jaxgen.model.loading",
    "load_tokenizer": "jaxgen.model.loading",
    "save_checkpoint": "jaxgen.model.loading",
    "Tokenizer": "jaxgen.model.tokenizer",
}

__getattr__, __all__ = lazy_exports(__name__, _LAZY)
