"""KV cache pytrees (contiguous and paged) and the host-side block manager.

The device-side names are imported lazily so that `cache.block_manager` (host only) can be
used without importing JAX, Flax or Pallas.
"""

from jaxgen._lazy import lazy_exports

_LAZY = {
    "FlatMetadata": "jaxgen.cache.paged",
    "KVCache": "jaxgen.cache.contiguous",
    "MLACache": "jaxgen.cache.mla",
    "StepMetadata": "jaxgen.cache.contiguous",
    "PagedKVCache": "jaxgen.cache.paged",
    "PagedMLACache": "jaxgen.cache.mla",
    "PagedMetadata": "jaxgen.cache.paged",
    "RaggedMetadata": "jaxgen.cache.paged",
}

__getattr__, __all__ = lazy_exports(__name__, _LAZY)
