"""KV cache pytrees (contiguous and paged) and the host-side block manager."""

from cache.contiguous import KVCache, StepMetadata

__all__ = ["KVCache", "StepMetadata"]
