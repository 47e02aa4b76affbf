"""KV cache pytrees (contiguous and paged) and the host-side block manager.

The device-side names are imported lazily so that `cache.block_manager` (host only) can be
used without importing JAX, Flax or Pallas.
"""

import importlib

_LAZY = {
    "KVCache": "jaxgen.cache.contiguous",
    "StepMetadata": "jaxgen.cache.contiguous",
    "PagedKVCache": "jaxgen.cache.paged",
    "PagedMetadata": "jaxgen.cache.paged",
    "RaggedMetadata": "jaxgen.cache.paged",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cache' has no attribute {name!r}")
